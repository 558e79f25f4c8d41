"""The scheduler's decode fast path gives what the general path gives.

`KVCacheManager.extend_decode` (one allocator call for a batch of one-token
decoders) must leave requests, allocator and request-to-slot table exactly as
`extend(req, 1)` for each request in turn does, and change nothing when memory
is short.
"""

from __future__ import annotations

import random

import pytest

from radixrt.memory.kv_manager import KVCacheManager
from radixrt.memory.kv_pool import PageAllocator
from radixrt.memory.no_prefix_cache import NoPrefixCache
from radixrt.memory.req_to_token import ReqToTokenPool
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.request import Req


def _setup(page_size: int, num_pages: int, prompt_lens: list[int]) -> tuple[KVCacheManager, list[Req]]:
    kv = KVCacheManager(
        PageAllocator(num_pages, page_size), NoPrefixCache(page_size), ReqToTokenPool(len(prompt_lens), 256)
    )
    reqs = []
    for i, n in enumerate(prompt_lens):
        req = Req(rid=f"r{i}", input_ids=[3 + i] * n, sampling=SamplingParams(max_new_tokens=8), seed=i)
        kv.admit(req, kv.match(req))
        assert kv.extend(req, n)
        reqs.append(req)
    return kv, reqs


def _state(kv: KVCacheManager, reqs: list[Req]) -> tuple:
    writes = kv.req_to_token.take_writes()
    return (
        [r.slots[:] for r in reqs],
        kv.allocator.num_free_pages,
        kv.allocator.alloc_pages(3),
        None if writes is None else writes.tolist(),
    )


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_decode_matches_one_extend_per_request(page_size: int) -> None:
    rnd = random.Random(page_size)
    lens = [rnd.randint(1, 13) for _ in range(9)]
    bulk_kv, bulk = _setup(page_size, 256, lens)
    loop_kv, loop = _setup(page_size, 256, lens)
    for _ in range(6):  # crosses page boundaries
        assert bulk_kv.extend_decode(bulk)
        for req in loop:
            assert loop_kv.extend(req, 1)
    assert _state(bulk_kv, bulk) == _state(loop_kv, loop)


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_decode_takes_nothing_when_short(page_size: int) -> None:
    kv, reqs = _setup(page_size, 4, [page_size] * 3)  # 3 full pages, 1 free page, 3 needed
    kv.req_to_token.take_writes()
    assert not kv.extend_decode(reqs)
    assert [len(r.slots) for r in reqs] == [page_size] * 3
    assert kv.allocator.num_free_pages == 1 and kv.req_to_token.take_writes() is None
