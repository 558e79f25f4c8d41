"""A routing key's first element(s): the cache namespace it belongs to (see
`keys.routing_key`), so that the router's trees never match one namespace's
prompt against another's."""

from __future__ import annotations

import hashlib
from typing import Any, Optional

SHARED_MARKER = "\x00"  # the shared namespace (no salt)
SALTED_MARKER = "\x01"  # then the namespace's digest, in hex


def namespace_marker(namespace: Optional[str]) -> str:
    """The first element(s) of a key in ``namespace`` (None: the shared one). Markers of two
    namespaces differ within their own length, so no key of one extends into another's
    prompt; a digest keeps salts out of the trees and the markers of one length."""
    if namespace is None:
        return SHARED_MARKER
    return SALTED_MARKER + hashlib.blake2b(namespace.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def marker_len(key: Any) -> int:
    """How many leading elements of ``key`` are its namespace marker (0: a key without one).
    A token-id key carries the marker as one element; a text key as its characters."""
    if isinstance(key, tuple):
        return 1 if key and isinstance(key[0], str) else 0
    if isinstance(key, str) and key:
        return {SHARED_MARKER: 1, SALTED_MARKER: 1 + 16}.get(key[0], 0)
    return 0
