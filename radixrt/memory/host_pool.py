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

import math
from typing import Callable, Optional

import torch

from radixrt.kernels.kv_cache import INT8_SCALE_DTYPE, dequantize_int8, kv_storage_dtype, quantize_int8
from radixrt.memory.kv_format import kv_footprint
from radixrt.memory.kv_pool import KVPool, PageAllocator, as_bytes_if_1, lazy_zeros
from radixrt.memory.kv_transfer import QueuedOp, StoreOp


class HostKVPool:
    """The host tier's storage and allocator, page-first.

    Layout: one pinned (on CUDA) byte buffer ``[num_pages, page_bytes]``; a
    page holds its tokens' K and V of *every* layer (then the int8 scales),
    so a host page is one contiguous block and a run of host pages crosses
    to the device in one copy (SGLang's host pool offers the same
    "page first" layout for the same reason). The device pool stays
    layer-major; each copy is scattered or gathered there by page id.

    ``num_tokens`` is rounded down to whole pages. ``kv_cache_dtype``:
    ``auto`` stores what the device pool stores (the copy is exact: bytes
    move as they are); ``int8`` quantizes on the host (see the module
    docstring). ``by_runs`` (default: on CUDA): host pages cross in one copy
    per run of consecutive pages; otherwise one indexed gather/scatter on the
    host (what a CPU device pool wants)."""

    def __init__(
        self, device_pool: KVPool, num_tokens: int, kv_cache_dtype: str = "auto", by_runs: Optional[bool] = None
    ) -> None:
        P = device_pool.page_size
        num_pages = num_tokens // P
        if num_pages < 1:
            raise ValueError(f"host KV pool of {num_tokens} tokens holds no page of {P}")
        self.device_pool = device_pool
        self.kv_cache_dtype = device_pool.kv_cache_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        self.storage_dtype = kv_storage_dtype(self.kv_cache_dtype, device_pool.dtype)
        self.exact = self.storage_dtype == device_pool.storage_dtype
        self.footprint = kv_footprint(
            device_pool.num_layers,
            device_pool.num_kv_heads,
            device_pool.head_dim,
            self.kv_cache_dtype,
            str(device_pool.dtype),
        )
        H, D = device_pool.num_kv_heads, device_pool.head_dim
        # (layer, name) -> (byte offset in a page, dtype, shape of one page's part)
        self._segments: dict[tuple[int, str], tuple[int, torch.dtype, tuple[int, ...]]] = {}
        off = 0
        parts: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
            ("k", self.storage_dtype, (P, H, D)),
            ("v", self.storage_dtype, (P, H, D)),
        ]
        if self.storage_dtype == torch.int8:
            parts += [("ks", INT8_SCALE_DTYPE, (P, H)), ("vs", INT8_SCALE_DTYPE, (P, H))]
        for layer in range(device_pool.num_layers):
            for name, dtype, shape in parts:
                self._segments[(layer, name)] = (off, dtype, shape)
                nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                off += -(-nbytes // 8) * 8  # 8-byte aligned, so every part views as its dtype
        self.page_bytes = off
        pin = device_pool.device.type == "cuda"
        # pinned on CUDA; on a CPU lazily zeroed, so a large tier costs no start-up time and no memory until used
        if pin:
            self.buf = torch.zeros(num_pages, off, dtype=torch.uint8, pin_memory=True)
        else:
            self.buf = lazy_zeros((num_pages, off), torch.uint8, torch.device("cpu"))
        self.allocator = PageAllocator(num_pages, P)
        self.by_runs = pin if by_runs is None else by_runs
        self._stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device_pool.device) if pin else None
        # tensor parallel: hands each list of copies to the other ranks first, whose pools (their own
        # heads, the same slot numbering) then run the same copies in the same order (host_tier.py)
        self.mirror: Optional[Callable[[list[QueuedOp]], None]] = None

    @property
    def total_slots(self) -> int:
        return self.allocator.total_slots

    @property
    def bytes_per_token(self) -> int:
        return int(self.footprint.bytes_per_token)

    def part(self, buf: torch.Tensor, layer: int, name: str) -> torch.Tensor:
        """One part (``k``, ``v``, ``ks``, ``vs``) of one layer in a page-first byte
        buffer ``[n, page_bytes]``, as a view ``[n, page_size, ...]`` of its dtype."""
        off, dtype, shape = self._segments[(layer, name)]
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return buf[:, off : off + nbytes].view(dtype).view(buf.shape[0], *shape)

    def read(self, layer: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, H, D]`` (host storage dtype) of host slots (tests, checks)."""
        P = self.allocator.page_size
        pages = torch.tensor([s // P for s in slots])
        offs = torch.tensor([s % P for s in slots])
        return (self.part(self.buf, layer, "k")[pages, offs], self.part(self.buf, layer, "v")[pages, offs])

    # ------------------------------------------------------------- copies
    def run(self, ops: list[QueuedOp]) -> None:
        """Run copies in order (the forward thread calls this). On CUDA they are
        issued on a side stream after the compute stream's work so far, and the
        compute stream waits for them before anything issued later."""
        if not ops:
            return
        if self.mirror is not None:
            self.mirror(ops)
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
    def _copy(self, op: QueuedOp) -> None:
        P = self.allocator.page_size
        if isinstance(op, StoreOp):
            op.deliver(self.pack([s // P for s in op.src_slots[::P]]).cpu())
            return
        dev_slots, host_slots = (op.src_slots, op.dst_slots) if op.to_host else (op.dst_slots, op.src_slots)
        if P > 1:  # tree nodes are whole pages on both tiers
            dev_pages, host_pages = dev_slots[::P], host_slots[::P]
            dev_pages, host_pages = [s // P for s in dev_pages], [s // P for s in host_pages]
        else:
            dev_pages, host_pages = list(dev_slots), list(host_slots)
        if op.to_host:
            self._offload(dev_pages, host_pages)
        else:
            self._load(host_pages, dev_pages)

    def _load(self, host_pages: list[int], dev_pages: list[int]) -> None:
        dev = self.device_pool
        n = len(host_pages)
        pairs = _paired_runs(host_pages, dev_pages)
        if not self.by_runs and self.exact and len(pairs) <= MAX_SLICE_RUNS:
            self._load_runs(pairs)
            return
        if self.by_runs:
            staged = torch.empty((n, self.page_bytes), dtype=torch.uint8, device=dev.device)
            for i, p, ln in page_runs(host_pages):
                staged[i : i + ln].copy_(self.buf[p : p + ln], non_blocking=True)

            def part(layer: int, name: str) -> torch.Tensor:
                return self.part(staged, layer, name)

        else:  # the CPU: gather each part from the host buffer (no page-sized staging copy)
            take = torch.tensor(host_pages)

            def part(layer: int, name: str) -> torch.Tensor:
                return (
                    as_bytes_if_1(self.part(self.buf, layer, name))
                    .index_select(0, take)
                    .view(self.part(self.buf, layer, name).dtype)
                )

        idx = torch.tensor(dev_pages, dtype=torch.int64, device=dev.device)
        for layer in range(dev.num_layers):
            k, v = part(layer, "k"), part(layer, "v")
            if self.exact:
                _scatter(dev.k_buffers[layer], idx, k)
                _scatter(dev.v_buffers[layer], idx, v)
                if dev.k_scale_buffers is not None and dev.v_scale_buffers is not None:
                    _scatter(dev.k_scale_buffers[layer], idx, part(layer, "ks"))
                    _scatter(dev.v_scale_buffers[layer], idx, part(layer, "vs"))
                continue
            # int8 on the host under an unquantized device pool: dequantize on the device
            P, H, D = dev.page_size, dev.num_kv_heads, dev.head_dim
            kf = dequantize_int8(k, part(layer, "ks"), dev.dtype).reshape(n * P, H, D)
            vf = dequantize_int8(v, part(layer, "vs"), dev.dtype).reshape(n * P, H, D)
            slots = (idx.unsqueeze(1) * P + torch.arange(P, device=dev.device)).reshape(-1)
            dev.layer_cache(layer).store(slots, kf, vf)

    def _load_runs(self, pairs: list[tuple[int, int, int]]) -> None:
        """A CPU load whose pages form few runs on both sides (a node loaded back
        or read from storage, usually): slice copies, at memory speed, instead of
        row-by-row index copies."""
        dev = self.device_pool
        names = [("k", dev.k_buffers), ("v", dev.v_buffers)]
        if dev.k_scale_buffers is not None and dev.v_scale_buffers is not None:
            names += [("ks", dev.k_scale_buffers), ("vs", dev.v_scale_buffers)]
        for layer in range(dev.num_layers):
            for name, buffers in names:
                src = as_bytes_if_1(self.part(self.buf, layer, name))
                dst = as_bytes_if_1(buffers[layer])
                for h, d, ln in pairs:
                    dst[d : d + ln].copy_(src[h : h + ln])

    def _offload(self, dev_pages: list[int], host_pages: list[int]) -> None:
        staged = self.pack(dev_pages)
        if self.by_runs:
            for i, p, ln in page_runs(host_pages):
                self.buf[p : p + ln].copy_(staged[i : i + ln], non_blocking=True)
        else:
            self.buf.index_copy_(0, torch.tensor(host_pages), staged.cpu())

    def pack(self, dev_pages: list[int]) -> torch.Tensor:
        """Device pages ``dev_pages`` in the host format: ``uint8 [n, page_bytes]``
        on the device (what a host page or a stored block holds)."""
        dev = self.device_pool
        n = len(dev_pages)
        staged = torch.empty((n, self.page_bytes), dtype=torch.uint8, device=dev.device)
        idx = torch.tensor(dev_pages, dtype=torch.int64, device=dev.device)
        for layer in range(dev.num_layers):
            if self.exact:
                pairs = [("k", dev.k_buffers[layer]), ("v", dev.v_buffers[layer])]
                if dev.k_scale_buffers is not None and dev.v_scale_buffers is not None:
                    pairs += [("ks", dev.k_scale_buffers[layer]), ("vs", dev.v_scale_buffers[layer])]
                for name, src in pairs:
                    _gather_into(self.part(staged, layer, name), src, idx)
                continue
            P = dev.page_size
            slots = (idx.unsqueeze(1) * P + torch.arange(P, device=dev.device)).reshape(-1)
            kf, vf = dev.layer_cache(layer).gather(slots, dev.dtype)
            for name, x in (("k", kf), ("v", vf)):
                q, scale = quantize_int8(x)
                self.part(staged, layer, name).copy_(q.view(self.part(staged, layer, name).shape))
                self.part(staged, layer, name + "s").copy_(scale.view(self.part(staged, layer, name + "s").shape))
        return staged


MAX_SLICE_RUNS = 16  # a CPU load in at most this many runs copies slices (`HostKVPool._load_runs`)


def _paired_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first src page, first dst page, length) of each stretch where both lists
    go up by one, in order (cut short once there are more than `MAX_SLICE_RUNS`)."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(src) + 1):
        if i == len(src) or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            out.append((src[start], dst[start], i - start))
            if len(out) > MAX_SLICE_RUNS:
                return out
            start = i
    return out


def page_runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """(index in ``pages``, first page, length) of each run of consecutive page ids."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1:
            out.append((start, pages[start], i - start))
            start = i
    return out


def _scatter(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[idx[i]] = src[i]`` over the first (page) dimension."""
    as_bytes_if_1(dst).index_copy_(0, idx, as_bytes_if_1(src).contiguous())


def _gather_into(out: torch.Tensor, src: torch.Tensor, idx: torch.Tensor) -> None:
    """``out[i] = src[idx[i]]`` (``out`` may be a strided view)."""
    as_bytes_if_1(out).copy_(as_bytes_if_1(src).index_select(0, idx))


def host_pool_tokens(
    device_tokens: int, bytes_per_token: float, ratio: float, size_gib: float, num_tokens: Optional[int]
) -> int:
    """Host tier capacity in tokens from the flags, first match wins:
    ``num_tokens`` (``--host-kv-size``), ``size_gib`` > 0 (``--hicache-size``,
    GiB of host KV), else ``ratio`` x the device pool (``--hicache-ratio``)."""
    if num_tokens is not None:
        return int(num_tokens)
    if size_gib > 0:
        return int(size_gib * (1 << 30) // bytes_per_token)
    return int(device_tokens * ratio)
