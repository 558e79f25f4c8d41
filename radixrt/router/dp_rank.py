"""SGLang's ``routed_dp_rank`` (and the Engine's name for it, ``data_parallel_rank``) behind the
router: a ``/generate`` body that names a rank goes to that worker, in the order the router was
given its workers (``--dp N``: its replicas, rank 0 first), without the field (each worker serves
one rank). A rank the router has no worker for is a 400; a rank's requests do not fail over."""

from __future__ import annotations

import json
from typing import Any, Optional

RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank")


def rank_of(path: str, body: Any) -> tuple[Optional[int], Optional[bytes]]:
    """(the rank a ``/generate`` body asks for, the body to forward without it), or (None, None);
    a rank that is not an integer is left for the worker to refuse."""
    if path != "/generate" or not isinstance(body, dict):
        return None, None
    given = [body[f] for f in RANK_FIELDS if body.get(f) is not None]
    if not given or not isinstance(given[0], int) or isinstance(given[0], bool):
        return None, None
    forwarded = {k: v for k, v in body.items() if k not in RANK_FIELDS}
    return given[0], json.dumps(forwarded).encode()
