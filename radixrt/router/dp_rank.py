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
    ValueError for a rank that is not an integer (a worker would say it serves no ranks)."""
    if path != "/generate" or not isinstance(body, dict):
        return None, None
    given = [(f, body[f]) for f in RANK_FIELDS if body.get(f) is not None]
    if not given:
        return None, None
    field, rank = given[0]
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise ValueError(f"'{field}' must be an integer rank of this router's workers, got {rank!r}")
    forwarded = {k: v for k, v in body.items() if k not in RANK_FIELDS}
    return rank, json.dumps(forwarded).encode()
