"""A request body's `TokenKey`: the token ids and cache namespace the worker
will look up in its radix cache, computed the way the worker computes them,
or None where the router cannot do that exactly (the policy then uses its
approximate tree).

* ``/generate``: ``input_ids`` (a list of ints; a batch: its first list) as
  they are; ``text`` (a string; a batch: its first) through the model's
  tokenizer as the worker's ``TokenizerManager.encode`` does
  (``tokenizer.encode(text)``, special tokens added), when the router has
  the tokenizer. Namespace: ``cache_salt`` and ``extra_key`` (`cache_namespace`).
* ``/v1/completions``: ``prompt`` likewise (string, list of strings, token
  ids, list of token-id lists: the first prompt); namespace from
  ``cache_salt``, ``prompt_cache_key`` and ``extra_key``.
* ``/v1/chat/completions``: None. The worker renders the messages through
  the chat template (with tools, turn reuse and template arguments); the
  router does not repeat that.

A body the worker would refuse (both or neither of ``text`` and
``input_ids``, a salt that is not a string) has no key; nor has one with a salt per prompt.
"""

from __future__ import annotations

from typing import Any, Optional

from radixrt.requests.cache_fields import cache_namespace
from radixrt.router.kv_event_index import TokenKey

NAMESPACE_FIELDS = ("cache_salt", "prompt_cache_key", "extra_key")  # `cache_namespace`'s arguments, in order
# The longest prompt followed, in tokens: bounds the router's hashing per request.
MAX_TOKENS = 65536


def _ids(value: Any) -> Optional[tuple[int, ...]]:
    if isinstance(value, list) and value and all(type(x) is int for x in value):
        return tuple(value[:MAX_TOKENS])
    return None


def _first(value: Any) -> Any:
    """A prompt, or the first of a batch of prompts (a list of strings or of id lists)."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        return value[0]
    return value


def _encode(text: Any, tokenizer: Any) -> Optional[tuple[int, ...]]:
    if not isinstance(text, str) or not text or tokenizer is None:
        return None
    return tuple(list(tokenizer.encode(text))[:MAX_TOKENS])


def _namespace(body: dict) -> tuple[bool, Optional[str]]:
    """(valid, namespace) from the body's salt fields (a route without one of them refuses it)."""
    values = [body.get(k) for k in NAMESPACE_FIELDS]
    if any(v is not None and not isinstance(v, str) for v in values):
        return False, None
    return True, cache_namespace(*values)


def token_key(path: str, body: Any, tokenizer: Any = None) -> Optional[TokenKey]:
    """The key of ``body`` posted to ``path`` (``tokenizer``: the worker's, or
    None: text prompts have no key). Blocking: tokenizes."""
    if not isinstance(body, dict):
        return None
    if path == "/generate":
        ok, ns = _namespace(body)
        text, input_ids = body.get("text"), body.get("input_ids")
        if not ok or (text is None) == (input_ids is None):
            return None
        ids = _encode(_first(text), tokenizer) if text is not None else _ids(_first(input_ids))
    elif path == "/v1/completions":
        ok, ns = _namespace(body)
        prompt = _first(body.get("prompt"))
        if not ok:
            return None
        ids = _encode(prompt, tokenizer) if isinstance(prompt, str) else _ids(prompt)
    else:
        return None
    return TokenKey(ns, ids) if ids else None
