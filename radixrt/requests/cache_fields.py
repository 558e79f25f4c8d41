"""The request fields that name a radix-cache namespace or ask about the cache.

``cache_salt`` and ``extra_key`` (SGLang's) and ``prompt_cache_key`` (OpenAI's)
put a request's prefixes in a namespace of their own (`cache_namespace`); ``return_cache_info``
asks for the prefix match explained (`cache_info_mode`)."""

from __future__ import annotations

import json
from typing import Any, Optional

from radixrt.requests.errors import RequestError

MAX_NAMESPACE_KEY_CHARS = 1024  # cache_salt / prompt_cache_key: an id (OpenAI's prompt_cache_key is one)


def request_namespace(cache_salt: Any, prompt_cache_key: Any, extra_key: Any = None) -> Optional[str]:
    """`cache_namespace` of a request's fields, checked: each a string of at most
    MAX_NAMESPACE_KEY_CHARS characters, or None (a RequestError naming the field)."""
    fields = (("cache_salt", cache_salt), ("prompt_cache_key", prompt_cache_key), ("extra_key", extra_key))
    for name, value in fields:
        if value is not None and not isinstance(value, str):
            raise RequestError(f"'{name}' must be a string.", name)
        if value is not None and len(value) > MAX_NAMESPACE_KEY_CHARS:
            # the storage tier keeps each namespace's text on disk; a key is an id, not a payload
            raise RequestError(f"'{name}' holds {len(value)} characters; at most {MAX_NAMESPACE_KEY_CHARS}.", name)
    return cache_namespace(cache_salt, prompt_cache_key, extra_key)


def cache_namespace(
    cache_salt: Optional[str], prompt_cache_key: Optional[str] = None, extra_key: Optional[str] = None
) -> Optional[str]:
    """The radix-cache namespace of a request: None (the shared one) when it
    gives none of ``cache_salt``, ``prompt_cache_key`` and ``extra_key``, else the
    JSON array of them (``extra_key`` only where given, so that namespaces named
    before it existed keep their names), so that distinct triples never share a
    namespace (whatever characters the strings hold) and a salt means the same
    on every route."""
    if cache_salt is None and prompt_cache_key is None and extra_key is None:
        return None
    if extra_key is None:
        return json.dumps([cache_salt, prompt_cache_key])
    return json.dumps([cache_salt, prompt_cache_key, extra_key])


def cache_info_mode(return_cache_info: Any) -> str:
    """The `RequestSpec.cache_info` mode of a ``return_cache_info`` value:
    False / None: "" (none); True: "own" (explained from the request's own text
    and match only: what a cache hit on it tells anyway); "full": "full" (the
    cache's content around the match too, i.e. other requests' text: the
    server asks for its admin key)."""
    if return_cache_info is None or return_cache_info is False:
        return ""
    if return_cache_info is True:
        return "own"
    if return_cache_info == "full":
        return "full"
    raise RequestError("'return_cache_info' must be a boolean or \"full\".", "return_cache_info")
