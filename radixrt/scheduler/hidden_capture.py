"""The scheduler's side of ``return_hidden_states`` (radixrt/requests/hidden_states.py).

A step copies the hidden rows of each asking request's tokens to the host (`HiddenJob`,
the launcher); processing the step's results files them by sequence position into
``Req.hidden_rows`` (`file_rows`; a draft tree's nodes in tree order, until its kept
branch's rows are moved to the branch's positions, `keep_branch_rows`), and drops rows
past what the request has kept (`keep_rows`: a rejected draft's, or a token not output
after all). A row is filed again when its position is computed again (a retracted request
recomputes from its last row on), so ``hidden_rows[p]`` is always the row of the request's
token ``p``. The finished request hands them over packed (`pack_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.requests.hidden_states import PackedHidden
from radixrt.scheduler.request import Req


@dataclass(frozen=True)
class HiddenJob:
    """Copy rows ``offset .. offset+q-1`` of a step's hidden states: batch row ``batch_index``'s
    tokens, sequence positions ``start`` on; void if the request was retracted since
    (``retractions`` is its count at launch)."""

    batch_index: int
    offset: int
    q: int
    start: int
    retractions: int


def copy_rows(hidden: torch.Tensor, job: HiddenJob) -> torch.Tensor:
    """The job's rows as a float32 host tensor [q, hidden_size] that owns its memory."""
    return hidden[job.offset : job.offset + job.q].float().cpu().clone()


def file_rows(req: Req, job: HiddenJob, rows: torch.Tensor) -> None:
    """File ``rows`` at their positions (replacing rows of positions computed again)."""
    kept = req.hidden_rows
    assert kept is not None, "a hidden job for a request that did not ask"
    if job.start > len(kept):  # positions are computed from the last row held on; never a gap, but
        # if one came (a cache path that ignored max_prefix_len), its rows are unknown (NaN), not a crash
        kept.extend(torch.full_like(rows[0], float("nan")) for _ in range(job.start - len(kept)))
    del kept[job.start :]
    kept.extend(rows.unbind(0))


def keep_branch_rows(req: Req, base: int, branch: list[int]) -> None:
    """A draft tree was verified (`ResultProcessor._take_tree`): its node ``i``'s row was filed
    at position ``base + i`` (tree order); the kept branch's nodes become positions ``base ..``,
    so their rows move there (as the branch's KV does, `KVCacheManager.keep_branch`). The rows
    past the branch are dropped by `keep_rows`. Nothing to move if this step's rows were not
    filed (the request was retracted since its launch)."""
    kept = req.hidden_rows
    if kept is None or len(kept) <= base or list(branch) == list(range(len(branch))):
        return
    tail = kept[base:]
    assert all(a < len(tail) for a in branch), "a kept draft node without a filed row"
    kept[base:] = [tail[a] for a in branch]


def keep_rows(req: Req) -> None:
    """Drop the rows past the request's last computed token that it kept: the output's last
    token has no row yet (the next step computes it), a rejected draft's none at all."""
    kept = req.hidden_rows
    if kept is not None:
        del kept[len(req.input_ids) + max(len(req.output_ids) - 1, 0) :]


def pack_rows(req: Req) -> PackedHidden:
    """The finished request's rows (those it kept), packed to travel to the front."""
    keep_rows(req)
    kept = req.hidden_rows or []
    size = kept[0].numel() if kept else 0
    data = torch.stack(kept).numpy().tobytes() if kept else b""
    return min(len(req.input_ids), len(kept)), size, data
