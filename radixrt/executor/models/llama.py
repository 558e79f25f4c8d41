"""Llama-family decoder over the paged KV pool.

One class serves Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k
RMSNorm) through `ModelConfig` flags. Parameter names follow the Hugging Face
layout except for two fused projections (see `loader.py`):
``self_attn.qkv_proj`` = [q_proj; k_proj; v_proj] and ``mlp.gate_up_proj`` =
[gate_proj; up_proj].

The model never plans the attention backend: the runner calls
``backend.plan(meta)`` once per batch, then ``model(...)``.

Deterministic inference (`radixrt.executor.batch_invariant`): with
``batch_invariant`` set, the forward pads the batch's token rows to a whole
number of row tiles, runs every layer over the padded rows (linear layers
tile by tile, elementwise kernels over aligned shapes) and hands only the
real rows to the attention backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.executor.batch_invariant import pad_rows, padded_rows
from radixrt.executor.models.config import ModelConfig
from radixrt.executor.models.rope import RotaryEmbedding

if TYPE_CHECKING:  # kernels is a leaf package; the model only needs its duck types at run time
    from radixrt.kernels import AttentionBackend, AttentionMetadata
    from radixrt.kernels.kv_scores import ScoringPass
    from radixrt.kernels.row_ops_cpu import NativeRowOps


class RMSNorm(nn.Module):
    """RMSNorm as the reference implementation computes it: normalized in
    float32, cast back to the input dtype, then scaled by the weight. Float32
    rows below ``native.max_rows`` go to ``native`` (set on the CPU by
    `native_linear.use_native_row_ops`: one C call instead of six torch ops)."""

    native: Optional["NativeRowOps"] = None

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.shape = (size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            native = self.native
            if native is not None and x.dim() == 2 and x.shape[0] < native.max_rows and x.stride(1) == 1:
                if not torch.compiler.is_compiling():
                    return native.rms_norm(x, self.weight, self.eps)
            # nothing to cast: the fused kernel gives the reference's bits (checked on the CPU by
            # tests/unit/test_model_ops.py) in one op instead of eight
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # otherwise the fused kernel would scale before rounding to the input dtype
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + delta, self(h + delta))``: a residual add and this norm, in one native call
        for few float32 rows (see the class doc)."""
        native = self.native
        if (
            native is not None
            and h.dtype == delta.dtype == self.weight.dtype == torch.float32
            and h.dim() == 2
            and h.shape == delta.shape
            and h.shape[0] < native.max_rows
            and h.stride(1) == 1
            and delta.stride(1) == 1
            and not torch.compiler.is_compiling()
        ):
            return native.add_rms_norm(h, delta, self.weight, self.eps)
        h = h + delta
        return h, self(h)


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name in ("silu", "swish"):
        return F.silu
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ValueError(f"unsupported hidden_act {name!r} in the model's config; transformers has {', '.join(ACT2FN)}")
    return ACT2FN[name]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm: Optional[RMSNorm]
        self.k_norm: Optional[RMSNorm]
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rope: RotaryEmbedding,
        kv_pool: Any,
        backend: "AttentionBackend",
        num_tokens: Optional[int] = None,
        scoring: Optional["ScoringPass"] = None,
    ) -> torch.Tensor:
        """``num_tokens``: rows of ``x`` that are real tokens (the rest is
        padding, see the module doc); only those reach the attention backend.
        ``scoring``: the batch's attention-mass pass (KV budgets), run after this
        layer's attention over the same cache; it may rewrite the output rows of
        a request that fetches offloaded KV (InfiniGen)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None or self.k_norm is None:  # both or neither
            # rotate q and k in one go: a [T, Hq + Hkv, D] view of the projection
            qk = rope.apply(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            q = rope.apply(q, cos, sin)
            k = rope.apply(k, cos, sin)
        if torch.compiler.is_compiling():  # the forward context holds the pool and backend (compiled.py)
            return self.o_proj(torch.ops.radixrt.paged_attention(q, k, v, self.layer_id, self.scale))
        # this layer's cache: K/V views of the pool, plus its scales when quantized (LayerKVCache)
        cache = kv_pool.layer_cache(self.layer_id)
        if num_tokens is not None and num_tokens < t:
            n = num_tokens
            o = backend.forward(q[:n], k[:n], v[:n], cache, self.scale)
            if scoring is not None:
                scoring.observe(self.layer_id, q[:n], cache, self.scale, o)
            return self.o_proj(pad_rows(o, t))
        o = backend.forward(q, k, v, cache, self.scale)
        if scoring is not None:
            scoring.observe(self.layer_id, q, cache, self.scale, o)
        return self.o_proj(o)


class MLP(nn.Module):
    """The gated MLP. With ``native`` set (`native_linear.use_native_row_ops`, SiLU models on the
    CPU), few float32 rows take the gating in one C call: the native decode stack's own, so both
    paths give the same bits."""

    native: Optional["NativeRowOps"] = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        native = self.native
        if (
            native is not None
            and gate_up.dim() == 2
            and gate_up.shape[0] < native.max_rows
            and gate_up.dtype == torch.float32
            and gate_up.stride(1) == 1
            and not torch.compiler.is_compiling()
        ):
            return self.down_proj(native.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rope: RotaryEmbedding,
        kv_pool: Any,
        backend: "AttentionBackend",
        num_tokens: Optional[int] = None,
        scoring: Optional["ScoringPass"] = None,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), cos, sin, rope, kv_pool, backend, num_tokens, scoring)
        h, x = self.post_attention_layernorm.add_and_norm(h, attn)
        return h + self.mlp(x)


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over a paged KV pool."""

    batch_invariant: bool = False  # set by batch_invariant.enable_batch_invariant
    compiled_layers: Optional[Callable[..., torch.Tensor]] = None  # set by compiled.enable_compile
    decode_stack: Optional[Any] = None  # a decode_stack.DecodeStack, set by its use_decode_stack (CPU)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        with torch.device("cpu"):  # plain tensors, also when the model is built on the meta device
            self.rope = RotaryEmbedding(config.hf_config, config.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: "AttentionMetadata",
        kv_pool: Any,
        backend: "AttentionBackend",
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], for the batch's new tokens.

        Writes every layer's new K/V into ``kv_pool`` at ``meta.out_slots``.
        ``backend.plan(meta)`` must have been called for this batch.
        """
        n = input_ids.shape[0]
        rows = padded_rows(n) if self.batch_invariant else n  # batch-invariant mode: whole row tiles
        h = self.model.embed_tokens(pad_rows(input_ids, rows))
        cos, sin = self.rope.cos_sin(positions, h.dtype, meta.q_lens, meta.seq_lens)
        cos, sin = pad_rows(cos, rows), pad_rows(sin, rows)
        if self.compiled_layers is not None and not self.batch_invariant and meta.scoring is None:
            return self.compiled_layers(h, cos, sin, kv_pool, backend)
        if self.decode_stack is not None and not self.batch_invariant and meta.scoring is None:
            out = self.decode_stack.run(h, cos, sin, kv_pool, backend)
            if out is not None:
                return self.model.norm(out)
        real = n if self.batch_invariant else None  # only the real rows reach the attention backend
        h = self.run_layers(h, cos, sin, kv_pool, backend, real, meta.scoring)
        return h[:n] if self.batch_invariant else h

    def run_layers(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: Any = None,
        backend: Optional["AttentionBackend"] = None,
        num_tokens: Optional[int] = None,
        scoring: Optional["ScoringPass"] = None,
    ) -> torch.Tensor:
        """The layer stack and the final norm (arguments as `DecoderLayer.forward`'s).
        `compiled.enable_compile` compiles it called with the first three only: the compiled
        attention finds the pool and backend in its forward context."""
        for layer in self.model.layers:
            h = layer(h, cos, sin, self.rope, kv_pool, backend, num_tokens, scoring)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for hidden rows [N, hidden] returned by `forward`."""
        return self.lm_head(hidden).float()
