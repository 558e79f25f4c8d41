import os

import pytest
import torch

from radixrt.memory.kv_pool import KVPool, PageAllocator, lazy_zeros, prefault


# ---------------------------------------------------------------- allocator
def test_alloc_free_roundtrip():
    a = PageAllocator(8, 1)
    assert (a.num_pages, a.page_size, a.num_free_pages, a.num_free_slots) == (8, 1, 8, 8)
    p = a.alloc_pages(3)
    assert p == [0, 1, 2]
    assert a.num_free_pages == 5 and a.num_used_pages == 3
    q = a.alloc_pages(5)
    assert sorted(p + q) == list(range(8))
    assert a.num_free_pages == 0
    a.free_pages(p)
    assert a.num_free_pages == 3
    r = a.alloc_pages(3)
    assert sorted(r) == sorted(p)
    a.free_pages(q + r)
    assert a.num_free_pages == 8


def test_alloc_zero_and_negative():
    a = PageAllocator(4, 2)
    assert a.alloc_pages(0) == []
    assert a.num_free_pages == 4
    with pytest.raises(ValueError):
        a.alloc_pages(-1)


def test_exhaustion_allocates_nothing():
    a = PageAllocator(4, 4)
    assert a.alloc_pages(5) is None
    assert a.num_free_pages == 4
    p = a.alloc_pages(3)
    assert a.alloc_pages(2) is None
    assert a.num_free_pages == 1 and a.num_free_slots == 4
    assert a.alloc_pages(1) is not None
    assert a.alloc_pages(1) is None
    a.free_pages(p)
    assert a.num_free_pages == 3


def test_double_free_raises_and_frees_nothing():
    a = PageAllocator(6, 1)
    p = a.alloc_pages(4)
    a.free_pages([p[0]])
    with pytest.raises(ValueError, match="double free"):
        a.free_pages([p[0]])
    # a bad page in the middle of a batch: nothing of that batch is freed
    with pytest.raises(ValueError):
        a.free_pages([p[1], p[0], p[2]])
    assert a.num_free_pages == 3
    assert not a.is_page_free(p[1]) and not a.is_page_free(p[2])
    # the same page twice in one call
    with pytest.raises(ValueError):
        a.free_pages([p[1], p[1]])
    assert not a.is_page_free(p[1])
    with pytest.raises(ValueError, match="out of range"):
        a.free_pages([6])
    with pytest.raises(ValueError):
        a.free_pages([-1])
    a.free_pages(p[1:])
    assert a.num_free_pages == 6
    # a never-allocated page is free: freeing it is a double free
    with pytest.raises(ValueError):
        a.free_pages([5])


def test_pages_and_slots():
    a = PageAllocator(8, 4)
    assert a.total_slots == 32
    pages = a.alloc_pages(2)
    slots = a.pages_to_slots(pages)
    assert slots == [pages[0] * 4 + i for i in range(4)] + [pages[1] * 4 + i for i in range(4)]
    assert a.slots_to_pages(slots) == pages
    assert a.slots_to_pages(torch.tensor(slots)) == pages
    for bad in (slots[:3], slots[1:5], slots[:2] + slots[3:4] + slots[2:3] + slots[4:8]):
        with pytest.raises(ValueError):
            a.free_slots(bad)
    assert a.num_free_pages == 6
    a.free_slots(slots)
    assert a.num_free_pages == 8
    with pytest.raises(ValueError):
        a.free_slots(slots)


def test_alloc_slots_for_rounds_up_to_pages():
    a = PageAllocator(4, 4)
    s = a.alloc_slots_for(5)
    assert len(s) == 8 and s[0] % 4 == 0
    assert a.alloc_slots_for(9) is None
    a.free_slots(s)
    assert a.num_free_pages == 4


def test_page_size_one_slots_are_pages():
    a = PageAllocator(5, 1)
    p = a.alloc_pages(2)
    assert a.pages_to_slots(p) == p
    a.free_slots(p)
    assert a.num_free_slots == 5


def test_free_cost_independent_of_pool_size():
    # O(freed): a big pool must not make a small free slow (smoke check, no timing)
    a = PageAllocator(2_000_000, 1)
    p = a.alloc_pages(10)
    a.free_pages(p)
    assert a.num_free_pages == 2_000_000


# ------------------------------------------------------------------ KV pool
def test_kvpool_shapes_and_views():
    pool = KVPool(num_layers=3, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu")
    assert pool.total_slots == 20
    assert len(pool.k_buffers) == 3 and len(pool.v_buffers) == 3
    assert pool.k_buffers[0].shape == (5, 4, 2, 8)
    k, v = pool.layer_kv(1)
    assert k.shape == (20, 2, 8) and v.shape == (20, 2, 8)
    assert k.data_ptr() == pool.k_buffers[1].data_ptr()
    assert v.data_ptr() == pool.v_buffers[1].data_ptr()
    # writes through the flat view land in the paged buffer: slot = page*P + offset
    k[4 * 3 + 2] = 7.0
    assert torch.all(pool.k_buffers[1][3, 2] == 7.0)
    assert pool.k_buffers[1].sum().item() == 7.0 * 16
    # layers and K/V do not alias each other
    assert pool.k_buffers[0].sum().item() == 0 and pool.v_buffers[1].sum().item() == 0
    v[0, 1, 3] = 1.5
    assert pool.v_buffers[1][0, 0, 1, 3].item() == 1.5


def test_kvpool_bytes_per_token():
    assert KVPool.bytes_per_token_for(30, 3, 64, torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    pool = KVPool(2, 3, 1, 4, 16, dtype=torch.float16)
    assert pool.bytes_per_token == 2 * 2 * 4 * 16 * 2
    assert pool.total_bytes == pool.bytes_per_token * 3
    assert pool.k_buffers[0].dtype == torch.float16
    assert torch.all(pool.k_buffers[0] == 0)


def test_kvpool_rejects_bad_dims():
    with pytest.raises(ValueError):
        KVPool(1, 0, 1, 1, 1)


def _resident_bytes() -> int:
    import mmap

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_prefault_backs_a_lazy_buffer_without_changing_it() -> None:
    buf = lazy_zeros((64 << 20,), torch.uint8, torch.device("cpu"))
    buf[:4096] = 7  # some of it written already
    buf[40 << 20] = 9
    before = _resident_bytes()
    if not prefault(buf, 32 << 20):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    assert _resident_bytes() - before >= 30 << 20
    assert int(buf[:4096].sum()) == 7 * 4096 and int(buf[40 << 20]) == 9
    assert int(buf.sum()) == 7 * 4096 + 9


def test_a_pool_prefaults_its_first_pages_in_every_buffer() -> None:
    pool = KVPool(num_layers=2, num_pages=64, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    pool.k_buffers[1][3] = 1.5
    if not pool.prefault_pages(16):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    assert float(pool.k_buffers[1][3].sum()) == 1.5 * 4 * 2 * 8
    assert all(float(b.abs().sum()) == 0 for b in pool.buffers() if b is not pool.k_buffers[1])
