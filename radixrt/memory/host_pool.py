"""The host tier under the radix tree: a second KV pool in CPU memory, its
page allocator, and the ordered queue of copies between it and the device pool.

Ownership contract: every host slot is at all times exactly one of free (on
the host allocator's free list) or owned by the radix tree (``node.host_value``
of some node); ``free + tree == total`` (`RadixCache.check_integrity`).

Copies never run on the scheduler's thread. The tree and the KV manager only
*queue* them (`KVTransferQueue`); the scheduler hands the queue's contents to
the step it launches and the forward thread runs them, in queue order, around
that step's forward (`KVTransfers.run_before` / `run_after`). Queue order is
the order of every slot reuse, so:

- a device->host copy of an evicted node runs before any later forward can
  write the device slots that eviction freed (they are handed out only to
  requests of later steps);
- a host->device load runs before the forward of the step that admitted the
  request that needs it ("start at admission, wait before the forward");
- a write-through copy of KV that the launched step itself computes runs
  after that step's forward (``after_forward=True``).

On CUDA the host pool is pinned and each batch of copies runs on a side
stream; the compute stream waits on an event before the forward that reads
them, so the copies overlap whatever ran before on the compute stream. On
CPU the copies are plain indexed copies on the forward thread.

A host pool may store a different format from the device pool (``int8`` on
the host under an unquantized device pool halves host bytes per token): K/V
are dequantized to the model dtype and requantized on each copy. Such a host
tier is lossy, so the default is the device pool's own format, which copies
bytes as they are and never changes an answer.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from radixrt.memory.kv_pool import KVPool, PageAllocator
from radixrt.memory.kv_transfer import TransferOp


class HostKVPool:
    """The host tier's storage and allocator, shaped like the device pool.

    ``num_tokens`` is rounded down to whole pages. ``kv_cache_dtype``:
    ``auto`` stores what the device pool stores (the copy is exact); ``int8``
    quantizes on the host (see the module docstring). Pinned on CUDA."""

    def __init__(self, device_pool: KVPool, num_tokens: int, kv_cache_dtype: str = "auto",
                 staged: Optional[bool] = None) -> None:
        P = device_pool.page_size
        num_pages = num_tokens // P
        if num_pages < 1:
            raise ValueError(f"host KV pool of {num_tokens} tokens holds no page of {P}")
        host_dtype = device_pool.kv_cache_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        self.device_pool = device_pool
        pin = device_pool.device.type == "cuda"
        self.pool = KVPool(device_pool.num_layers, num_pages, P, device_pool.num_kv_heads, device_pool.head_dim,
                           device_pool.dtype, "cpu", kv_cache_dtype=host_dtype, pin_memory=pin)
        self.allocator = PageAllocator(num_pages, P)
        self.exact = self.pool.storage_dtype == device_pool.storage_dtype
        self._stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device_pool.device) if pin else None
        # staged copies (default on CUDA): one op's rows of every layer are gathered into one buffer
        # (pinned on the host side) and cross in a single copy, instead of one small copy per tensor
        self.staged = pin if staged is None else staged
        self._staging: Optional[torch.Tensor] = None
        self._staging_free: Optional[Any] = None  # CUDA event: the last load has left the staging buffer

    @property
    def total_slots(self) -> int:
        return self.allocator.total_slots

    @property
    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_token

    # ------------------------------------------------------------- copies
    def run(self, ops: list[TransferOp]) -> None:
        """Run copies in order (the forward thread calls this). On CUDA they are
        issued on a side stream after the compute stream's work so far, and the
        compute stream waits for them before anything issued later."""
        if not ops:
            return
        if self._stream is None:
            for op in ops:
                self._copy(op)
            return
        compute = torch.cuda.current_stream(self.device_pool.device)
        self._stream.wait_stream(compute)  # offloads read KV the compute stream wrote
        with torch.cuda.stream(self._stream):
            for op in ops:
                self._copy(op)
        done = torch.cuda.Event()
        done.record(self._stream)
        compute.wait_event(done)

    @torch.inference_mode()
    def _copy(self, op: TransferOp) -> None:
        dev, host = self.device_pool, self.pool
        src_pool, dst_pool = (dev, host) if op.to_host else (host, dev)
        src_idx = torch.tensor(op.src_slots, dtype=torch.int64, device=src_pool.device)
        dst_idx = torch.tensor(op.dst_slots, dtype=torch.int64, device=dst_pool.device)
        if not self.exact:
            for layer in range(dev.num_layers):
                src, dst = src_pool.layer_cache(layer), dst_pool.layer_cache(layer)
                k, v = src.gather(src_idx, dev.dtype)
                dst.store(dst_idx, k.to(dst_pool.device, non_blocking=True), v.to(dst_pool.device, non_blocking=True))
            return
        pairs = [pair for layer in range(dev.num_layers)
                 for pair in _tensor_pairs(src_pool.layer_cache(layer), dst_pool.layer_cache(layer))]
        if self.staged:
            self._copy_staged(pairs, src_idx, dst_idx, op.to_host)
            return
        for s, d in pairs:
            d.index_copy_(0, dst_idx, s.index_select(0, src_idx).to(d.device, non_blocking=True))

    def _copy_staged(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], src_idx: torch.Tensor,
                     dst_idx: torch.Tensor, to_host: bool) -> None:
        """Gather the rows of every tensor into one buffer on the source side, move it
        in one copy (through the pinned staging buffer), scatter on the destination side."""
        n = int(src_idx.numel())
        sizes = [n * s[0].numel() * s.element_size() for s, _ in pairs]
        offsets, total = [], 0
        for nb in sizes:
            offsets.append(total)
            total += -(-nb // 8) * 8  # 8-byte aligned views
        staging = self._staging_buffer(total)
        dev_device = self.device_pool.device

        def view(buf: torch.Tensor, i: int, like: torch.Tensor) -> torch.Tensor:
            o = offsets[i]
            return buf[o:o + sizes[i]].view(like.dtype).view(n, *like.shape[1:])

        if to_host:
            gathered = torch.empty(total, dtype=torch.uint8, device=dev_device)
            for i, (s, _) in enumerate(pairs):
                torch.index_select(s, 0, src_idx, out=view(gathered, i, s))
            staging.copy_(gathered, non_blocking=True)
            if dev_device.type == "cuda":
                torch.cuda.current_stream(dev_device).synchronize()  # the host scatter reads the staging buffer
            for i, (s, d) in enumerate(pairs):
                d.index_copy_(0, dst_idx, view(staging, i, s))
            return
        if self._staging_free is not None:
            self._staging_free.synchronize()  # the previous load has finished reading the staging buffer
        for i, (s, _) in enumerate(pairs):
            torch.index_select(s, 0, src_idx, out=view(staging, i, s))
        moved = staging.to(dev_device, non_blocking=True)
        for i, (s, d) in enumerate(pairs):
            d.index_copy_(0, dst_idx, view(moved, i, s))
        if dev_device.type == "cuda":
            self._staging_free = torch.cuda.Event()
            self._staging_free.record(torch.cuda.current_stream(dev_device))

    def _staging_buffer(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer of at least ``nbytes`` (pinned under a CUDA pool), grown by doubling."""
        buf = self._staging
        if buf is None or buf.numel() < nbytes:
            if self._staging_free is not None:
                self._staging_free.synchronize()
            size = max(nbytes, 2 * (buf.numel() if buf is not None else 0), 1 << 20)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.device_pool.device.type == "cuda")
            self._staging = buf
        return buf[:nbytes]


def _tensor_pairs(src: Any, dst: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(source, destination) flat tensors of one layer: K, V, then int8 scales;
    1-byte dtypes as uint8 (fp8 has no CPU index kernels: move the bytes)."""
    pairs = [(src.k, dst.k), (src.v, dst.v)]
    if src.k_scale is not None and dst.k_scale is not None:
        pairs += [(src.k_scale, dst.k_scale), (src.v_scale, dst.v_scale)]
    return [(s.view(torch.uint8), d.view(torch.uint8)) if s.element_size() == 1 else (s, d) for s, d in pairs]


def host_pool_tokens(device_tokens: int, bytes_per_token: float, ratio: float, size_gib: float,
                     num_tokens: Optional[int]) -> int:
    """Host tier capacity in tokens from the flags, first match wins:
    ``num_tokens`` (``--host-kv-size``), ``size_gib`` > 0 (``--hicache-size``,
    GiB of host KV), else ``ratio`` x the device pool (``--hicache-ratio``)."""
    if num_tokens is not None:
        return int(num_tokens)
    if size_gib > 0:
        return int(size_gib * (1 << 30) // bytes_per_token)
    return int(device_tokens * ratio)
