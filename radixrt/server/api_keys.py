"""The API keys a request presents, as the server and the router front both read them."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Optional

# Paths open without a key, as in SGLang (sglang/srt/utils/auth.py): health and readiness probes and
# Prometheus scrapes need no secret (/metrics shows counts and timings only, never request text).
OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def has_dot_segments(path: str) -> bool:
    """Whether ``path`` (percent-decoded, as ASGI gives it) holds a ``.`` or ``..`` segment. An
    HTTP client resolves them (httpx does), so a front that checked ``/metrics/../generate`` as an
    open path would send ``/generate``: a front refuses such paths instead."""
    return any(segment in (".", "..") for segment in path.split("/"))


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> Optional[str]:
    """The key a request presents: ``Authorization: Bearer KEY`` or ``X-API-Key: KEY``."""
    for name, value in headers:
        if name == b"authorization":
            v = value.decode("latin-1").strip()
            if v.lower().startswith("bearer "):
                return v[7:].strip()
        elif name == b"x-api-key":
            return value.decode("latin-1").strip()
    return None


def same_key(a: str, b: str) -> bool:
    """Whether two keys are equal, in time that does not depend on where they differ."""
    return hmac.compare_digest(a.encode(), b.encode())
