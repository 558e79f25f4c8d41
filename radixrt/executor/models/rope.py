"""Rotary position embedding with the checkpoint's scaling.

The inverse frequencies and the attention scaling come from transformers'
``ROPE_INIT_FUNCTIONS`` (linear, dynamic, yarn, longrope, llama3, ...), so the
scaling math is exactly the reference implementation's. cos/sin are looked up
once per forward for the batch's positions and shared by every layer, and
applied with the "rotate_half" convention of Llama-family weights. The lookup
is one ``index_select`` from a table of every position up to the longest
sequence seen so far (per device and dtype, grown by doubling), whose rows are
exactly what computing them for the batch would give.

Sequence-length dependent types (``dynamic``, ``longrope``) pick each
request's frequencies from that request's current length, as transformers
does for the sequence it is running (keys cached earlier keep the rotation
they were computed with, as in transformers' own KV cache); they compute
cos/sin per batch instead of reading a table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

if TYPE_CHECKING:
    from radixrt.kernels.row_ops_cpu import NativeRowOps

LENGTH_DEPENDENT = ("dynamic", "longrope")


def _init_functions() -> dict[str, Callable[..., tuple[torch.Tensor, float]]]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS


def rope_parameters(hf_config: Any) -> dict:
    """The checkpoint's RoPE type and parameters, in the standard form (``rope_type``, ``rope_theta``, ...)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # transformers 4.x style
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        if "rope_theta" not in params and hasattr(hf_config, "rope_theta"):
            params["rope_theta"] = hf_config.rope_theta
    if "rope_type" not in params and "full_attention" in params:  # per-layer-type dicts
        params = params["full_attention"]
    return dict(params)


class RotaryEmbedding:
    """cos/sin tables for positions; `apply` rotates q and k ([T, heads, head_dim])."""

    native: Optional["NativeRowOps"] = None

    def __init__(self, hf_config: Any, head_dim: int) -> None:
        self.hf_config = hf_config
        self.head_dim = head_dim
        params = rope_parameters(hf_config)
        self.rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        self.max_position_embeddings = int(hf_config.max_position_embeddings)
        self._init_fn: Optional[Callable[..., tuple[torch.Tensor, float]]] = None
        if self.rope_type == "default":  # transformers' default, without importing it
            # every head dim rotates: transformers' Llama-family models read no partial_rotary_factor
            base = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        elif self.rope_type in _init_functions():
            self._init_fn = _init_functions()[self.rope_type]
            inv_freq, scaling = self._init_fn(hf_config, None)
        else:
            raise ValueError(
                f"unsupported rope_type {self.rope_type!r}; supported: default, {', '.join(sorted(_init_functions()))}"
            )
        self.inv_freq = inv_freq.float().cpu()
        self.attention_scaling = float(scaling)
        self.rotary_dim = 2 * self.inv_freq.numel()
        if self.rotary_dim != head_dim:  # a partial_rotary_factor, which transformers' models of these do not run
            raise ValueError(
                f"{self.rope_type!r} RoPE of {self.rotary_dim} dims (partial_rotary_factor) in heads of {head_dim}: "
                "transformers' Llama, Mistral and Qwen models rotate the whole head"
            )
        self._by_device: dict[Any, torch.Tensor] = {}
        self._by_seq_len: dict[tuple[Any, int], tuple[torch.Tensor, float]] = {}
        # (device, dtype) -> [n, 2 * rotary_dim] table: row p is cos | sin of position p
        self._tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def _params_for(self, device: torch.device, seq_len: Optional[int]) -> tuple[torch.Tensor, float]:
        if self.rope_type in LENGTH_DEPENDENT and seq_len is not None:
            key = (device, int(seq_len))
            hit = self._by_seq_len.get(key)
            if hit is None:
                assert self._init_fn is not None, "length-dependent rope types have an init function"
                inv_freq, scaling = self._init_fn(self.hf_config, None, seq_len=int(seq_len))
                if len(self._by_seq_len) > 64:
                    self._by_seq_len.clear()
                hit = self._by_seq_len[key] = (inv_freq.float().to(device), float(scaling))
            return hit
        inv = self._by_device.get(device)
        if inv is None:
            inv = self._by_device[device] = self.inv_freq.to(device)
        return inv, self.attention_scaling

    def cos_sin(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        q_lens: Sequence[int],
        kv_lens: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, rotary_dim]`` in ``dtype`` for ``positions`` [T] (sin's first half negated).

        ``q_lens``/``kv_lens`` are the batch's per-request new-token counts and
        sequence lengths: every position is below ``max(kv_lens)``, and the
        length-dependent rope types take each request's frequencies from its
        sequence length.
        """
        if self.rope_type in LENGTH_DEPENDENT:
            if len(set(kv_lens)) == 1:
                return self._cos_sin(positions, dtype, kv_lens[0])
            parts = [self._cos_sin(p, dtype, n) for p, n in zip(positions.split(list(q_lens)), kv_lens)]
            return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
        rows = self.reserve(max(kv_lens), positions.device, dtype).index_select(0, positions)
        rd = self.rotary_dim
        return rows[:, None, :rd], rows[:, None, rd:]

    def reserve(self, num_positions: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """The cos | sin table ``[n, 2 * rotary_dim]`` of positions ``0 .. n - 1`` for
        ``n >= num_positions`` (base frequencies). Made before CUDA graph capture
        for the longest context, a replay never needs it to grow."""
        device = torch.device(device)
        key = (device, dtype)
        table = self._tables.get(key)
        if table is None or table.shape[0] < num_positions:
            n = max(256, 1 << (max(num_positions, 1) - 1).bit_length())
            cos, sin = self._cos_sin(torch.arange(n, device=device), dtype, None)
            table = self._tables[key] = torch.cat((cos, sin), dim=-1).squeeze(1)
        return table

    def _cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_len: Optional[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = self._params_for(positions.device, seq_len)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        cos = freqs.cos()
        sin = freqs.sin()
        if scaling != 1.0:
            cos = cos * scaling
            sin = sin * scaling
        # Full-width tables: x * cos + swap_halves(x) * sin with sin's first half negated is
        # exactly transformers' x * cos + rotate_half(x) * sin, in fewer kernels.
        cos = torch.cat((cos, cos), dim=-1)
        sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, heads, head_dim] (rotate_half convention, the whole head).
        Few float32 rows go to ``native`` when set (`native_linear.use_native_row_ops`): the
        same bits in one call."""
        native = self.native
        if (
            native is not None
            and x.dtype == torch.float32
            and cos.dtype == torch.float32
            and x.shape[0] < native.max_rows
            and x.stride(2) == 1
            and x.stride(1) == x.shape[2]
            and cos.stride(0) == sin.stride(0)
            and not torch.compiler.is_compiling()
        ):
            return native.rope(x, cos, sin)
        # rolling by half the head swaps its halves (one kernel, where slicing + cat took three); the
        # whole head rotates (``rotary_dim == head_dim``, checked at construction)
        return x * cos + x.roll(self.rotary_dim // 2, -1) * sin
