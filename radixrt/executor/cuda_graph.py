"""Decode steps captured in CUDA graphs and replayed.

A decode step of a small model is a few hundred tiny kernel launches; on a GPU
the launches, not the math, set its time. `DecodeCudaGraphRunner` captures the
whole model forward of a pure decode batch once per batch size in
``capture_sizes`` and replays it:

- static input buffers (token ids, positions, KV write slots) are filled before
  each replay; the captured kernels read them at fixed addresses;
- a batch of ``n`` requests runs the graph of the smallest captured size
  ``bs >= n``; the ``bs - n`` padding rows attend over one token of a scratch
  KV page that the allocator never hands out, write their K/V there, and their
  outputs are dropped;
- the attention backend plans its graph-mode decode wrapper for the padded
  batch outside the graph (``backend.plan_cuda_graph(meta, bs)``: FlashInfer
  fills the index buffers the captured kernels read). A backend without that
  method is planned with plain ``plan(meta)``, which is what the CPU emulation
  in the tests uses.

Prefill/extend batches and batches larger than the largest captured size run
eagerly. ``graph_factory`` swaps the CUDA graph for another capture/replay
object (the tests replay eagerly on CPU to check the buffer plumbing).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import torch

from radixrt.kernels import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 64, every 16 up to
    256, every 32 beyond; ``max_bs`` itself always included."""
    if max_bs < 1:
        return []
    sizes = [s for s in (1, 2, 4) if s < max_bs]
    s = 8
    while s < max_bs:
        sizes.append(s)
        s += 8 if s < 64 else 16 if s < 256 else 32
    sizes.append(max_bs)
    return sizes


def padded_batch_size(n: int, sizes: Sequence[int]) -> Optional[int]:
    """The smallest captured size that holds ``n`` requests (None: none does)."""
    for s in sizes:
        if s >= n:
            return s
    return None


def pad_decode_batch(
    input_ids: list[int], seq_slots: list[list[int]], bs: int, scratch_slot: int
) -> tuple[list[int], list[list[int]]]:
    """Pad a decode batch to ``bs`` rows: token 0 at a one-token sequence on the scratch slot."""
    pad = bs - len(seq_slots)
    if pad < 0:
        raise ValueError(f"{len(seq_slots)} requests do not fit a batch of {bs}")
    return input_ids + [0] * pad, seq_slots + [[scratch_slot]] * pad


class _CudaGraph:
    """torch.cuda.CUDAGraph behind the capture/replay interface."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """Replays by calling the captured function again (CPU tests, debugging)."""

    def __init__(self, pool: Any = None) -> None:
        self.fn: Optional[Callable[[], torch.Tensor]] = None
        self.out: Optional[torch.Tensor] = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        assert self.fn is not None and self.out is not None
        self.out.copy_(self.fn())


class DecodeCudaGraphRunner:
    """Captures ``model`` decode forwards for a set of batch sizes and replays them."""

    def __init__(
        self,
        model: Any,
        kv_pool: Any,
        backend: Any,
        max_bs: int,
        scratch_slot: int,
        page_size: int,
        device: str | torch.device,
        graph_factory: Optional[Callable[[Any], Any]] = None,
        max_context_len: Optional[int] = None,
        sizes: Optional[Sequence[int]] = None,
        pad: bool = True,
    ) -> None:
        """``max_context_len`` bounds a request's KV length; with ``max_bs`` it sizes
        the page-id buffer the graphs read (shared prefixes count once per request).
        Default: the pool's size. ``sizes``: the batch sizes to capture, none above
        ``max_bs`` (default `capture_sizes`); ``pad``: whether a batch of another size
        runs in the next larger graph (else `can_run` leaves it to the eager forward)."""
        self.model = model
        self.kv_pool = kv_pool
        self.backend = backend
        self.sizes = sorted(sizes) if sizes else capture_sizes(max_bs)
        assert self.sizes[-1] <= max_bs, (self.sizes, max_bs)
        self.pad = pad
        self.max_bs = max_bs
        self.scratch_slot = scratch_slot
        self.page_size = page_size
        self.device = torch.device(device)
        self.graph_factory = graph_factory or _CudaGraph
        self.ids = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self.out_slots = torch.full((max_bs,), scratch_slot, dtype=torch.int64, device=self.device)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        pool_pages = kv_pool.total_slots // page_size
        ctx_pages = pool_pages if max_context_len is None else min(pool_pages, -(-max_context_len // page_size))
        self.max_kv_pages = max_bs * ctx_pages
        if hasattr(backend, "init_cuda_graph_state"):
            backend.init_cuda_graph_state(max_bs, self.max_kv_pages)

    # ------------------------------------------------------------------ capture
    def _plan(self, meta: AttentionMetadata, bs: int) -> AttentionMetadata:
        """Point the metadata's per-token tensors at the static buffers and plan."""
        meta = replace(meta, out_slots=self.out_slots[:bs], positions=self.positions[:bs])
        plan_graph = getattr(self.backend, "plan_cuda_graph", None)
        if plan_graph is not None:
            plan_graph(meta, bs)
        else:
            self.backend.plan(meta)
        return meta

    def _load(self, input_ids: list[int], seq_slots: list[list[int]], bs: int) -> AttentionMetadata:
        ids, slots = pad_decode_batch(input_ids, seq_slots, bs, self.scratch_slot)
        meta = AttentionMetadata.build(slots, [1] * bs, self.page_size, self.device)
        return self._fill(torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True), meta, bs)

    def _fill(self, ids: torch.Tensor, meta: AttentionMetadata, bs: int) -> AttentionMetadata:
        """Copy the padded batch's inputs into the static buffers (device to
        device, in place) and plan."""
        self.ids[:bs].copy_(ids, non_blocking=True)
        self.positions[:bs].copy_(meta.positions, non_blocking=True)
        self.out_slots[:bs].copy_(meta.out_slots, non_blocking=True)
        return self._plan(meta, bs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the others reuse its memory pool)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for bs in reversed(self.sizes):
            meta = self._load([], [], bs)  # all padding: a valid dummy batch
            fn = self._forward_fn(meta, bs)
            if self.device.type == "cuda":
                # warm up on a side stream (lazy inits, allocator) before capturing
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        fn()
                torch.cuda.current_stream().wait_stream(stream)
            graph = self.graph_factory(pool)
            self.outputs[bs] = graph.capture(fn)
            self.graphs[bs] = graph
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s in %.1fs", self.sizes, time.perf_counter() - start)

    def _forward_fn(self, meta: AttentionMetadata, bs: int) -> Callable[[], torch.Tensor]:
        ids = self.ids[:bs]
        positions = self.positions[:bs]

        def fn() -> torch.Tensor:
            return self.model(ids, positions, meta, self.kv_pool, self.backend)

        return fn

    # ------------------------------------------------------------------- replay
    def can_run(self, q_lens: Sequence[int], kv_lens: Optional[Sequence[int]] = None) -> bool:
        """A pure decode batch of at most max_bs requests (of a captured size, without padding) whose pages
        fit the graphs' buffers."""
        if not (0 < len(q_lens) <= self.max_bs and all(q == 1 for q in q_lens)):
            return False
        if not self.pad and len(q_lens) not in self.sizes:
            return False
        if kv_lens is not None:
            ps = self.page_size
            return sum(-(-k // ps) for k in kv_lens) + self.max_bs <= self.max_kv_pages
        return True

    @torch.inference_mode()
    def forward_rows(
        self, ids: torch.Tensor, table: torch.Tensor, rows: list[int], kv_lens: list[int], padding_row: int
    ) -> torch.Tensor:
        """`forward` for a batch given as rows of the request-to-slot table:
        padding rows use ``padding_row`` (one token on the scratch slot) and token 0."""
        n = len(rows)
        bs = self._size_for(n)
        pad = bs - n
        meta = AttentionMetadata.from_table(
            table, rows + [padding_row] * pad, [1] * bs, kv_lens + [1] * pad, self.page_size
        )
        if pad:
            ids = torch.cat([ids, ids.new_zeros(pad)])
        self._fill(ids, meta, bs)
        return self._replay(n, bs)

    def _size_for(self, n: int) -> int:
        bs = padded_batch_size(n, self.sizes)
        if bs is None or bs not in self.graphs:
            raise ValueError(f"no captured graph holds a batch of {n}")
        return bs

    def _replay(self, n: int, bs: int) -> torch.Tensor:
        self.graphs[bs].replay()
        self.replays += 1
        return self.outputs[bs][:n].clone()

    @torch.inference_mode()
    def forward(self, input_ids: list[int], seq_slots: list[list[int]]) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode batch of n <= max_bs requests."""
        n = len(seq_slots)
        bs = self._size_for(n)
        self._load(input_ids, seq_slots, bs)
        return self._replay(n, bs)
