"""Paged KV memory: the per-layer K/V pool and the page allocator.

Slot ids are flat: ``slot = page * page_size + offset`` with
``0 <= offset < page_size``. ``page_size == 1`` makes pages and slots the same.

Ownership contract (see docs/architecture.md, "Core contracts"): every slot is at all
times exactly one of *free* (its page is on the allocator's free list), *owned
by the radix tree*, or *private to a running request*. The allocator only
knows free versus not free; who owns a non-free page is the caller's business.
Memory is handed out and taken back in whole pages.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from typing import Iterable, Optional, Sequence

import torch

from radixrt.kernels.kv_cache import INT8_SCALE_DTYPE, LayerKVCache, kv_storage_dtype
from radixrt.memory.kv_format import KVFootprint, kv_footprint


def as_bytes_if_1(t: torch.Tensor) -> torch.Tensor:
    """``t`` as bytes when its elements are one byte each: torch's CPU index ops (``index_select``,
    ``index_copy_``) do not take float8, and moving KV rows needs no arithmetic."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def lazy_zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On a CPU its memory is an anonymous ``mmap``: pages that
    read as zero and are only backed when first written, so a multi-GB pool is
    ready at once and holds only the memory its tokens use, where
    ``torch.zeros`` would write every byte. (Not numpy's ``calloc``: numpy
    asks for transparent huge pages on large blocks, and where the kernel
    compacts memory to find them, first writes ran 6x slower: a restart's
    storage read into a fresh pool paid that on every page.)"""
    if device.type != "cpu":
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # the tensor keeps it alive
    return torch.frombuffer(memory, dtype=torch.uint8)[:nbytes].view(dtype).view(tuple(shape))


MADV_POPULATE_WRITE = 23  # Linux 5.14's madvise: back a range with writable pages, contents unchanged
MADV_DONTNEED = 4  # give a private anonymous range's pages back: it reads as zeros from then on


def prefault(buf: torch.Tensor, nbytes: int) -> bool:
    """Back the first ``nbytes`` of CPU buffer ``buf`` (from `lazy_zeros`) with
    memory now, so that first writes there do not fault one page at a time (a
    restart's reads from the storage tier write hundreds of MB at once).
    Changes no byte, so other threads may use the buffer meanwhile. False
    where the kernel cannot (older than Linux 5.14, or not Linux): nothing
    was done."""
    nbytes = min(nbytes, buf.numel() * buf.element_size())
    libc = _libc()
    if nbytes <= 0 or buf.device.type != "cpu" or libc is None:
        return False
    page = mmap.PAGESIZE
    start = buf.data_ptr() // page * page
    length = (buf.data_ptr() + nbytes + page - 1) // page * page - start
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_POPULATE_WRITE) == 0


def release_pages(buf: torch.Tensor) -> int:
    """Give the whole pages inside CPU tensor ``buf``'s memory back to the system
    (``MADV_DONTNEED``): anonymous memory reads as zeros afterwards (a `lazy_zeros` buffer
    is as new), a file's private mapping as the file. The tensor stays valid (its address
    too). The bytes of those pages that were resident (``mincore``), which the process's
    resident memory falls by (0 where the kernel cannot: not Linux, not a CPU tensor)."""
    libc = _libc()
    if buf.device.type != "cpu" or libc is None:
        return 0
    page = mmap.PAGESIZE
    start = (buf.data_ptr() + page - 1) // page * page
    end = (buf.data_ptr() + buf.numel() * buf.element_size()) // page * page
    if end <= start:
        return 0
    resident = (ctypes.c_ubyte * ((end - start) // page))()
    counted = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), resident) == 0
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) != 0:
        return 0
    return sum(bytes(resident)) * page if counted else 0  # mincore sets only the low bit of a page's byte


@functools.cache
def _libc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


class KVPool:
    """Per-layer K and V tensors, each ``[num_pages, page_size, num_kv_heads, head_dim]``.

    ``kv_cache_dtype`` (``auto`` | ``int8`` | ``fp8_e4m3`` | ``fp8_e5m2``)
    chooses how K/V are stored (schemes: ``kernels/kv_cache.py``): ``auto``
    keeps ``dtype``, the model's; ``int8`` adds per-layer K and V scale
    buffers ``[num_pages, page_size, num_kv_heads]`` (float16), laid out
    like the data so that a slot id indexes both; fp8 keeps one scalar per
    layer for K and for V (``k_scalars``/``v_scalars``, 1.0).

    The buffers are zero-initialised so that slots never written hold finite
    values (a masked-out NaN would still poison a softmax-weighted sum); on a
    CPU lazily (`lazy_zeros`), so a large pool costs no start-up time.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        if min(num_layers, num_pages, page_size, num_kv_heads, head_dim) < 1:
            raise ValueError("KVPool dimensions must all be >= 1")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # the model's (compute) dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.storage_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
        self.device = torch.device(device)
        self.footprint: KVFootprint = kv_footprint(num_layers, num_kv_heads, head_dim, kv_cache_dtype, str(dtype))
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_buffers: list[torch.Tensor] = [
            lazy_zeros(shape, self.storage_dtype, self.device) for _ in range(num_layers)
        ]
        self.v_buffers: list[torch.Tensor] = [
            lazy_zeros(shape, self.storage_dtype, self.device) for _ in range(num_layers)
        ]
        self.k_scale_buffers: Optional[list[torch.Tensor]] = None
        self.v_scale_buffers: Optional[list[torch.Tensor]] = None
        if self.storage_dtype == torch.int8:
            self.k_scale_buffers = [lazy_zeros(shape[:3], INT8_SCALE_DTYPE, self.device) for _ in range(num_layers)]
            self.v_scale_buffers = [lazy_zeros(shape[:3], INT8_SCALE_DTYPE, self.device) for _ in range(num_layers)]
        self.k_scalars = [1.0] * num_layers
        self.v_scalars = [1.0] * num_layers
        self._layer_caches = [self._make_layer_cache(i) for i in range(num_layers)]

    @classmethod
    def bytes_per_token_for(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
    ) -> int:
        """Bytes of KV one token costs across all layers (K and V, scales included)."""
        return int(kv_footprint(num_layers, num_kv_heads, head_dim, kv_cache_dtype, str(dtype)).bytes_per_token)

    @property
    def bytes_per_token(self) -> int:
        return int(self.footprint.bytes_per_token)

    @property
    def total_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.total_slots

    def layer_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat views ``[num_pages * page_size, num_kv_heads, head_dim]`` of one
        layer's K and V buffers (as stored: quantized for int8/fp8). They share
        storage with the pool (no copy): writing through them writes the pool."""
        shape = (self.total_slots, self.num_kv_heads, self.head_dim)
        return self.k_buffers[layer_id].view(shape), self.v_buffers[layer_id].view(shape)

    def layer_cache(self, layer_id: int) -> LayerKVCache:
        """One layer's cache as the attention backends take it: the `layer_kv`
        views plus the scales of a quantized pool."""
        return self._layer_caches[layer_id]

    def buffers(self) -> list[torch.Tensor]:
        """Every layer's K and V buffers (and int8 scales), each ``[num_pages, ...]``."""
        return [*self.k_buffers, *self.v_buffers, *(self.k_scale_buffers or []), *(self.v_scale_buffers or [])]

    def prefault_pages(self, num_pages: int) -> bool:
        """Back pages ``0 .. num_pages - 1`` (the allocator's first) of every
        buffer with memory now (`prefault`; contents unchanged). CPU only."""
        return all(prefault(buf, num_pages * buf[0].numel() * buf.element_size()) for buf in self.buffers())

    def release_pages(self) -> int:
        """Give every buffer's memory back to the system (CPU; the buffers then read as zeros,
        as a new pool's); the resident bytes given back. The caller holds no KV in the pool."""
        return sum(release_pages(buf) for buf in self.buffers())

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the stored K/V (and int8 scales) of slots ``src[i]`` to ``dst[i]``
        in every layer: a copy on write, when a beam or sample leaves a shared,
        partly filled page, or a draft tree's accepted branch moved into place.
        Every source is read before any destination is written (a slot may be
        both: it gives its old contents)."""
        if not src:
            return
        s = torch.tensor(list(src), dtype=torch.int64, device=self.device)
        d = torch.tensor(list(dst), dtype=torch.int64, device=self.device)
        for buf in self.buffers():
            flat = as_bytes_if_1(buf.view(self.total_slots, *buf.shape[2:]))
            flat.index_copy_(0, d, flat.index_select(0, s))

    def _make_layer_cache(self, layer_id: int) -> LayerKVCache:
        k, v = self.layer_kv(layer_id)
        ks = vs = None
        if self.k_scale_buffers is not None and self.v_scale_buffers is not None:
            flat = (self.total_slots, self.num_kv_heads)
            ks, vs = self.k_scale_buffers[layer_id].view(flat), self.v_scale_buffers[layer_id].view(flat)
        return LayerKVCache(k, v, ks, vs, self.k_scalars[layer_id], self.v_scalars[layer_id])


class PageAllocator:
    """Free list of page ids ``0 .. num_pages-1``.

    - `alloc_pages(n)` hands out ``n`` pages (lowest ids first on a fresh
      allocator) or returns None and hands out nothing.
    - `free_pages(pages)` takes pages back; freeing a page that is already
      free (or twice in one call, or out of range) raises ValueError and frees
      nothing. Cost is O(len(pages)), independent of the pool size.
    """

    def __init__(self, num_pages: int, page_size: int = 1) -> None:
        if num_pages < 0 or page_size < 1:
            raise ValueError("need num_pages >= 0 and page_size >= 1")
        self._num_pages = num_pages
        self._page_size = page_size
        # Stack: the end of the list is handed out first. Reversed so that a
        # fresh allocator hands out pages 0, 1, 2, ...
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages

    # ---- sizes -------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def total_slots(self) -> int:
        return self._num_pages * self._page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_free_slots(self) -> int:
        return len(self._free) * self._page_size

    @property
    def num_used_pages(self) -> int:
        return self._num_pages - len(self._free)

    def is_page_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def first_free(self, pages: list[int]) -> Optional[int]:
        """The first of ``pages`` (each in range) on the free list, or None: one pass in C."""
        flags = bytes(map(self._is_free.__getitem__, pages))
        i = flags.find(1)
        return None if i < 0 else pages[i]

    # ---- alloc / free ------------------------------------------------------
    def alloc_pages(self, n: int) -> Optional[list[int]]:
        """Hand out ``n`` pages, or return None (allocating nothing) if fewer are free."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        free = self._free
        pages = free[len(free) - n :]
        del free[len(free) - n :]
        pages.reverse()
        is_free = self._is_free
        for p in pages:
            is_free[p] = 0
        return pages

    def alloc_slots_for(self, num_tokens: int) -> Optional[list[int]]:
        """Allocate ``ceil(num_tokens / page_size)`` pages and return all their
        slots (a multiple of page_size, possibly more than num_tokens); None if
        not enough memory."""
        pages = self.alloc_pages(-(-num_tokens // self._page_size))
        return None if pages is None else self.pages_to_slots(pages)

    def free_pages(self, pages: Iterable[int]) -> None:
        """Return pages to the free list. Raises ValueError (freeing nothing) on
        a double free, a page listed twice, or an out-of-range page id."""
        pages = list(pages)
        is_free = self._is_free
        n = self._num_pages
        for i, p in enumerate(pages):
            if not (0 <= p < n) or is_free[p]:
                for q in pages[:i]:  # roll back: the call frees nothing
                    is_free[q] = 0
                if not (0 <= p < n):
                    raise ValueError(f"page {p} out of range [0, {n})")
                raise ValueError(f"double free of page {p}")
            is_free[p] = 1
        self._free.extend(pages)

    def pages_to_slots(self, pages: Sequence[int]) -> list[int]:
        """Slots of the given pages, in order: page p gives p*P .. p*P+P-1."""
        P = self._page_size
        if P == 1:
            return list(pages)
        return [s for p in pages for s in range(p * P, p * P + P)]

    def slots_to_pages(self, slots: Sequence[int]) -> list[int]:
        """Pages of a slot list made of whole pages, each page's slots in order.
        Raises ValueError if the list is not made of whole pages."""
        P = self._page_size
        if hasattr(slots, "tolist"):
            slots = slots.tolist()
        if P == 1:
            return list(slots)
        if len(slots) % P:
            raise ValueError(f"slot list of length {len(slots)} is not a multiple of page_size {P}")
        pages = [s // P for s in slots[::P]]
        if slots[::P] != [p * P for p in pages] or list(slots) != self.pages_to_slots(pages):
            raise ValueError("slot list is not made of whole, in-order pages")
        return pages

    def free_slots(self, slots: Sequence[int]) -> None:
        """Free the pages of a slot list made of whole pages (see `slots_to_pages`)."""
        self.free_pages(self.slots_to_pages(slots))
