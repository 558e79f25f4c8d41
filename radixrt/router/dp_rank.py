"""SGLang's ``routed_dp_rank`` (and the Engine's name for it, ``data_parallel_rank``) behind the
router: a ``/generate``, ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` or
``/v1/messages`` body that names a rank,
or SGLang's ``X-Data-Parallel-Rank`` header on any of them (the header first, as SGLang reads
them), goes to that worker, in the order the router was given its workers (``--dp N``: its
replicas, rank 0 first), without the field (each worker serves one rank). A rank the router has
no worker for is a 400; a rank's requests do not fail over."""

from __future__ import annotations

import json
from typing import Any, Optional

RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank")
RANK_HEADER = "x-data-parallel-rank"
RANKED_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


def rank_of(path: str, body: Any, header: Optional[str] = None) -> tuple[Optional[int], Optional[bytes]]:
    """(the rank a request asks for, the body to forward without the rank's field, or None to
    forward it as it came), or (None, None); ValueError for a rank that is not an integer (a
    worker would say it serves no ranks)."""
    if path not in RANKED_PATHS:
        return None, None
    given = [(f, body[f]) for f in RANK_FIELDS if isinstance(body, dict) and body.get(f) is not None]
    forwarded = json.dumps({k: v for k, v in body.items() if k not in RANK_FIELDS}).encode() if given else None
    if header is not None:
        try:
            return int(header.strip()), forwarded
        except ValueError:
            raise ValueError(
                f"'X-Data-Parallel-Rank' must be an integer rank of this router's workers, got {header!r}"
            ) from None
    if not given:
        return None, None
    field, rank = given[0]
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise ValueError(f"'{field}' must be an integer rank of this router's workers, got {rank!r}")
    return rank, forwarded
