import random

import pytest

from radixrt.memory.kv_pool import PageAllocator
from radixrt.memory.no_prefix_cache import NoPrefixCache
from radixrt.memory.radix_cache import MatchResult, RadixCache, _first_mismatch


def make(num_pages=64, page_size=1, disable=False):
    alloc = PageAllocator(num_pages, page_size)
    return alloc, (NoPrefixCache(page_size) if disable else RadixCache(alloc, page_size=page_size))


def alloc_for(alloc, n):
    """Private slots for n tokens (n a multiple of the page size)."""
    pages = alloc.alloc_pages(n // alloc.page_size)
    assert pages is not None
    return alloc.pages_to_slots(pages)


def conserved(alloc, cache, private=()):
    tree = cache.all_slots()
    assert len(set(tree)) == len(tree)
    assert not set(tree) & set(private)
    assert alloc.num_free_slots + len(tree) + len(private) == alloc.total_slots


def test_first_mismatch():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 300)
        a = [rng.randint(0, 3) for _ in range(n)]
        off = rng.randint(0, 5)
        b = [9] * off + a[:]
        cut = rng.randint(0, n)
        if cut < n:
            b[off + cut] = 7
        assert _first_mismatch(a, b, off, n) == cut


# ------------------------------------------------------------------ basics
def test_empty_match():
    alloc, c = make()
    m = c.match_prefix([1, 2, 3])
    assert isinstance(m, MatchResult) and m.slots == [] and m.length == 0
    c.lock(m.node)  # root: no-op
    c.unlock(m.node)
    c.check_integrity()


def test_insert_and_full_match():
    alloc, c = make()
    s = alloc_for(alloc, 5)
    assert c.insert([1, 2, 3, 4, 5], s) == 0
    c.check_integrity()
    m = c.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.slots == s and m.length == 5 and m.node.key == [1, 2, 3, 4, 5]
    assert c.total_size() == 5 and c.evictable_size() == 5 and c.protected_size() == 0
    conserved(alloc, c)


def test_split_on_partial_match():
    alloc, c = make()
    s = alloc_for(alloc, 6)
    c.insert([1, 2, 3, 4, 5, 6], s)
    m = c.match_prefix([1, 2, 3, 9])
    c.check_integrity()
    assert m.slots == s[:3]
    assert m.node.key == [1, 2, 3] and m.node.value == s[:3]
    # the node ends exactly at the match; its one child holds the rest
    (child,) = m.node.children.values()
    assert child.key == [4, 5, 6] and child.value == s[3:]
    assert c.total_size() == 6
    # matching again does not split further
    m2 = c.match_prefix([1, 2, 3])
    assert m2.node is m.node
    c.check_integrity()


def test_insert_returns_already_present_length():
    alloc, c = make()
    s1 = alloc_for(alloc, 4)
    assert c.insert([1, 2, 3, 4], s1) == 0
    s2 = alloc_for(alloc, 6)
    assert c.insert([1, 2, 3, 4, 5, 6], s2) == 4
    alloc.free_slots(s2[:4])  # duplicates go back
    c.check_integrity()
    conserved(alloc, c)
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).slots == s1 + s2[4:]
    # diverging in the middle of a node
    s3 = alloc_for(alloc, 5)
    assert c.insert([1, 2, 7, 8, 9], s3) == 2
    alloc.free_slots(s3[:2])
    c.check_integrity()
    conserved(alloc, c)
    assert c.match_prefix([1, 2, 7, 8, 9]).slots == s1[:2] + s3[2:]
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).slots == s1 + s2[4:]
    # key fully inside an existing node: nothing new, no split needed
    s4 = alloc_for(alloc, 4)
    assert c.insert([1, 2, 7, 8], s4) == 4
    alloc.free_slots(s4)
    c.check_integrity()
    conserved(alloc, c)
    assert c.stats()["inserted_tokens"] == 4 + 2 + 3


def test_insert_validates_lengths():
    alloc, c = make()
    with pytest.raises(ValueError):
        c.insert([1, 2, 3], [0, 1])
    assert c.insert([], []) == 0
    c.check_integrity()


def test_lock_prevents_eviction():
    alloc, c = make()
    sa = alloc_for(alloc, 3)
    sb = alloc_for(alloc, 3)
    c.insert([1, 2, 3], sa)
    c.insert([4, 5, 6], sb)
    m = c.match_prefix([1, 2, 3])
    c.lock(m.node)
    c.check_integrity()
    assert c.protected_size() == 3 and c.evictable_size() == 3
    assert c.evict(100) == 3
    c.check_integrity()
    assert c.match_prefix([1, 2, 3]).slots == sa
    assert c.match_prefix([4, 5, 6]).length == 0
    assert c.evict(100) == 0
    c.unlock(m.node)
    c.check_integrity()
    assert c.evictable_size() == 3 and c.protected_size() == 0
    assert c.evict(1) == 3
    assert c.total_size() == 0
    c.check_integrity()
    conserved(alloc, c)
    assert alloc.num_free_pages == alloc.num_pages


def test_lock_of_inner_node_protects_ancestors_only():
    alloc, c = make()
    s = alloc_for(alloc, 6)
    c.insert([1, 2, 3, 4, 5, 6], s)
    m = c.match_prefix([1, 2, 3])  # splits: [1,2,3] -> [4,5,6]
    c.lock(m.node)
    c.check_integrity()
    assert c.protected_size() == 3
    assert c.evict(10) == 3  # the unlocked child goes
    assert c.match_prefix([1, 2, 3, 4]).length == 3
    c.unlock(m.node)
    c.check_integrity()


def test_lock_survives_later_split():
    alloc, c = make()
    s = alloc_for(alloc, 6)
    c.insert([1, 2, 3, 4, 5, 6], s)
    m = c.match_prefix([1, 2, 3, 4, 5, 6])
    c.lock(m.node)
    c.match_prefix([1, 2, 9])  # splits the locked node above it
    c.check_integrity()
    assert m.node.key == [3, 4, 5, 6]
    assert c.protected_size() == 6
    c.unlock(m.node)
    c.check_integrity()
    assert c.protected_size() == 0 and c.evictable_size() == 6


def test_unlock_unlocked_raises_and_lock_evicted_raises():
    alloc, c = make()
    c.insert([1, 2], alloc_for(alloc, 2))
    m = c.match_prefix([1, 2])
    with pytest.raises(RuntimeError):
        c.unlock(m.node)
    c.evict(2)
    with pytest.raises(RuntimeError):
        c.lock(m.node)
    c.check_integrity()


def test_lru_order():
    alloc, c = make()
    keys = [[1, 1], [2, 2], [3, 3], [4, 4]]
    slots = {}
    for k in keys:
        slots[k[0]] = alloc_for(alloc, 2)
        c.insert(k, slots[k[0]])
    c.match_prefix([1, 1])  # 1 is now most recent; order of age: 2, 3, 4, 1
    assert c.evict(2) == 2
    assert c.match_prefix([2, 2]).length == 0
    assert c.match_prefix([3, 3]).length == 2  # touches 3: order 4, 1, 3
    c.check_integrity()
    assert c.evict(3) == 4
    assert c.match_prefix([4, 4]).length == 0
    assert c.match_prefix([1, 1]).length == 0
    assert c.match_prefix([3, 3]).length == 2
    c.check_integrity()
    conserved(alloc, c)
    assert c.stats()["evicted_tokens"] == 6


def test_parent_becomes_leaf_after_last_child_evicted():
    alloc, c = make()
    s1 = alloc_for(alloc, 4)
    c.insert([1, 2, 3, 4], s1)
    s2 = alloc_for(alloc, 4)
    assert c.insert([1, 2, 5, 6], s2) == 2
    alloc.free_slots(s2[:2])
    # tree: [1,2] -> {[3,4], [5,6]}
    c.check_integrity()
    assert c.evict(1) == 2  # one child leaf (the older [3,4])
    c.check_integrity()
    assert c.match_prefix([1, 2, 3, 4]).length == 2
    assert c.evict(1) == 2  # the other child ([5,6])
    c.check_integrity()
    # [1,2] is now a leaf candidate and goes next
    assert c.evict(1) == 2
    c.check_integrity()
    assert c.total_size() == 0
    conserved(alloc, c)
    assert alloc.num_free_pages == alloc.num_pages


def test_evict_frees_whole_leaves_until_enough():
    alloc, c = make()
    c.insert([1] * 5, alloc_for(alloc, 5))
    c.insert([2] * 5, alloc_for(alloc, 5))
    c.insert([3] * 5, alloc_for(alloc, 5))
    assert c.evict(6) == 10
    assert c.evict(0) == 0
    c.check_integrity()
    conserved(alloc, c)


def test_page_size_16_alignment():
    P = 16
    alloc, c = make(num_pages=16, page_size=P)
    key = list(range(100, 140))  # 40 tokens = 2 whole pages + 8
    pages = alloc.alloc_pages(3)
    slots = alloc.pages_to_slots(pages)[:40]
    p = c.insert(key, slots)
    assert p == 0 and c.total_size() == 32
    c.check_integrity()
    alloc.free_pages(pages[2:])  # the partial page stays the caller's; it frees it
    conserved(alloc, c)
    # only whole pages match
    assert c.match_prefix(key[:15]).length == 0
    assert c.match_prefix(key[:16]).slots == slots[:16]
    assert c.match_prefix(key[:31]).slots == slots[:16]
    assert c.match_prefix(key).slots == slots[:32]
    c.check_integrity()
    # divergence inside page 2: match stops at the page boundary and splits there
    other = key[:20] + [0] * 12
    m = c.match_prefix(other)
    assert m.length == 16 and m.node.key == key[:16]
    c.check_integrity()
    pages2 = alloc.alloc_pages(2)
    s2 = alloc.pages_to_slots(pages2)
    assert c.insert(other, s2) == 16
    alloc.free_pages(pages2[:1])
    c.check_integrity()
    conserved(alloc, c)
    assert c.match_prefix(other).slots == slots[:16] + s2[16:]
    # children are keyed by the first page's tuple
    sub = c.root.children[None]
    (top,) = sub.children.values()
    assert set(top.children) == {tuple(key[16:32]), tuple(other[16:32])}
    # non-page slots are refused
    with pytest.raises(ValueError):
        c.insert(list(range(16)), list(range(1, 17)))
    assert c.evict(100) == 48
    c.check_integrity()
    assert alloc.num_free_pages == alloc.num_pages


def test_namespaces_isolated():
    alloc, c = make()
    s_none = alloc_for(alloc, 3)
    s_a = alloc_for(alloc, 3)
    c.insert([1, 2, 3], s_none)
    assert c.insert([1, 2, 3], s_a, namespace="a") == 0
    c.check_integrity()
    assert c.match_prefix([1, 2, 3]).slots == s_none
    assert c.match_prefix([1, 2, 3], namespace="a").slots == s_a
    assert c.match_prefix([1, 2, 3], namespace="b").length == 0
    assert c.match_prefix([1, 2, 3], namespace=("lora", 7)).length == 0
    assert set(c.namespaces()) == {None, "a"}
    conserved(alloc, c)
    # evicting every entry of namespace "a" drops its sub-root
    m = c.match_prefix([1, 2, 3])
    c.lock(m.node)
    assert c.evict(100) == 3
    assert c.namespaces() == [None]
    c.check_integrity()
    c.unlock(m.node)
    assert c.total_size() == 3
    conserved(alloc, c)


def test_disable_mode():
    alloc, c = make(disable=True)
    s = alloc_for(alloc, 4)
    assert c.insert([1, 2, 3, 4], s) == 0
    assert c.total_size() == 0 and c.all_slots() == []
    m = c.match_prefix([1, 2, 3, 4])
    assert m.length == 0
    c.lock(m.node)
    c.unlock(m.node)
    assert c.evict(10) == 0
    c.check_integrity()
    alloc.free_slots(s)  # the caller still owns everything
    assert alloc.num_free_pages == alloc.num_pages
    st = c.stats()
    assert st["queried_tokens"] == 4 and st["hit_tokens"] == 0 and st["inserted_tokens"] == 0


def test_stats_and_reset():
    alloc, c = make()
    s = alloc_for(alloc, 4)
    c.insert([1, 2, 3, 4], s)
    c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    c.insert([9, 9], alloc_for(alloc, 2), namespace="x")
    st = c.stats()
    assert st == {
        "queried_tokens": 8,
        "hit_tokens": 4,
        "inserted_tokens": 6,
        "evicted_tokens": 0,
        "hit_rate": 0.5,
        "cached_tokens": 6,
        "device_hit_tokens": 4,
        "host_hit_tokens": 0,
        "storage_hit_tokens": 0,
        "device_hit_rate": 0.5,
        "host_hit_rate": 0.0,
        "storage_hit_rate": 0.0,
    }
    m = c.match_prefix([1, 2])
    c.lock(m.node)
    with pytest.raises(RuntimeError):
        c.reset()
    c.unlock(m.node)
    c.reset()
    c.check_integrity()
    assert c.total_size() == 0 and c.all_slots() == []
    assert alloc.num_free_pages == alloc.num_pages
    assert c.match_prefix([1, 2, 3, 4]).length == 0
    with pytest.raises(RuntimeError):
        c.lock(m.node)  # stale node from before the reset
    c.reset_stats()
    assert c.stats()["queried_tokens"] == 0
    c.insert([5, 6], alloc_for(alloc, 2))
    assert c.match_prefix([5, 6, 7], record_stats=False).length == 2
    assert c.stats()["queried_tokens"] == 0 and c.stats()["hit_tokens"] == 0


def test_allocator_none():
    c = RadixCache(None)
    c.insert([1, 2, 3], [10, 11, 12])
    assert c.match_prefix([1, 2]).slots == [10, 11]
    assert c.evict(5) == 3
    c.check_integrity()


def test_long_keys_are_fast():
    # O(length) match/insert with slice compares: 200 x 20k-token keys stay well under a second
    alloc, c = make(num_pages=50_000)
    base = list(range(20_000))
    s = alloc_for(alloc, 20_000)
    c.insert(base, s)
    for i in range(200):
        k = base[: 10_000 + i] + [-1]
        assert c.match_prefix(k).length == 10_000 + i
    c.check_integrity()


# ------------------------------------------------------- randomized model test
def _tree_entries(cache):
    """{(namespace, prefix tuple of a page-multiple length): slots of its last page}."""
    P = cache.page_size
    out = {}
    for ns, sub in cache.root.children.items():
        stack = [(child, ()) for child in sub.children.values()]
        while stack:
            node, prefix = stack.pop()
            for i in range(0, len(node.key), P):
                prefix = prefix + tuple(node.key[i : i + P])
                out[(ns, prefix)] = tuple(node.value[i : i + P])
            stack.extend((child, prefix) for child in node.children.values())
    return out


def _ref_match(ref, ns, key, P):
    n = len(key) - len(key) % P
    slots = []
    for end in range(P, n + 1, P):
        v = ref.get((ns, tuple(key[:end])))
        if v is None:
            break
        slots.extend(v)
    return slots


def _run_random(seed, page_size, num_ops, num_pages, vocab=3):
    rng = random.Random(seed)
    P = page_size
    alloc = PageAllocator(num_pages, P)
    cache = RadixCache(alloc, page_size=P)
    ref = {}  # (ns, prefix tuple) -> slots of the last page: the reference model
    running = []  # requests: dict(key, ns, node, matched, slots, pages)
    pins = []  # (node, ns, prefix): plain lock/unlock with no private memory
    namespaces = [None, None, "salt"]
    bases = [[rng.randrange(vocab) for _ in range(40)] for _ in range(4)]
    counts = dict(match=0, start=0, finish=0, abort=0, evict=0, pin=0, unpin=0, reset=0, evict_hit=0)

    def rand_key():
        if rng.random() < 0.7:
            b = rng.choice(bases)
            k = b[: rng.randint(0, len(b))]
        else:
            k = []
        return k + [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]

    def locked_entries():
        out = set()
        for ns, key, length in [(r["ns"], r["key"], r["matched"]) for r in running] + [
            (ns, key, length) for _, ns, key, length in pins
        ]:
            for end in range(P, length + 1, P):
                out.add((ns, tuple(key[:end])))
        return out

    def check():
        cache.check_integrity()
        assert _tree_entries(cache) == ref
        private = [s for r in running for s in alloc.pages_to_slots(r["pages"])]
        tree = cache.all_slots()
        assert len(tree) == len(ref) * P == cache.total_size()
        assert not set(tree) & set(private)
        assert alloc.num_free_slots + len(tree) + len(private) == alloc.total_slots
        prot = len(locked_entries()) * P
        assert cache.protected_size() == prot
        assert cache.evictable_size() == cache.total_size() - prot

    def do_evict(n):
        before = dict(ref)
        locked = locked_entries()
        evictable_before = cache.evictable_size()
        # brute-force LRU reference: repeatedly the unlocked childless node with the
        # smallest (last_access, id), found by scanning a snapshot of the tree
        nodes = list(cache._nodes())
        info = {
            nd.id: [len(nd.children), nd.last_access, nd.lock_ref, len(nd.key), nd.parent.id if nd.parent.key else None]
            for nd in nodes
        }
        expected, freed_sim = set(), 0
        while freed_sim < n:
            cands = [(v[1], k) for k, v in info.items() if k not in expected and v[0] == 0 and v[2] == 0]
            if not cands:
                break
            _, k = min(cands)
            expected.add(k)
            freed_sim += info[k][3]
            if info[k][4] is not None:
                info[info[k][4]][0] -= 1
        freed = cache.evict(n)
        assert freed == freed_sim
        assert {nd.id for nd in nodes if nd.parent is None} == expected
        after = _tree_entries(cache)
        assert all(before.get(k) == v for k, v in after.items())  # only removals
        removed = set(before) - set(after)
        assert freed == len(removed) * P
        assert not removed & locked
        assert freed >= min(n, evictable_before)
        if freed < n:
            assert cache.evictable_size() == 0
        ref.clear()
        ref.update(after)
        counts["evict"] += 1
        counts["evict_hit"] += bool(freed)

    for _ in range(num_ops):
        op = rng.random()
        if op < 0.22:  # plain match, compared with the model
            key, ns = rand_key(), rng.choice(namespaces)
            m = cache.match_prefix(key, ns)
            assert m.slots == _ref_match(ref, ns, key, P)
            assert m.length == len(m.slots) and m.length % P == 0
            assert m.node.key == [] or key[m.length - len(m.node.key) : m.length] == m.node.key
            counts["match"] += 1
        elif op < 0.45:  # start a request: match, lock, allocate private pages
            key, ns = rand_key(), rng.choice(namespaces)
            m = cache.match_prefix(key, ns)
            assert m.slots == _ref_match(ref, ns, key, P)
            cache.lock(m.node)
            need = -(-(len(key) - m.length) // P)
            pages = alloc.alloc_pages(need)
            if pages is None:
                do_evict((need - alloc.num_free_pages) * P)
                pages = alloc.alloc_pages(need)
            if pages is None:
                cache.unlock(m.node)
            else:
                slots = m.slots + alloc.pages_to_slots(pages)[: len(key) - m.length]
                running.append(dict(key=key, ns=ns, node=m.node, matched=m.length, slots=slots, pages=pages))
                counts["start"] += 1
        elif op < 0.62 and running:  # finish: insert, free duplicates and the tail, unlock
            r = running.pop(rng.randrange(len(running)))
            key, ns, slots, matched = r["key"], r["ns"], r["slots"], r["matched"]
            n = len(key) - len(key) % P
            present = len(_ref_match(ref, ns, key, P))
            # the locked prefix is still there, with the same slots
            assert present >= matched and _ref_match(ref, ns, key[:matched], P) == slots[:matched]
            p = cache.insert(key, slots, ns)
            assert p == present
            for end in range(p + P, n + 1, P):
                ref[(ns, tuple(key[:end]))] = tuple(slots[end - P : end])
            to_free = [pg for j, pg in enumerate(r["pages"]) if not (p <= matched + j * P < n)]
            alloc.free_pages(to_free)
            cache.unlock(r["node"])
            counts["finish"] += 1
        elif op < 0.66 and running:  # abort: free everything private, unlock
            r = running.pop(rng.randrange(len(running)))
            alloc.free_pages(r["pages"])
            cache.unlock(r["node"])
            counts["abort"] += 1
        elif op < 0.72:
            do_evict(rng.randint(1, num_pages * P // 6))
        elif op < 0.84:  # pin a cached prefix
            key, ns = rand_key(), rng.choice(namespaces)
            m = cache.match_prefix(key, ns)
            cache.lock(m.node)
            pins.append((m.node, ns, key, m.length))
            counts["pin"] += 1
        elif op < 0.999 and pins:
            node, *_ = pins.pop(rng.randrange(len(pins)))
            cache.unlock(node)
            counts["unpin"] += 1
        elif not running and not pins:
            cache.reset()
            ref.clear()
            counts["reset"] += 1
        check()
    # drain: everything goes back
    for r in running:
        alloc.free_pages(r["pages"])
        cache.unlock(r["node"])
    for node, *_ in pins:
        cache.unlock(node)
    running.clear()
    pins.clear()
    check()
    assert cache.protected_size() == 0
    do_evict(cache.total_size())
    check()
    assert cache.total_size() == 0 and alloc.num_free_pages == num_pages
    st = cache.stats()
    assert st["inserted_tokens"] - st["evicted_tokens"] >= 0
    return counts, st


@pytest.mark.parametrize("page_size,num_pages,vocab", [(1, 192, 3), (4, 48, 3), (1, 128, 2), (2, 64, 2)])
def test_randomized_against_model(page_size, num_pages, vocab):
    counts, st = _run_random(
        seed=1234 + page_size + vocab, page_size=page_size, num_ops=10_000, num_pages=num_pages, vocab=vocab
    )
    # the run exercised every operation, including memory pressure
    for k in ("match", "start", "finish", "abort", "evict", "pin", "unpin"):
        assert counts[k] > 100, counts
    assert counts["evict_hit"] > 100, counts
    assert st["hit_tokens"] > 0 and st["evicted_tokens"] > 0


# ------------------------------------------- the three caches behind PrefixCache
def _kv_manager(cache, alloc):
    from radixrt.memory.kv_manager import KVCacheManager
    from radixrt.memory.req_to_token import ReqToTokenPool

    return KVCacheManager(alloc, cache, ReqToTokenPool(4, 64))


def _serve(kv, tokens):
    """One request's life through the KV manager: match, admit, extend, release."""
    from radixrt.sampling.params import SamplingParams
    from radixrt.scheduler.request import Req

    req = Req(rid="r", input_ids=list(tokens), sampling=SamplingParams(max_new_tokens=4), seed=0)
    m = kv.match(req, load=True)
    kv.admit(req, m)
    assert kv.extend(req, req.seq_len - m.length)
    kv.record_admission(req, m.length, m.loaded)
    kv.check_invariant([req])
    kv.release(req)
    kv.check_invariant([])
    return m.length


@pytest.mark.parametrize("kind", ["radix", "none"])
def test_kv_manager_talks_to_any_prefix_cache(kind):
    from radixrt.memory.prefix_cache import PrefixCache

    alloc = PageAllocator(32, 2)
    cache = RadixCache(alloc, page_size=2) if kind == "radix" else NoPrefixCache(2)
    assert isinstance(cache, PrefixCache) and cache.stores_prefixes == (kind == "radix")
    kv = _kv_manager(cache, alloc)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    assert _serve(kv, prompt) == 0
    hit = _serve(kv, prompt)
    # the tree serves the whole pages of the prompt but its last token; the no-cache keeps nothing
    assert hit == (6 if kind == "radix" else 0)
    assert cache.total_size() == (6 if kind == "radix" else 0)
    assert alloc.num_free_slots + cache.total_size() == alloc.total_slots
    assert kv.take_transfers().before == [] and kv.host_usage() is None
    st = cache.stats()  # counted once per request, by the tree's own record_match
    assert st["queried_tokens"] == 14 and st["hit_tokens"] == hit and st["host_hit_tokens"] == 0
    cache.check_integrity()


def test_no_prefix_cache_refuses_foreign_nodes():
    _, tree = make()
    cache = NoPrefixCache(1)
    tree.insert([1, 2], [0, 1])
    with pytest.raises(RuntimeError):
        cache.lock(tree.match_prefix([1, 2]).node)
    with pytest.raises(ValueError):
        cache.insert([1, 2], [0])


def test_integrity_module_does_not_import_the_trees_at_run_time():
    import ast
    import pathlib

    import radixrt.memory.radix_integrity as mod

    tree = ast.parse(pathlib.Path(mod.__file__).read_text())
    runtime = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {n.module for n in runtime if isinstance(n, ast.ImportFrom)}
    assert not names & {"radixrt.memory.radix_cache", "radixrt.memory.host_radix_cache"}, names
