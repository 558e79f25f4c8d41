"""Splitting a loaded Llama-family model across tensor-parallel ranks (Megatron style).

Per decoder layer: the fused q/k/v and gate/up projections are column
parallel (each rank keeps the output rows of its heads / its slice of the
intermediate size, no communication); ``o_proj`` and ``down_proj`` are row
parallel (each rank multiplies its input columns, then one all-reduce sums the
partial results, and the bias is added once, after it). The embedding and the
LM head are vocabulary parallel: each rank holds a contiguous slice of the
vocabulary; a lookup is zero outside the slice and summed over ranks, and the
leader gathers the logit columns.

Heads go to ranks by KV group, so every rank keeps the model's ratio of query
to KV heads: with at least as many KV heads as ranks the groups are dealt out
as evenly as they go (SmolLM2-135M's 3 groups over 2 ranks: 2 and 1); with
fewer, each KV head is replicated on ``size / num_kv_heads`` ranks, which
split its query heads. Uneven splits are allowed (every sum is still exact up
to float rounding), so the embedded model runs with ``tp_size 2``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.executor.models.config import ModelConfig
from radixrt.executor.models.llama import DecoderLayer, LlamaForCausalLM
from radixrt.executor.parallel.group import TPGroup


@dataclass(frozen=True)
class HeadSplit:
    """One rank's heads: query heads ``q_heads`` and KV heads ``kv_heads``
    (global indices, contiguous ranges)."""

    q_heads: range
    kv_heads: range


def _even_ranges(n: int, parts: int) -> list[range]:
    """``n`` items in ``parts`` contiguous ranges whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def split_heads(num_heads: int, num_kv_heads: int, size: int) -> list[HeadSplit]:
    """Each rank's heads (see the module doc). Raises ValueError when some
    rank would get no head or a KV head's query heads cannot be split evenly."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        return [HeadSplit(range(kv.start * group, kv.stop * group), kv) for kv in _even_ranges(num_kv_heads, size)]
    if size % num_kv_heads or group % (size // num_kv_heads):
        raise ValueError(
            f"tp_size {size} cannot split {num_heads} query heads over {num_kv_heads} KV heads: "
            "with fewer KV heads than ranks, tp_size must be a multiple of the KV heads and divide "
            "the query heads of each"
        )
    share = size // num_kv_heads  # ranks per KV head
    per_rank = group // share
    splits = []
    for rank in range(size):
        kv = rank // share
        first = kv * group + (rank % share) * per_rank
        splits.append(HeadSplit(range(first, first + per_rank), range(kv, kv + 1)))
    return splits


# what quantizes a shard's product: (a bias-free linear layer of its weight, each row's largest
# magnitude over all ranks or None) -> the module that computes it (quantized_linear.quantize_model)
Quantizer = Callable[[nn.Linear, Optional[torch.Tensor]], nn.Module]


class RowParallelLinear(nn.Linear):
    """``y = sum_over_ranks(x_local @ W_local^T) + b``: this rank's input columns
    of a linear layer; the all-reduce makes every rank's output the full one.
    ``local``: the columns' product as a module of its own (`quantize_local`: quantized
    weights), which then replaces ``weight`` (emptied). ``row_absmax``: each row's largest
    magnitude over all ranks' columns (int8 scales them as without tensor parallelism)."""

    # the product of this rank's columns; deterministic inference swaps in a batch-invariant one
    # (`enable_batch_invariant`)
    linear_product = staticmethod(F.linear)

    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        group: TPGroup,
        row_absmax: Optional[torch.Tensor] = None,
    ) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        if bias is not None:
            self.bias = nn.Parameter(bias.clone(), requires_grad=False)
        self.group = group
        self.row_absmax = row_absmax
        self.local: Optional[nn.Module] = None

    @classmethod
    def of_columns(cls, linear: nn.Linear, columns: slice | torch.Tensor, group: TPGroup) -> "RowParallelLinear":
        """The shard of ``linear`` that holds its input columns ``columns``."""
        whole = linear.weight
        return cls(whole[:, columns], linear.bias, group, whole.detach().abs().amax(dim=1).float())

    def quantize_local(self, quantize: Quantizer) -> nn.Module:
        """Make ``quantize(columns, row_absmax)`` of this rank's columns (a bias-free linear layer)
        the local product; it."""
        self.local = quantize(_bias_free(self.weight), self.row_absmax)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)  # the float copy goes
        return self.local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.linear_product(x, self.weight) if self.local is None else self.local(x)
        y = self.group.all_reduce(part)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The rows ``vocab`` of the embedding table; ids outside them embed to zero
    on this rank, and the all-reduce adds the one rank that has each id."""

    def __init__(self, weight: torch.Tensor, vocab: range, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.vocab = vocab
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.vocab.start) & (ids < self.vocab.stop)
        local = torch.where(mine, ids - self.vocab.start, torch.zeros_like(ids))
        h = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(h)


class VocabParallelLMHead(nn.Module):
    """Logit columns ``vocab`` on every rank; the leader gets all of them
    ([N, vocab_size]), the other ranks an empty tensor (they only take part).
    ``local``: the rows' product as a module of its own (`quantize_local`)."""

    linear_product = staticmethod(F.linear)  # as RowParallelLinear's

    def __init__(self, weight: nn.Parameter, widths: list[int], group: TPGroup) -> None:
        super().__init__()
        self.weight = weight  # shared with the embedding when the model ties them
        self.widths = widths
        self.group = group
        self.local: Optional[nn.Module] = None

    def quantize_local(self, quantize: Quantizer) -> nn.Module:
        """Make ``quantize(rows, None)`` of this rank's vocabulary rows the local product; it. The
        head lets its float rows go (a tied embedding keeps them)."""
        self.local = quantize(_bias_free(self.weight), None)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return self.local

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        part = self.linear_product(h, self.weight) if self.local is None else self.local(h)
        full = self.group.gather_columns(part, self.widths)
        return full if full is not None else h.new_empty(h.shape[0], 0)


def _bias_free(weight: torch.Tensor) -> nn.Linear:
    """A linear layer of ``weight`` (shared, not copied) and no bias, for a quantizer to read."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def shard_model(model: LlamaForCausalLM, cfg: ModelConfig, group: TPGroup) -> ModelConfig:
    """Replace ``model``'s layers by this rank's shards, in place. Returns the
    rank's view of the config (its own head counts), which sizes its KV pool
    and attention backend; everything else (vocabulary, layers) is unchanged."""
    split = split_heads(cfg.num_heads, cfg.num_kv_heads, group.size)[group.rank]
    D = cfg.head_dim
    q_rows = torch.arange(split.q_heads.start * D, split.q_heads.stop * D)
    kv_rows = torch.arange(split.kv_heads.start * D, split.kv_heads.stop * D)
    q_size, kv_size = cfg.num_heads * D, cfg.num_kv_heads * D
    qkv_rows = torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])
    inter = _even_ranges(cfg.intermediate_size, group.size)[group.rank]
    mine_inter = torch.arange(inter.start, inter.stop)
    gate_up_rows = torch.cat([mine_inter, cfg.intermediate_size + mine_inter])
    body = model.model
    for layer in body.layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _rows_of(attn.qkv_proj, qkv_rows)
        attn.o_proj = RowParallelLinear.of_columns(attn.o_proj, q_rows, group)
        attn.num_heads, attn.num_kv_heads = len(split.q_heads), len(split.kv_heads)
        attn.q_size, attn.kv_size = len(q_rows), len(kv_rows)
        mlp.gate_up_proj = _rows_of(mlp.gate_up_proj, gate_up_rows)
        mlp.down_proj = RowParallelLinear.of_columns(mlp.down_proj, slice(inter.start, inter.stop), group)
        mlp.intermediate_size = len(inter)
    vocabs = _even_ranges(cfg.vocab_size, group.size)
    mine = vocabs[group.rank]
    table = body.embed_tokens.weight
    tied = model.lm_head.weight is table
    embed = VocabParallelEmbedding(table[mine.start : mine.stop], mine, group)
    body.embed_tokens = embed  # type: ignore[assignment]  # same call signature as nn.Embedding
    head_weight = (
        embed.weight
        if tied
        else nn.Parameter(model.lm_head.weight[mine.start : mine.stop].contiguous(), requires_grad=False)
    )
    head = VocabParallelLMHead(head_weight, [len(v) for v in vocabs], group)
    model.lm_head = head  # type: ignore[assignment]  # same call signature as nn.Linear
    return replace(cfg, num_heads=len(split.q_heads), num_kv_heads=len(split.kv_heads))


def _rows_of(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A column-parallel shard: the output rows ``rows`` of ``linear``."""
    out = nn.Linear(linear.in_features, len(rows), bias=linear.bias is not None, device="meta")
    out.weight = nn.Parameter(linear.weight[rows].contiguous(), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias[rows].contiguous(), requires_grad=False)
    return out
