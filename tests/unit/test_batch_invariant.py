"""Batch-invariant ops: a row's bits do not depend on what else is computed with it.

The linear layers (executor/batch_invariant.py) against every batch size and
row offset; the fixed-split attention (kernels/fixed_split.py) for one
request's tokens computed as a whole prefill, in chunks, one decode step at a
time and next to other requests; and the tiny model's hidden states for a
token computed in a prefill versus a decode step."""

from __future__ import annotations

import random

import pytest
import torch

from radixrt.executor.batch_invariant import ROW_TILE, BatchInvariantLinear, enable_batch_invariant, invariant_linear
from radixrt.kernels import AttentionMetadata, LayerKVCache
from radixrt.kernels.fixed_split import KV_CHUNK, QUERY_TILE
from radixrt.kernels.torch_ref import TorchReferenceBackend


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536)])
def test_invariant_linear_rows_do_not_depend_on_batch(n, k):
    torch.manual_seed(n + k)
    w = torch.randn(n, k) * 0.05
    b = torch.randn(n)
    x = torch.randn(200, k)
    rows = [0, 1, 2, ROW_TILE - 1, ROW_TILE, ROW_TILE + 1, 39, 100, 199]
    alone = {i: invariant_linear(x[i : i + 1], w, b)[0] for i in rows}  # one tile, one real row
    torch.testing.assert_close(
        torch.stack(list(alone.values())), torch.nn.functional.linear(x[rows], w, b), rtol=1e-4, atol=1e-4
    )
    for m in (2, 3, ROW_TILE - 1, ROW_TILE, ROW_TILE + 1, 40, 101, 200):  # 1 to 13 tiles
        y = invariant_linear(x[:m], w, b)
        assert all(torch.equal(y[i], alone[i]) for i in rows if i < m), m
    # the same rows behind other rows (another place in their tiles)
    y = invariant_linear(torch.cat([torch.randn(5, k), x]), w, b)[5:]
    assert all(torch.equal(y[i], alone[i]) for i in rows)
    assert invariant_linear(x[:3].view(1, 3, k), w).shape == (1, 3, n)


def test_sampler_row_sum_does_not_depend_on_rows():
    """The top-p check's sum over the vocabulary (a plain ``sum(1)`` of one row is
    split across threads, of many rows is not)."""
    from radixrt.sampling.draws import _row_sum

    x = torch.rand(32, 49152 + 100)
    full = _row_sum(x)
    torch.testing.assert_close(full, x.double().sum(1).float())
    assert all(torch.equal(_row_sum(x[i : i + m]), full[i : i + m]) for i, m in ((0, 1), (5, 1), (3, 2), (0, 17)))


HKV, G, D = 2, 3, 16


def _cache(num_slots: int) -> LayerKVCache:
    k = torch.randn(num_slots, HKV, D)
    v = torch.randn(num_slots, HKV, D)
    return LayerKVCache(k, v)


def _attend(backend, cache, q_all, seqs):
    """Attention output for ``seqs`` = [(slots, q_len)]: each request computes the
    last q_len of its slots, with queries taken from q_all[slot]. K/V written are
    those already in the cache (so the cache never changes)."""
    meta = AttentionMetadata.build([s for s, _ in seqs], [q for _, q in seqs])
    idx = meta.out_slots
    backend.plan(meta)
    k = cache.k[idx].clone()
    v = cache.v[idx].clone()
    out = backend.forward(q_all[idx], k, v, cache, D**-0.5)
    return out, idx


def _dense(q_all, cache, slots):
    """float64 causal attention of one whole sequence."""
    idx = torch.tensor(slots)
    q = q_all[idx].double()
    k = cache.k[idx].double().repeat_interleave(G, dim=1)
    v = cache.v[idx].double().repeat_interleave(G, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    n = len(slots)
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, -1)


def test_fixed_split_attention_is_batch_invariant():
    rng = random.Random(0)
    torch.manual_seed(0)
    length = KV_CHUNK + 37  # two chunks, the last one partial
    others_len = [5, KV_CHUNK + 3, 150, 1]
    num_slots = length + sum(others_len) + 8
    cache = _cache(num_slots)
    perm = list(range(num_slots))
    rng.shuffle(perm)  # scattered slots
    slots, perm = perm[:length], perm[length:]
    others = []
    for n in others_len:
        others.append(perm[:n])
        perm = perm[n:]
    q_all = torch.randn(num_slots, HKV * G, D)
    backend = TorchReferenceBackend(deterministic=True)

    whole, _ = _attend(backend, cache, q_all, [(slots, length)])
    torch.testing.assert_close(whole.double(), _dense(q_all, cache, slots), rtol=1e-5, atol=1e-5)

    # the same sequence in uneven chunks (chunked prefill / prefix-cache hits), with neighbours
    rows = []
    done = 0
    for step in (1, QUERY_TILE + 1, 50, KV_CHUNK, 1000):
        end = min(length, done + step)
        if done == end:
            break
        out, _ = _attend(backend, cache, q_all, [(others[1], 7), (slots[:end], end - done), (others[2], 1)])
        rows.append(out[7 : 7 + end - done])
        done = end
    assert done == length
    assert torch.equal(torch.cat(rows), whole)

    # one decode step at a time at a few positions, in batches of other decodes and extends
    for p in (0, 1, KV_CHUNK - 1, KV_CHUNK, length - 1):
        batch = [(others[0], 1), (slots[: p + 1], 1), (others[3], 1), (others[2], 3)]
        out, _ = _attend(backend, cache, q_all, batch)
        assert torch.equal(out[1], whole[p]), p
        alone, _ = _attend(backend, cache, q_all, [(slots[: p + 1], 1)])
        assert torch.equal(alone[0], whole[p]), p


@pytest.mark.slow  # ~1.5 s; the fast e2e test covers the tiny model end to end
def test_tiny_model_token_bits_same_in_prefill_and_decode(tiny_llama):
    """The whole model (linear tiles, padding, attention): a token's final hidden
    state is bit-identical whether computed in a prefill or a decode step, alone
    or in a batch."""
    from radixrt.config import EngineConfig
    from radixrt.executor.model_runner import ModelRunner

    runner = ModelRunner.from_config(
        EngineConfig(model_path=tiny_llama, max_total_tokens=512, enable_deterministic_inference=True)
    )
    rng = random.Random(1)
    ids = [rng.randrange(100, 30000) for _ in range(40)]
    other = [rng.randrange(100, 30000) for _ in range(23)]
    a = list(range(0, 40))
    b = list(range(100, 123))
    whole = runner.forward(ids, [a], [40])
    # b's prompt, then a's last token decoded next to b's own decode
    runner.forward(other, [b], [23])
    for p in (5, 39):
        dec = runner.forward([other[-1], ids[p]], [b, a[: p + 1]], [1, 1])
        assert torch.equal(dec[1], whole[p]), p
    # a in two chunks next to b
    first = runner.forward(ids[:17], [a[:17]], [17])
    second = runner.forward([other[-1]] + ids[17:], [b, a], [1, 23])
    assert torch.equal(torch.cat([first, second[1:]]), whole)
    # the logits of a row are independent of the others computed with it
    logits = runner.logits(whole)
    assert torch.equal(runner.logits(whole[7:8])[0], logits[7])


def test_tensor_parallel_shards_take_the_invariant_product():
    """A tensor-parallel shard computes its own product (then the collective): deterministic mode
    gives it the tiled product as it does to plain linear layers."""
    from radixrt.executor.parallel.sharding import RowParallelLinear

    shard = RowParallelLinear(torch.randn(8, 4), None, group=None)
    plain = torch.nn.Linear(4, 8)
    enable_batch_invariant(torch.nn.Sequential(shard, plain))
    assert shard.linear_product is invariant_linear and type(plain) is BatchInvariantLinear
    assert RowParallelLinear.linear_product is not invariant_linear  # the instance's, not the class's
