"""FlashInfer attention backend (CUDA).

The same contract as the torch reference (`base.AttentionBackend`): `plan(meta)`
once per batch, `forward(...)` once per layer. Inside:

- the new tokens' K/V are written into the pool at ``meta.out_slots`` by the
  shared write step (`AttentionBackend._store_new_kv`, identical to the
  reference backend, quantizing for an fp8 cache);
- the batch's slot lists are converted once per batch into FlashInfer's paged
  layout (`paged_kv_metadata`: page-table offsets, page ids, last-page
  lengths), and the pool's flat views are re-viewed as
  ``[num_pages, page_size, Hkv, D]`` ("NHD" layout) for the kernels;
- a pure decode batch (every ``q_len == 1``) runs
  ``BatchDecodeWithPagedKVCacheWrapper`` (its tensor-core variant when the GQA
  group is 4 or more); any batch with a prefill/extend request (ragged query
  lengths over radix-cached prefixes, possibly mixed with decoding requests)
  runs ``BatchPrefillWithPagedKVCacheWrapper`` with a causal mask, which
  FlashInfer aligns bottom-right (query ``i`` of a request sits at position
  ``kv_len - q_len + i``), exactly the reference semantics; a batch verifying
  a speculative draft tree (``meta.tree``, `tree.py`) passes the dense
  ``custom_mask`` instead (``tree.flat_mask``: each request's ``[q_len,
  kv_len]`` mask, row-major, concatenated), whose positions the model's
  RoPE already took from ``meta.positions``.

KV cache dtypes: the model dtype (bf16/fp16) or fp8 (``float8_e4m3fn``,
``float8_e5m2``). FlashInfer's paged kernels read fp8 K/V themselves given
the KV data type at plan time; the cache's per-layer scalar scales go to
``run(..., k_scale=, v_scale=)`` (FlashInfer folds ``k_scale`` into the
softmax scale and multiplies the output by ``v_scale``). They take no
per-token scales, so an int8 cache (per-token scales) cannot be read here:
`forward` raises ValueError and the runner picks the torch backend for it.

FlashInfer's ``plan`` needs the head counts, head dim, dtypes and softmax
scale, which `AttentionBackend.plan(meta)` does not receive. The runner passes
them once through `configure(...)`; without it the wrapper is planned lazily
at the first layer's `forward` of each batch (same result, one layer later).
CUDA-graph capture needs the configured form (nothing may be planned inside a
capture).

FlashInfer is imported lazily, only when this backend is constructed, so CPU
installs never import it (``import flashinfer`` may succeed on a CPU machine,
but its kernels only run on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from .base import AttentionBackend, AttentionMetadata
from .kv_cache import LayerKVCache
from .tree import flat_mask, has_tree

DEFAULT_WORKSPACE_BYTES = 128 << 20
# GQA group size from which decode uses FlashInfer's tensor-core (prefill-kernel) path.
TENSOR_CORE_MIN_GROUP = 4


# head dims FlashInfer's prefill, decode and merge kernels are built for; the
# runner falls back to the torch backend for others (e.g. 16 in tiny test models)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def import_flashinfer() -> Any:
    """Import flashinfer, with an actionable message when it is missing."""
    try:
        import flashinfer
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "the 'flashinfer' attention backend needs the flashinfer-python package: "
            "pip install 'radixrt[cuda]' (or use attention_backend='torch')"
        ) from e
    return flashinfer


def _wrapper(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """Construct a FlashInfer wrapper; versions whose constructor has no ``backend``
    argument get the call without it."""
    try:
        return cls(*args, **kwargs)
    except TypeError as e:
        if "backend" not in kwargs or "backend" not in str(e):
            raise
        kwargs.pop("backend")
        return cls(*args, **kwargs)


class PagedKVLayout(NamedTuple):
    """One batch's KV in FlashInfer's paged form.

    indptr:        [B+1] int32 (host): request i owns pages indices[indptr[i]:indptr[i+1]].
    indices:       [sum(pages)] int32 (on the metadata's device): page ids, in sequence order.
    last_page_len: [B] int32 (host): tokens used in each request's last page (1..page_size).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


def _cumsum0(xs: list[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def paged_kv_metadata(meta: AttentionMetadata, validate: bool = False) -> PagedKVLayout:
    """Convert a batch's flat slot lists into (page indptr, page ids, last-page lengths).

    Relies on the pool's paging invariant: token ``j`` of a sequence sits at slot
    ``page[j // page_size] * page_size + j % page_size`` (every request owns whole
    pages, filled in order; pages may be shared between requests, as radix-cached
    prefixes are). ``validate=True`` checks that invariant on every token (tests,
    debugging) and raises ValueError when a slot list breaks it.

    The page ids of request i are the pages of its slots at offsets 0, ps, 2ps, ...
    For ``page_size == 1`` pages and slots are the same and the ids are the slots.
    """
    ps = int(meta.page_size)
    kv_lens = [int(k) for k in meta.kv_lens]
    if ps < 1:
        raise ValueError("page_size must be >= 1")
    if any(k < 1 for k in kv_lens):
        raise ValueError("every request needs at least one KV slot")
    num_pages = [(k + ps - 1) // ps for k in kv_lens]
    indptr_l = _cumsum0(num_pages)
    last_l = [k - (n - 1) * ps for k, n in zip(kv_lens, num_pages)]
    indptr = torch.tensor(indptr_l, dtype=torch.int32)
    last_page_len = torch.tensor(last_l, dtype=torch.int32)

    slots = meta.kv_slots
    device = slots.device
    if ps == 1:
        indices = slots.to(torch.int32)
    else:
        total = indptr_l[-1]
        kv_off = torch.tensor(_cumsum0(kv_lens)[:-1], dtype=torch.int64, device=device)
        page_ptr = torch.tensor(indptr_l[:-1], dtype=torch.int64, device=device)
        counts = torch.tensor(num_pages, dtype=torch.int64, device=device)
        req = torch.repeat_interleave(torch.arange(len(kv_lens), device=device), counts, output_size=total)
        page_no = torch.arange(total, dtype=torch.int64, device=device) - page_ptr[req]
        first_slot = slots[kv_off[req] + page_no * ps]
        indices = torch.div(first_slot, ps, rounding_mode="floor").to(torch.int32)

    if validate:
        _validate_paging(meta, kv_lens, indptr_l, indices, ps)
    return PagedKVLayout(indptr, indices, last_page_len)


def _validate_paging(
    meta: AttentionMetadata, kv_lens: list[int], indptr_l: list[int], indices: torch.Tensor, ps: int
) -> None:
    slots = meta.kv_slots.to(torch.int64)
    if slots.numel() and int(slots.max()) >= (1 << 31):
        raise ValueError("slot ids do not fit FlashInfer's int32 page indices")
    if slots.numel() != sum(kv_lens):
        raise ValueError(f"kv_slots has {slots.numel()} entries, kv_lens sum to {sum(kv_lens)}")
    device = slots.device
    n = slots.numel()
    kv_off = torch.tensor(_cumsum0(kv_lens)[:-1], dtype=torch.int64, device=device)
    page_ptr = torch.tensor(indptr_l[:-1], dtype=torch.int64, device=device)
    req = torch.repeat_interleave(
        torch.arange(len(kv_lens), device=device), torch.tensor(kv_lens, device=device), output_size=n
    )
    j = torch.arange(n, dtype=torch.int64, device=device) - kv_off[req]
    expected = indices.to(torch.int64)[page_ptr[req] + j // ps] * ps + j % ps
    bad = (expected != slots).nonzero()
    if bad.numel():
        t = int(bad[0, 0])
        raise ValueError(
            f"slot list of request {int(req[t])} is not page-aligned: token {int(j[t])} is at slot "
            f"{int(slots[t])}, its page layout says {int(expected[t])} (page_size {ps})"
        )


@dataclass(frozen=True)
class _Shape:
    """What FlashInfer's plan needs beyond the metadata."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    scale: float


class FlashInferBackend(AttentionBackend):
    """Paged causal GQA attention with FlashInfer's batch prefill/decode wrappers (CUDA)."""

    def __init__(
        self,
        device: str | torch.device = "cuda",
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        prefill_backend: str = "fa2",
        decode_backend: str = "fa2",
        tensor_core_min_group: int = TENSOR_CORE_MIN_GROUP,
        flashinfer_module: Any = None,
        validate_paging: bool = False,
    ) -> None:
        """``flashinfer_module`` replaces the real package (tests use a CPU emulation).

        ``prefill_backend``/``decode_backend`` are FlashInfer's kernel families
        ("fa2" default: compiles fastest and runs on every CUDA arch; "auto" lets
        FlashInfer pick, e.g. fa3 prefill on Hopper)."""
        self.fi = flashinfer_module if flashinfer_module is not None else import_flashinfer()
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        self.tensor_core_min_group = tensor_core_min_group
        self.validate_paging = validate_paging
        # One float workspace for every wrapper: only one of them runs at a time.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill = _wrapper(
            self.fi.BatchPrefillWithPagedKVCacheWrapper, self.workspace, "NHD", backend=prefill_backend
        )
        self._decode: dict[bool, Any] = {}  # use_tensor_cores -> wrapper
        self._graph_decode: dict[int, Any] = {}  # captured batch size -> graph-mode wrapper
        self._graph_max_pages = 0
        self._shape: Optional[_Shape] = None
        self._meta: Optional[AttentionMetadata] = None
        self._layout: Optional[PagedKVLayout] = None
        self._planned: Optional[_Shape] = None  # shape the active wrapper was planned for
        self._active: Any = None
        self._graph_bs: Optional[int] = None

    # ------------------------------------------------------------- set-up
    def configure(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: Optional[torch.dtype] = None,
        scale: Optional[float] = None,
    ) -> None:
        """Tell the backend the model's attention shape so `plan` can plan FlashInfer
        right away (required for CUDA graphs); ``kv_dtype`` is the KV pool's storage
        dtype (default ``dtype``; a float8 dtype for an fp8 cache); ``scale``
        defaults to head_dim**-0.5."""
        if num_q_heads % num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        if self.device.type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"FlashInfer attention needs bfloat16 or float16, not {dtype} "
                "(use dtype='auto'/'bfloat16', or attention_backend='torch')"
            )
        self._shape = _Shape(
            num_q_heads,
            num_kv_heads,
            head_dim,
            dtype,
            kv_dtype or dtype,
            float(head_dim**-0.5 if scale is None else scale),
        )

    def use_tensor_cores(self, num_q_heads: int, num_kv_heads: int) -> bool:
        return num_q_heads // num_kv_heads >= self.tensor_core_min_group

    def _decode_wrapper(self, tensor_cores: bool) -> Any:
        w = self._decode.get(tensor_cores)
        if w is None:
            w = self._decode[tensor_cores] = _wrapper(
                self.fi.BatchDecodeWithPagedKVCacheWrapper,
                self.workspace,
                "NHD",
                use_tensor_cores=tensor_cores,
                backend=self.decode_backend,
            )
        return w

    # ------------------------------------------------------------------ plan
    def plan(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        self._layout = paged_kv_metadata(meta, validate=self.validate_paging)
        self._planned = None
        self._active = None
        self._graph_bs = None
        if self._shape is not None:
            self._plan_wrapper(self._shape)

    def _plan_wrapper(self, shape: _Shape) -> None:
        meta, layout = self._meta, self._layout
        assert meta is not None and layout is not None
        common = dict(q_data_type=shape.q_dtype, kv_data_type=shape.kv_dtype, sm_scale=shape.scale)
        indices = layout.indices.to(self.device, non_blocking=True)
        if meta.is_decode:
            w = self._decode_wrapper(self.use_tensor_cores(shape.num_q_heads, shape.num_kv_heads))
            w.plan(
                layout.indptr,
                indices,
                layout.last_page_len,
                shape.num_q_heads,
                shape.num_kv_heads,
                shape.head_dim,
                meta.page_size,
                **common,
            )
        else:
            w = self._prefill
            qo_indptr = torch.tensor(_cumsum0(list(meta.q_lens)), dtype=torch.int32)
            # a batch verifying a draft tree takes a custom mask (each tree token sees the prefix
            # and its ancestors, tree.py); every other batch FlashInfer's own causal mask
            tree = meta.tree if has_tree(meta.tree) else None
            mask = None if tree is None else flat_mask(meta.q_lens, meta.kv_lens, tree).to(self.device)
            w.plan(
                qo_indptr,
                layout.indptr,
                indices,
                layout.last_page_len,
                shape.num_q_heads,
                shape.num_kv_heads,
                shape.head_dim,
                meta.page_size,
                causal=mask is None,
                custom_mask=mask,
                **common,
            )
        self._active = w
        self._planned = shape

    # ------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_pages: int) -> None:
        """Reserve what graph-mode decode wrappers need: page-id buffers for up to
        ``max_num_pages`` pages (the pool's size) shared by every captured batch size."""
        self._graph_max_pages = int(max_num_pages)
        self._graph_indices = torch.zeros(self._graph_max_pages, dtype=torch.int32, device=self.device)
        self._graph_max_bs = int(max_bs)

    def plan_cuda_graph(self, meta: AttentionMetadata, bs: int) -> None:
        """Plan the graph-mode decode wrapper of batch size ``bs`` (a pure decode batch
        of exactly ``bs`` requests, padding included). Called outside the graph, before
        capture (with dummy metadata) and before every replay (with the real batch);
        the kernels captured for ``bs`` then read the buffers this fills."""
        if self._shape is None:
            raise RuntimeError("call configure(...) before using CUDA graphs")
        if not meta.is_decode or meta.batch_size != bs:
            raise ValueError(f"graph batch size {bs} needs a pure decode batch of {bs} requests")
        shape = self._shape
        w = self._graph_decode.get(bs)
        if w is None:
            if not self._graph_max_pages:
                raise RuntimeError("call init_cuda_graph_state(...) before plan_cuda_graph")
            w = self._graph_decode[bs] = _wrapper(
                self.fi.BatchDecodeWithPagedKVCacheWrapper,
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores(shape.num_q_heads, shape.num_kv_heads),
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=self.device),
                backend=self.decode_backend,
            )
        self._meta = meta
        self._layout = layout = paged_kv_metadata(meta, validate=self.validate_paging)
        if layout.indices.numel() > self._graph_max_pages:
            raise ValueError(f"batch uses {layout.indices.numel()} pages; graphs reserved {self._graph_max_pages}")
        w.plan(
            layout.indptr,
            layout.indices.to(self.device, non_blocking=True),
            layout.last_page_len,
            shape.num_q_heads,
            shape.num_kv_heads,
            shape.head_dim,
            meta.page_size,
            q_data_type=shape.q_dtype,
            kv_data_type=shape.kv_dtype,
            sm_scale=shape.scale,
        )
        self._active = w
        self._planned = shape
        self._graph_bs = bs

    # --------------------------------------------------------------- forward
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        scale: float,
    ) -> torch.Tensor:
        if cache.scheme == "int8":
            raise ValueError(
                "FlashInfer's kernels cannot read an int8 KV cache (per-token scales); "
                "use kv_cache_dtype fp8_e4m3/fp8_e5m2/auto, or attention_backend='torch'"
            )
        # 1. write the new K/V into the pool (flat views share the pool's storage)
        meta = self._store_new_kv(self._meta, q, k, v, cache)
        num_tokens, num_q_heads, head_dim = q.shape

        # 2. plan lazily when the runner did not configure the shape (first layer only)
        shape = _Shape(num_q_heads, cache.num_kv_heads, head_dim, q.dtype, cache.dtype, float(scale))
        if self._planned != shape:
            if self._graph_bs is not None:
                raise RuntimeError(f"graph-mode wrapper planned for {self._planned}, forward got {shape}")
            self._plan_wrapper(shape)

        # 3. attend over the paged pool: [num_pages, page_size, Hkv, D] views, NHD layout
        ps = meta.page_size
        paged = (
            cache.k.view(-1, ps, *cache.k.shape[1:]),
            cache.v.view(-1, ps, *cache.v.shape[1:]),
        )
        # fp8 per-layer scales (1.0, FlashInfer's default, is left out)
        scales = {name: x for name, x in (("k_scale", cache.k_scalar), ("v_scale", cache.v_scalar)) if x != 1.0}
        out = self._active.run(q.contiguous(), paged, **scales)
        return out.reshape(num_tokens, num_q_heads * head_dim)
