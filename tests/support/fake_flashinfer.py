"""A CPU stand-in for the two FlashInfer wrappers radixrt uses.

It implements the documented semantics of ``BatchPrefillWithPagedKVCacheWrapper``
and ``BatchDecodeWithPagedKVCacheWrapper`` (paged KV in "NHD" layout given by
page-table offsets, page ids and last-page lengths; causal masks aligned
bottom-right; GQA) in plain torch, so that `FlashInferBackend`'s own logic (the
slot-to-page conversion, choosing and planning wrappers, graph-mode buffers)
is exercised on a machine without CUDA. It checks the argument contracts the
real kernels rely on (int32 index tensors, sizes, contiguous q, graph-mode
buffers large enough) and records its calls for the tests.

This is test scaffolding written for radixrt, not FlashInfer code. The real
kernels are checked against the torch reference on a GPU by
scripts/device/gpu_check.py.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__version__ = "0.0.0+radixrt-cpu-emulation"
RUNS_ON_CPU = True  # radixrt's config lets FlashInfer backends run on device 'cpu' with this module loaded
calls: list[tuple[str, Any]] = []


def _as_host_list(t: torch.Tensor, name: str) -> list[int]:
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    return [int(x) for x in t.cpu().tolist()]


class _PagedBase:
    kind = "?"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        backend: str = "auto",
        **kwargs: Any,
    ) -> None:
        if kv_layout != "NHD":
            raise ValueError("the emulation supports the NHD layout only")
        self.workspace = float_workspace_buffer
        self.use_cuda_graph = use_cuda_graph
        self.backend = backend
        self.buffers = kwargs
        self._plan: Optional[dict] = None
        self.plan_count = 0

    def _buffer(self, name: str) -> torch.Tensor:
        for key in (name + "_buffer", name + "_buf"):
            if self.buffers.get(key) is not None:
                return self.buffers[key]
        raise ValueError(f"a graph-mode wrapper needs {name}_buffer")

    def _store_plan(
        self,
        qo_indptr: list[int],
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        causal: bool,
        sm_scale: Optional[float],
        q_data_type: Any,
        kv_data_type: Any,
    ) -> None:
        ip = _as_host_list(indptr, "indptr")
        lp = _as_host_list(last_page_len, "last_page_len")
        if indices.dtype != torch.int32:
            raise TypeError(f"indices must be int32, got {indices.dtype}")
        b = len(ip) - 1
        if len(lp) != b or len(qo_indptr) != b + 1:
            raise ValueError("indptr / last_page_len / qo_indptr disagree on the batch size")
        if indices.numel() != ip[-1]:
            raise ValueError(f"indices has {indices.numel()} entries, indptr ends at {ip[-1]}")
        for i in range(b):
            if ip[i + 1] <= ip[i]:
                raise ValueError(f"request {i} has no page")
            if not 1 <= lp[i] <= page_size:
                raise ValueError(f"last_page_len[{i}] = {lp[i]} outside 1..{page_size}")
        if num_qo_heads % num_kv_heads:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        if self.use_cuda_graph:
            ind_buf = self._buffer("paged_kv_indices")
            ptr_buf = self._buffer("paged_kv_indptr")
            last_buf = self._buffer("paged_kv_last_page_len")
            if ptr_buf.numel() != b + 1 or last_buf.numel() != b:
                raise ValueError("a graph-mode wrapper's batch size is fixed by its buffers")
            if ind_buf.numel() < indices.numel():
                raise ValueError("graph-mode indices buffer too small")
            ptr_buf.copy_(indptr)
            last_buf.copy_(last_page_len)
            ind_buf[: indices.numel()].copy_(indices)
            indices = ind_buf[: indices.numel()]
        self._plan = dict(
            qo_indptr=qo_indptr,
            indptr=ip,
            indices=indices.to(torch.int64),
            last=lp,
            hq=num_qo_heads,
            hkv=num_kv_heads,
            d=head_dim,
            ps=page_size,
            causal=causal,
            scale=head_dim**-0.5 if sm_scale is None else float(sm_scale),
            q_dtype=q_data_type,
            kv_dtype=kv_data_type,
        )
        self.plan_count += 1
        calls.append(
            (
                f"{self.kind}.plan",
                dict(
                    batch=b,
                    hq=num_qo_heads,
                    hkv=num_kv_heads,
                    ps=page_size,
                    graph=self.use_cuda_graph,
                    backend=self.backend,
                ),
            )
        )

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: Any,
        *args: Any,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``k_scale``/``v_scale``: scalars the stored K/V are multiplied by (fp8 caches)."""
        p = self._plan
        if p is None:
            raise RuntimeError("run before plan")
        if not q.is_contiguous():
            raise ValueError("q must be contiguous")
        k_cache, v_cache = paged_kv_cache
        num_pages, ps, hkv, d = k_cache.shape
        if ps != p["ps"] or hkv != p["hkv"] or d != p["d"] or q.shape[1:] != (p["hq"], p["d"]):
            raise ValueError("tensor shapes disagree with the plan")
        if q.dtype != p["q_dtype"] or k_cache.dtype != p["kv_dtype"]:
            raise TypeError("tensor dtypes disagree with the plan")
        if q.shape[0] != p["qo_indptr"][-1]:
            raise ValueError("q rows disagree with qo_indptr")
        g = p["hq"] // hkv
        out = torch.empty_like(q)
        for i in range(len(p["indptr"]) - 1):
            pages = p["indices"][p["indptr"][i] : p["indptr"][i + 1]]
            kv_len = (pages.numel() - 1) * ps + p["last"][i]
            kk = k_cache[pages].reshape(-1, hkv, d)[:kv_len].double().repeat_interleave(g, dim=1)
            vv = v_cache[pages].reshape(-1, hkv, d)[:kv_len].double().repeat_interleave(g, dim=1)
            kk, vv = kk * (1.0 if k_scale is None else k_scale), vv * (1.0 if v_scale is None else v_scale)
            a, b = p["qo_indptr"][i], p["qo_indptr"][i + 1]
            qi = q[a:b].double()
            s = torch.einsum("qhd,khd->hqk", qi, kk) * p["scale"]
            if p["causal"]:
                qpos = torch.arange(kv_len - (b - a), kv_len)[:, None]
                s = s.masked_fill(torch.arange(kv_len)[None, :] > qpos, float("-inf"))
            out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv).to(q.dtype)
        calls.append((f"{self.kind}.run", dict(tokens=q.shape[0], k_scale=k_scale, v_scale=v_scale)))
        return out


class BatchPrefillWithPagedKVCacheWrapper(_PagedBase):
    kind = "prefill"

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        causal: bool = False,
        sm_scale: Optional[float] = None,
        q_data_type: Any = torch.float16,
        kv_data_type: Any = None,
        **kwargs: Any,
    ) -> None:
        self._store_plan(
            _as_host_list(qo_indptr, "qo_indptr"),
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            page_size,
            causal,
            sm_scale,
            q_data_type,
            kv_data_type or q_data_type,
        )


class BatchDecodeWithPagedKVCacheWrapper(_PagedBase):
    kind = "decode"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, **kwargs)
        self.use_tensor_cores = use_tensor_cores

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        sm_scale: Optional[float] = None,
        q_data_type: Any = torch.float16,
        kv_data_type: Any = None,
        **kwargs: Any,
    ) -> None:
        b = indptr.numel() - 1
        self._store_plan(
            list(range(b + 1)),
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            False,
            sm_scale,
            q_data_type,
            kv_data_type or q_data_type,
        )
        calls[-1][1]["tensor_cores"] = self.use_tensor_cores


class sampling:  # noqa: N801  (stands in for the flashinfer.sampling module)
    """``top_k_top_p_sampling_from_probs`` with FlashInfer's documented semantics:
    top-k first, then top-p over the renormalized top-k set; per-row seed/offset."""

    @staticmethod
    def top_k_top_p_sampling_from_probs(
        probs: torch.Tensor,
        top_k: Any,
        top_p: Any,
        indices: Any = None,
        filter_apply_order: str = "top_k_first",
        deterministic: bool = True,
        generator: Any = None,
        check_nan: bool = False,
        seed: Any = None,
        offset: Any = None,
    ) -> torch.Tensor:
        b, v = probs.shape
        k = torch.as_tensor(top_k).reshape(-1).expand(b) if torch.as_tensor(top_k).numel() == 1 else top_k
        p = torch.as_tensor(top_p).reshape(-1).expand(b) if torch.as_tensor(top_p).numel() == 1 else top_p
        out = torch.empty(b, dtype=torch.int32)
        for i in range(b):
            row = probs[i].double()
            kth = row.topk(int(k[i])).values[-1]
            row = torch.where(row >= kth, row, torch.zeros_like(row))
            row = row / row.sum()
            sp, order = row.sort(descending=True)
            n_keep = int(((sp.cumsum(0) - sp) < float(p[i])).sum().clamp(min=1))
            keep = torch.zeros_like(row)
            keep[order[:n_keep]] = row[order[:n_keep]]
            g = torch.Generator().manual_seed((int(seed[i]) * 1000003 + int(offset[i]) * 7919 + i) % (1 << 62))
            out[i] = int(torch.multinomial(keep, 1, generator=g))
        calls.append(("sampling.top_k_top_p", dict(rows=b)))
        return out.to(probs.device)
