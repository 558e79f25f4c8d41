"""The routing key of a request body: the prompt the cache-aware policy
matches against its trees.

* ``/generate``: ``text`` (a string; a batch: its first string) or else
  ``input_ids`` (a list of ints; a batch: its first list);
* ``/v1/completions``: ``prompt`` (string, list of strings, token ids, list
  of token-id lists: the first prompt);
* ``/v1/chat/completions``: the messages flattened to text in order
  (``role`` then the text content of each), so conversations that share
  their first messages share a prefix.

Every key starts with its cache namespace's marker (`namespace_marker`):
the worker never shares KV across namespaces (``cache_salt``, ``extra_key``, and
``prompt_cache_key`` on the OpenAI routes), and neither may the router's
trees, or a client could learn from where its request was routed (the
``x-radixrt-worker`` header, the policy's counters) whether another
namespace sent a prompt that begins like its own.

Anything else (a malformed body, a route without a prompt, a salt that is
not a string) has no key: the policy then routes by load. The router never
rejects a body itself; the worker answers malformed ones with its own 4xx.
"""

from __future__ import annotations

from typing import Any, Optional

from radixrt.requests.cache_fields import cache_namespace
from radixrt.router.key_marker import namespace_marker
from radixrt.router.policies import RouteKey
from radixrt.router.token_keys import NAMESPACE_FIELDS

# The longest key kept: enough to tell prompts apart by their prefix, and it bounds the router's work per request.
MAX_KEY_LEN = 16384


def _ids(value: Any) -> Optional[tuple[int, ...]]:
    if isinstance(value, list) and value and all(type(x) is int for x in value[:MAX_KEY_LEN]):
        return tuple(value[:MAX_KEY_LEN])
    return None


def _prompt(value: Any) -> Optional[RouteKey]:
    if isinstance(value, str):
        return value[:MAX_KEY_LEN] or None
    ids = _ids(value)
    if ids is not None:
        return ids
    if isinstance(value, list) and value:
        return _prompt(value[0]) if isinstance(value[0], (str, list)) else None
    return None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text", ""), str))
    return ""


def routing_key(path: str, body: Any) -> Optional[RouteKey]:
    """The key of ``body`` posted to ``path`` (its namespace's marker, then its prompt), or None."""
    if not isinstance(body, dict):
        return None
    salts = [body.get(name) for name in NAMESPACE_FIELDS]
    if any(s is not None and not isinstance(s, str) for s in salts):
        return None
    prompt = _prompt_key(path, body)
    if prompt is None:
        return None
    marker = namespace_marker(cache_namespace(*salts))
    return marker + prompt if isinstance(prompt, str) else (marker, *prompt)


def _prompt_key(path: str, body: dict) -> Optional[RouteKey]:
    if path == "/generate":
        if body.get("text") is not None:
            return _prompt(body["text"])
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            ids = ids[0]
        return _ids(ids)
    if path == "/v1/completions":
        return _prompt(body.get("prompt"))
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        parts = []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"<{m.get('role')}>{_content_text(m.get('content'))}\n")
        text = "".join(parts)[:MAX_KEY_LEN]
        return text or None
    return None
