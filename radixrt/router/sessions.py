"""SGLang's sessions behind the router: a session lives in one worker (its turns are remembered
there), so every request of a session goes to the same worker.

`session_of` finds a request's session: ``session_id`` of ``/open_session`` and
``/close_session``, ``session_params.id`` of ``/generate``. An ``/open_session`` without an id
gets one from the router (a random hex string, put in the body it forwards), so the worker is
known before the session exists. `session_worker` places a session by a hash of its id over the
configured workers (sorted), the same in every router: a session's requests never fail over (its
turns would be missing elsewhere); while its worker is down they get a 503.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any, Optional

SESSION_PATHS = ("/open_session", "/close_session")


def session_of(path: str, body: Any, raw: bytes) -> tuple[Optional[str], bytes]:
    """(the session ``body`` posted to ``path`` belongs to, or None; the body to forward)."""
    if path == "/open_session" and not raw.strip():
        body = {}
    if not isinstance(body, dict):
        return None, raw
    if path == "/open_session" and body.get("session_id") is None:
        sid = uuid.uuid4().hex
        return sid, json.dumps({**body, "session_id": sid}).encode()
    if path in SESSION_PATHS:
        sid = body.get("session_id")
    elif path == "/generate" and isinstance(body.get("session_params"), dict):
        sid = body["session_params"].get("id")
    else:
        return None, raw
    return (sid if isinstance(sid, str) else None), raw


def session_worker(urls: list[str], session_id: str) -> str:
    """The worker (of ``urls``, all configured) that holds ``session_id``."""
    ranked = sorted(urls)
    digest = int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:8], "big")
    return ranked[digest % len(ranked)]
