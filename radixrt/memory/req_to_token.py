"""The request-to-slot table: each running request's KV slots, on the model's device.

Row ``r`` of ``table`` holds, at column ``i``, the flat slot id of token ``i``
of the request that owns row ``r``. The model runner builds every step's
attention metadata from it with a few tensor ops (`AttentionMetadata.from_table`),
so the host never walks a request's slot list per step: it only names the
rows and lengths of the batch.

Ownership: a request holds a row from admission until it stops running
(finished, aborted or retracted); `KVCacheManager` is the only writer. The
table mirrors ``req.slots`` (the host's record, used for the radix tree and
for freeing) column for column up to ``len(req.slots)``; columns past that are
stale and never read. Writes are queued on the host; the scheduler takes
them once per step (`take_writes`) and the forward applies them in one
``index_put_`` before it runs, so per-step host work is one entry per new token.

The last row (``padding_row``) is never handed out: its column 0 points at a
scratch slot, for the padding rows of captured CUDA-graph batches.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


class ReqToTokenPool:
    def __init__(
        self, max_requests: int, max_context_len: int, device: torch.device | str = "cpu", scratch_slot: int = 0
    ) -> None:
        if max_requests < 1 or max_context_len < 1:
            raise ValueError("ReqToTokenPool needs max_requests >= 1 and max_context_len >= 1")
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.table = torch.zeros((max_requests + 1, max_context_len), dtype=torch.int32, device=self.device)
        self.padding_row = max_requests
        self.table[self.padding_row, 0] = scratch_slot
        self._free_rows = list(range(max_requests - 1, -1, -1))  # row 0 handed out first
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._slots: list[int] = []

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError(f"all {self.max_requests} request rows are in use")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        """Give a row back; its columns are stale from now on."""
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: Sequence[int]) -> None:
        """Queue ``table[row, start:start+len(slots)] = slots`` for the next `flush`."""
        n = len(slots)
        if n == 1:
            self._rows.append(row)
            self._cols.append(start)
            self._slots.append(slots[0])
            return
        if start + n > self.max_context_len:
            raise ValueError(f"row {row}: {start + n} tokens exceed the table's {self.max_context_len} columns")
        self._rows.extend([row] * n)
        self._cols.extend(range(start, start + n))
        self._slots.extend(slots)

    def write_many(self, rows: list[int], cols: list[int], slots: list[int]) -> None:
        """Queue ``table[rows[i], cols[i]] = slots[i]`` for every ``i`` (one slot per
        entry; the decode fast path queues a whole batch's new slots at once)."""
        self._rows.extend(rows)
        self._cols.extend(cols)
        self._slots.extend(slots)

    def take_writes(self) -> Optional[torch.Tensor]:
        """The queued writes as one host tensor ``[3, n]`` (rows, columns, slots),
        or None; the queue is emptied. The scheduler takes them while preparing
        a step and the forward applies them (`apply`), possibly on another thread."""
        if not self._rows:
            return None
        writes = torch.tensor([self._rows, self._cols, self._slots], dtype=torch.int64)
        self._rows, self._cols, self._slots = [], [], []
        return writes

    def apply(self, writes: Optional[torch.Tensor]) -> None:
        """Write taken writes into the table (one host-to-device copy and one scatter)."""
        if writes is None:
            return
        writes = writes.to(self.device, non_blocking=True)
        self.table.index_put_((writes[0], writes[1]), writes[2].to(torch.int32))

    def flush(self) -> None:
        """Apply the queued writes now."""
        self.apply(self.take_writes())

    def row_slots(self, row: int, length: int) -> list[int]:
        """The first ``length`` slots of a row (tests and debugging; flushes first)."""
        self.flush()
        return self.table[row, :length].tolist()
