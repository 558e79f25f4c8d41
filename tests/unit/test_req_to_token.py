"""The request-to-slot table and the attention metadata gathered from it."""

from __future__ import annotations

import random

import pytest
import torch

from radixrt.kernels import AttentionMetadata
from radixrt.memory.req_to_token import ReqToTokenPool


def _fill(pool: ReqToTokenPool, seqs: list[list[int]]) -> list[int]:
    rows = []
    for slots in seqs:
        row = pool.alloc_row()
        # written in pieces, as admission (a cached prefix) then extends do
        cut = len(slots) // 2
        pool.write(row, 0, slots[:cut])
        for i in range(cut, len(slots)):
            pool.write(row, i, [slots[i]])
        rows.append(row)
    pool.flush()
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_from_table_equals_build(seed):
    rng = random.Random(seed)
    pool = ReqToTokenPool(max_requests=16, max_context_len=64)
    B = rng.randint(1, 12)
    seqs = [rng.sample(range(1000), rng.randint(1, 60)) for _ in range(B)]
    decode = seed % 2 == 0
    q_lens = [1 if decode else rng.randint(1, len(s)) for s in seqs]
    # rows are handed out in order, so shuffle which row each request got
    for _ in range(rng.randint(0, 3)):
        pool.free_row(pool.alloc_row())
    rows = _fill(pool, seqs)
    got = AttentionMetadata.from_table(pool.table, rows, q_lens, [len(s) for s in seqs])
    want = AttentionMetadata.build(seqs, q_lens)
    for name in ("qo_indptr", "kv_indptr", "kv_slots", "out_slots", "positions"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
    assert got.q_lens == want.q_lens and got.kv_lens == want.kv_lens
    for i, s in enumerate(seqs):
        assert got.slot_table[i, : len(s)].tolist() == s


def test_rows_are_reused_and_bounded():
    pool = ReqToTokenPool(max_requests=2, max_context_len=8, scratch_slot=99)
    a, b = pool.alloc_row(), pool.alloc_row()
    assert {a, b} == {0, 1} and pool.num_free_rows == 0
    with pytest.raises(RuntimeError):
        pool.alloc_row()
    pool.free_row(a)
    assert pool.alloc_row() == a
    assert pool.table[pool.padding_row, 0] == 99
    with pytest.raises(ValueError):
        pool.write(b, 4, [1, 2, 3, 4, 5])
