"""The host tier under the radix tree, without a model: tiny real KV pools on
both tiers, copies really run, and every token's KV is checked to be the KV
of its own prefix after any number of evictions to the host and loads back.

The randomized test drives 10,000 operations (requests that match with
load-back, compute and insert; releases; evictions; swap-outs; look-ups;
resets) and checks the tree's integrity after each: device
``free + tree + private == total``, host ``free + tree == total``.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from radixrt.memory.host_pool import HostKVPool, host_pool_tokens
from radixrt.memory.host_radix_cache import HostRadixCache
from radixrt.memory.kv_pool import KVPool, PageAllocator
from radixrt.memory.kv_transfer import HostTier, KVTransferQueue


def _code(prefix: list[int]) -> float:
    """A float32-exact fingerprint of a token prefix: the KV 'computed' for its last token."""
    return float(zlib.crc32(bytes(str(prefix), "ascii")) % (1 << 22))


class Rig:
    """A device pool, a host pool and a tree over them, plus running 'requests'."""

    def __init__(
        self,
        device_tokens: int,
        host_tokens: int,
        page_size: int,
        policy: str,
        host_dtype: str = "auto",
        by_runs: bool = False,
    ) -> None:
        P = page_size
        self.P = P
        self.dev = KVPool(1, device_tokens // P, P, 1, 2, torch.float32, "cpu")
        self.host = HostKVPool(self.dev, host_tokens, kv_cache_dtype=host_dtype, by_runs=by_runs)
        self.alloc = PageAllocator(device_tokens // P, P)
        self.queue = KVTransferQueue()
        self.tree = HostRadixCache(self.alloc, P, HostTier(self.host.allocator, self.queue, policy))
        self.running: list[tuple[object, list[int]]] = []  # (locked node, private pages)
        self.k = self.dev.layer_kv(0)[0]

    # -- the life of one request, as KVCacheManager + the scheduler run it ------
    def request(self, key: list[int]) -> bool:
        tree, P = self.tree, self.P
        m = tree.match_prefix(key, load_back=True)
        tree.lock(m.node)
        need = len(key) - m.length
        pages = -(-need // P)
        if self.alloc.num_free_pages < pages:
            tree.evict((pages - self.alloc.num_free_pages) * P)
        got = self.alloc.alloc_pages(pages)
        if got is None:
            tree.unlock(m.node)
            self.step([])
            return False
        slots = m.slots + self.alloc.pages_to_slots(got)[:need]
        n = len(key) // P * P
        p = tree.insert(key[:n], slots[:n], computed=False)  # at launch, before the forward
        assert p >= m.length
        if p > m.length:
            self.alloc.free_slots(slots[m.length : p])
        m2 = tree.match_prefix(key[:n], record_stats=False)
        assert m2.length == n and m2.loaded == 0
        tree.lock(m2.node)
        tree.unlock(m.node)
        slots[:n] = m2.slots
        self.step([(key, slots, m.length)])
        self.running.append((m2.node, sorted({s // P for s in slots[n:]})))  # private pages
        return True

    def step(self, computed: list[tuple[list[int], list[int], int]]) -> None:
        """One launched step: queued copies before, the 'forward' (writes each
        new token's KV), queued copies after."""
        t = self.queue.take()
        self.host.run(t.before)
        for key, slots, start in computed:
            idx = torch.tensor(slots[start:], dtype=torch.int64)
            vals = torch.tensor([[_code(key[: i + 1]), float(i)] for i in range(start, len(key))])
            self.k.index_copy_(0, idx, vals.view(-1, 1, 2))
        self.host.run(t.after)

    def release(self, i: int) -> None:
        node, private = self.running.pop(i)
        self.tree.unlock(node)  # type: ignore[arg-type]
        self.alloc.free_pages(private)

    # -- checks -------------------------------------------------------------------
    def check(self) -> None:
        tree = self.tree
        tree.check_integrity()
        priv = sum(len(p) for _, p in self.running) * self.P
        assert self.alloc.num_free_slots + tree.total_size() + priv == self.alloc.total_slots
        h = self.host.allocator
        assert h.num_free_slots + tree.host_size() == h.total_slots

    def check_data(self) -> None:
        """Every device and host copy in the tree holds its own prefix's KV."""
        assert not self.queue.pending
        stack = [(c, []) for sub in self.tree.root.children.values() for c in sub.children.values()]
        while stack:
            node, prefix = stack.pop()
            full = prefix + node.key
            want = torch.tensor([[_code(full[: i + 1]), float(i)] for i in range(len(prefix), len(full))])
            if node.value:
                assert torch.equal(self.k[torch.tensor(node.value)].view(-1, 2), want), node
            if node.host_value is not None:
                assert torch.equal(self.host.read(0, node.host_value)[0].view(-1, 2), want), node
            stack.extend((c, full) for c in node.children.values())

    def check_match(self, key: list[int]) -> int:
        m = self.tree.match_prefix(key, load_back=True)
        self.step([])
        want = torch.tensor([[_code(key[: i + 1]), float(i)] for i in range(m.length)]).view(-1, 2)
        assert torch.equal(self.k[torch.tensor(m.slots, dtype=torch.int64)].view(-1, 2), want)
        return m.loaded


def _keys(rng: random.Random, n_bases: int = 6) -> list[list[int]]:
    return [[rng.randrange(5) for _ in range(rng.randint(4, 24))] for _ in range(n_bases)]


def _random_key(rng: random.Random, bases: list[list[int]]) -> list[int]:
    base = rng.choice(bases)
    cut = rng.randint(0, len(base))
    return base[:cut] + [rng.randrange(5) for _ in range(rng.randint(1, 12))]


@pytest.mark.parametrize(
    "page_size,policy,by_runs",
    [
        pytest.param(1, "write_through", True, marks=pytest.mark.slow),  # ~2-3 s each: one on the fast path
        (4, "write_back", False),
    ],
)
def test_randomized_two_tiers(page_size, policy, by_runs):
    rng = random.Random(7 + page_size)
    rig = Rig(device_tokens=48, host_tokens=96, page_size=page_size, policy=policy, by_runs=by_runs)
    bases = _keys(rng)
    counts = dict.fromkeys(("request", "refused", "release", "match", "evict", "offload", "reset"), 0)
    for op_i in range(10_000):
        r = rng.random()
        if r < 0.40:
            counts["request" if rig.request(_random_key(rng, bases)) else "refused"] += 1
            if len(rig.running) > 3:
                rig.release(0)
        elif r < 0.55 and rig.running:
            rig.release(rng.randrange(len(rig.running)))
            counts["release"] += 1
        elif r < 0.75:
            rig.check_match(_random_key(rng, bases))
            counts["match"] += 1
        elif r < 0.85:
            rig.tree.evict(rng.randint(1, 16))
            rig.step([])
            counts["evict"] += 1
        elif r < 0.95:
            leaves = list(rig.tree._leaves)
            if leaves:
                rig.tree.offload(rng.choice(leaves)[2])
                rig.step([])
                counts["offload"] += 1
        elif r < 0.951 and not rig.running:
            rig.tree.reset()
            counts["reset"] += 1
        elif r >= 0.99:
            bases[rng.randrange(len(bases))] = _keys(rng, 1)[0]  # the working set drifts
        rig.check()
        if op_i % 100 == 0:
            rig.check_data()
    rig.check_data()
    st = rig.tree.stats()
    # every path was exercised: loads back (host hits), offloads, host drops
    assert st["host_hit_tokens"] > 0 and st["host_offloaded_tokens"] > 0 and st["host_evicted_tokens"] > 0
    assert st["hit_tokens"] == st["device_hit_tokens"] + st["host_hit_tokens"]
    assert counts["request"] > 2000 and counts["offload"] > 500


def test_evicted_prefix_comes_back_from_host():
    rig = Rig(device_tokens=16, host_tokens=64, page_size=1, policy="write_back")
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [9, 8, 7, 6, 5, 4, 3, 2]
    assert rig.request(a)
    rig.release(0)
    assert rig.request(b)  # needs 8 of 16 slots: a's leaf moves to the host
    rig.release(0)
    assert rig.request([5, 5, 5, 5, 5, 5, 5, 5])
    rig.release(0)
    rig.check()
    m = rig.tree.match_prefix(a, load_back=False)
    assert m.length + m.host_length == len(a) and m.host_length > 0
    assert rig.check_match(a) == m.host_length  # loaded back, data intact
    rig.check()
    rig.check_data()
    st = rig.tree.stats()
    assert st["host_hit_tokens"] == m.host_length


def test_host_full_drops_lru_and_locked_nodes_stay():
    rig = Rig(device_tokens=8, host_tokens=8, page_size=1, policy="write_back")
    for k in ([1] * 8, [2] * 8, [3] * 8):
        assert rig.request(k)
        rig.release(0)
        rig.check()
    # the device holds [3]*8, the host [2]*8; [1]*8 was dropped by the host's LRU
    assert rig.tree.match_prefix([1] * 8).length == 0
    assert rig.tree.match_prefix([1] * 8).host_length == 0
    assert rig.tree.match_prefix([2] * 8).host_length == 8
    m = rig.tree.match_prefix([3] * 8)
    rig.tree.lock(m.node)
    assert rig.tree.evict(8) == 0  # locked: stays on the device
    rig.tree.unlock(m.node)
    rig.check()


@pytest.mark.parametrize("by_runs", [False, True])
def test_write_through_copies_at_insert_and_evicts_without_copy(by_runs):
    rig = Rig(device_tokens=16, host_tokens=32, page_size=1, policy="write_through", by_runs=by_runs)
    assert rig.request(list(range(10)))
    rig.release(0)
    assert rig.queue.offloaded_tokens == 10  # copied once, after the forward that computed it
    rig.tree.evict(16)
    rig.step([])
    assert rig.queue.offloaded_tokens == 10  # evicting a backed-up node copies nothing
    assert rig.tree.total_size() == 0 and rig.tree.host_size() == 10
    assert rig.check_match(list(range(10))) == 10
    rig.check_data()


def test_int8_host_tier_is_close_not_exact():
    rig = Rig(device_tokens=8, host_tokens=32, page_size=1, policy="write_back", host_dtype="int8")
    assert not rig.host.exact and rig.host.bytes_per_token < rig.dev.bytes_per_token
    key = [3, 1, 4, 1, 5, 9, 2, 6]
    assert rig.request(key)
    rig.release(0)
    before = rig.k[torch.tensor(rig.tree.match_prefix(key).slots)].clone()
    rig.tree.evict(8)
    rig.step([])
    m = rig.tree.match_prefix(key, load_back=True)
    rig.step([])
    after = rig.k[torch.tensor(m.slots)]
    assert m.loaded == 8
    step = before.abs().amax(-1, keepdim=True) / 127  # int8 absmax: one step of the row's scale
    assert bool(((after - before).abs() <= step).all())
    assert not torch.equal(after, before)


def test_host_pool_sizing_flags():
    assert host_pool_tokens(1000, 100.0, 2.0, 0.0, None) == 2000
    assert host_pool_tokens(1000, 1024.0, 2.0, 1.0, None) == (1 << 30) // 1024
    assert host_pool_tokens(1000, 100.0, 2.0, 1.0, 77) == 77
    with pytest.raises(ValueError, match="write policy"):
        HostTier(PageAllocator(4, 1), write_policy="write_sometimes")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("by_runs", [False, True])
def test_quantized_device_pool_round_trips_exactly(kv_cache_dtype, by_runs):
    """A quantized device pool's bytes (and int8 scales) go to the host and back unchanged."""
    from radixrt.memory.kv_transfer import TransferOp

    dev = KVPool(2, 8, 2, 2, 4, torch.float32, "cpu", kv_cache_dtype=kv_cache_dtype)
    host = HostKVPool(dev, 16, by_runs=by_runs)
    assert host.exact and host.kv_cache_dtype == kv_cache_dtype
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        slots = torch.arange(16)
        dev.layer_cache(layer).store(slots, torch.randn(16, 2, 4, generator=g), torch.randn(16, 2, 4, generator=g))
    before = [dev.layer_cache(i).gather(torch.arange(16), torch.float32) for i in range(2)]
    src, tmp = [2, 3, 8, 9], [0, 1, 14, 15]  # whole pages of 2, as tree nodes are
    host.run([TransferOp(True, src, tmp)])
    for layer in range(2):  # clobber, then load back into other device slots
        dev.layer_cache(layer).store(torch.tensor(src), torch.zeros(4, 2, 4), torch.zeros(4, 2, 4))
    host.run([TransferOp(False, tmp, [12, 13, 6, 7])])
    for layer in range(2):
        k, v = dev.layer_cache(layer).gather(torch.tensor([12, 13, 6, 7]), torch.float32)
        assert torch.equal(k, before[layer][0][src]) and torch.equal(v, before[layer][1][src])


def test_config_refuses_inconsistent_host_tier_flags():
    from radixrt.config import EngineConfig

    with pytest.raises(ValueError, match="enable-hierarchical-cache"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="write_policy"):
        EngineConfig(enable_hierarchical_cache=True, hicache_write_policy="sometimes")
    with pytest.raises(ValueError, match="radix cache"):
        EngineConfig(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ValueError, match="host_kv_size"):
        EngineConfig(enable_hierarchical_cache=True, host_kv_size=0)
    EngineConfig(enable_hierarchical_cache=True, preemption_mode="swap", hicache_write_policy="write_back")


def test_swap_cost_model_decides_by_model_and_device():
    from radixrt.memory.swap_cost import SwapCostModel

    small_cpu = SwapCostModel.for_device("cpu", 135_000_000, 46_080)
    small_gpu = SwapCostModel.for_device("cuda", 135_000_000, 23_040)
    big_gpu = SwapCostModel.for_device("cuda:0", 70_000_000_000, 327_680)
    assert small_cpu.should_swap(100) and not small_gpu.should_swap(100) and big_gpu.should_swap(100)
    assert not small_cpu.should_swap(0)
