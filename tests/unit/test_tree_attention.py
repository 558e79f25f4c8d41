"""Tree attention (kernels/tree.py): a draft tree's tokens see the prefix and
their ancestors only, at their depth's position, on every CPU path of the torch
backend (decode rows with the C kernel and without, the masked extend for a
long tree, the shared-prefix cascade), and FlashInfer's dense mask says the same."""

from __future__ import annotations

import random

import pytest
import torch

from radixrt.kernels import AttentionMetadata, LayerKVCache
from radixrt.kernels.torch_ref import TorchReferenceBackend
from radixrt.kernels.tree import ancestor_mask, check_parents, depths, flat_mask, path

HEAD_DIM = 16
HKV, HQ = 2, 6


def _random_tree(q: int, rng: random.Random) -> list[int]:
    """New tokens: the decode token (parent -1), then draft tokens hanging anywhere below it."""
    return [-1] + [rng.randrange(0, j) for j in range(1, q)]


def _oracle(q, k_cache, v_cache, seq_slots, q_lens, tree, scale):
    """float64 attention of each new token over exactly the keys it may see."""
    outs = []
    t = 0
    for slots, ql, parents in zip(seq_slots, q_lens, tree):
        kv = len(slots)
        for j in range(ql):
            seen = list(range(kv - ql)) + [kv - ql + a for a in (path(parents, j) if parents else range(j + 1))]
            idx = torch.tensor([slots[i] for i in seen])
            k = k_cache[idx].double().repeat_interleave(HQ // HKV, dim=1)
            v = v_cache[idx].double().repeat_interleave(HQ // HKV, dim=1)
            s = torch.einsum("hd,khd->hk", q[t + j].double(), k) * scale
            outs.append(torch.einsum("hk,khd->hd", s.softmax(-1), v).reshape(-1))
        t += ql
    return torch.stack(outs)


CASES = [
    # (name, prefix lengths, new-token counts, which requests verify a tree)
    ("decode-rows", [40, 25, 60], [7, 1, 9], [True, False, True]),
    ("long-tree-extend", [50, 30], [40, 3], [True, False]),
    ("chain-and-tree", [20, 20], [5, 6], [False, True]),
]


@pytest.mark.parametrize("native", [True, False], ids=["c-decode", "torch-decode"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-prefixes", "cascade"])
@pytest.mark.parametrize("name,prefixes,q_lens,trees", CASES, ids=[c[0] for c in CASES])
def test_tree_attention_matches_oracle(name, prefixes, q_lens, trees, shared, native, monkeypatch):
    from radixrt.kernels import cascade

    monkeypatch.setattr(cascade, "MAX_PADDED_WORK", float("inf"))  # the cascade's masks, however it pads
    rng = random.Random(f"{name}-{shared}")
    torch.manual_seed(rng.randrange(1 << 30))
    common = 48 if shared else 0  # a shared prefix of slots (the cascade path takes it)
    total = common + sum(prefixes) + sum(q_lens) + 8
    free = list(range(common, total))
    rng.shuffle(free)
    seq_slots = []
    for p, q in zip(prefixes, q_lens):
        mine, free = free[: p + q], free[p + q :]
        seq_slots.append(list(range(common)) + mine)
    tree = [_random_tree(q, rng) if t else None for q, t in zip(q_lens, trees)]
    meta = AttentionMetadata.build(seq_slots, q_lens, tree=tree)
    kv_lens = [len(s) for s in seq_slots]
    want_pos = []
    for kv, q, parents in zip(kv_lens, q_lens, tree):
        want_pos += [kv - q + d for d in (depths(parents) if parents else range(q))]
    assert meta.positions.tolist() == want_pos
    assert meta.out_slots.tolist() == [s for slots, q in zip(seq_slots, q_lens) for s in slots[len(slots) - q :]]
    # the same metadata from a request-to-slot table
    table = torch.zeros(len(seq_slots), max(kv_lens), dtype=torch.int32)
    for i, s in enumerate(seq_slots):
        table[i, : len(s)] = torch.tensor(s)
    from_table = AttentionMetadata.from_table(table, list(range(len(seq_slots))), q_lens, kv_lens, tree=tree)
    assert from_table.positions.tolist() == want_pos and torch.equal(from_table.out_slots, meta.out_slots)

    k_cache, v_cache = torch.randn(total, HKV, HEAD_DIM), torch.randn(total, HKV, HEAD_DIM)
    t = meta.num_tokens
    q, k, v = torch.randn(t, HQ, HEAD_DIM), torch.randn(t, HKV, HEAD_DIM), torch.randn(t, HKV, HEAD_DIM)
    backend = TorchReferenceBackend(native_decode=native)
    backend.plan(meta)
    assert (backend._cascade is not None) == shared
    out = backend.forward(q, k, v, LayerKVCache(k_cache, v_cache), 0.25)
    ref = _oracle(q, k_cache, v_cache, seq_slots, q_lens, tree, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # and it is not the causal answer (the mask mattered)
    causal = _oracle(q, k_cache, v_cache, seq_slots, q_lens, [None] * len(tree), 0.25)
    assert not torch.allclose(out.double(), causal, atol=1e-3)


def test_tree_helpers_and_flashinfer_mask():
    parents = [-1, 0, 0, 1, 3, 2]
    check_parents(parents)
    with pytest.raises(ValueError, match="parent"):
        check_parents([-1, 1])
    assert depths(parents) == [0, 1, 1, 2, 3, 2]
    assert path(parents, 4) == [0, 1, 3, 4]
    m = ancestor_mask(parents)
    assert m[4].tolist() == [True, True, False, True, True, False]
    assert m[5].tolist() == [True, False, True, False, False, True]
    # FlashInfer's flattened custom mask: a causal request, then the tree over a 3-token prefix
    flat = flat_mask([2, 6], [4, 9], [None, parents])
    assert flat.numel() == 2 * 4 + 6 * 9
    causal = flat[:8].view(2, 4)
    assert causal.tolist() == [[True, True, True, False], [True, True, True, True]]
    tree = flat[8:].view(6, 9)
    assert tree[:, :3].all() and torch.equal(tree[:, 3:], m)


def test_deterministic_path_refuses_a_tree():
    meta = AttentionMetadata.build([list(range(10))], [3], tree=[[-1, 0, 0]])
    with pytest.raises(ValueError, match="tree"):
        TorchReferenceBackend(deterministic=True).plan(meta)
