"""How tensor parallelism deals heads and vocabulary out to ranks (no processes)."""

import pytest

from radixrt.executor.parallel.sharding import _even_ranges, split_heads


def test_kv_groups_dealt_out_evenly_keeping_the_group_ratio():
    # SmolLM2-135M: 9 query heads in 3 KV groups, over 2 ranks: groups {0, 1} and {2}
    splits = split_heads(9, 3, 2)
    assert [(s.q_heads, s.kv_heads) for s in splits] == [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]
    # every query head once, every rank the model's query/KV ratio
    for heads, kv, size in [(32, 8, 4), (12, 4, 3), (28, 4, 2), (9, 3, 3), (16, 16, 4)]:
        splits = split_heads(heads, kv, size)
        assert [h for s in splits for h in s.q_heads] == list(range(heads))
        assert [g for s in splits for g in s.kv_heads] == list(range(kv))
        assert all(len(s.q_heads) == len(s.kv_heads) * (heads // kv) for s in splits)


def test_fewer_kv_heads_than_ranks_replicates_them():
    splits = split_heads(8, 2, 4)  # each KV head on 2 ranks, which split its 4 query heads
    assert [(s.q_heads, s.kv_heads) for s in splits] == [
        (range(0, 2), range(0, 1)),
        (range(2, 4), range(0, 1)),
        (range(4, 6), range(1, 2)),
        (range(6, 8), range(1, 2)),
    ]
    with pytest.raises(ValueError, match="tp_size 3 cannot split"):
        split_heads(8, 2, 3)
    with pytest.raises(ValueError, match="cannot split"):
        split_heads(3, 1, 2)  # 3 query heads of one KV head over 2 ranks


def test_vocabulary_and_intermediate_slices_cover_everything_once():
    for n, parts in [(49152, 2), (151936, 3), (7, 4)]:
        ranges = _even_ranges(n, parts)
        assert [i for r in ranges for i in r] == list(range(n))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
