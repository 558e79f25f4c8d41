"""The draft index of speculative decoding (radixrt/memory/draft_index.py):
counts of (context -> next token) mirroring exactly what a real radix tree
holds, per namespace, through random inserts, splits, evictions (to the host
tier and out of it) and resets; prompt-lookup drafts from the request's own
tokens; the shape, bounds and per-call cost of proposals."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixrt.memory.draft_index import TREE_LENGTHS, Draft, DraftIndex, OwnTokens
from radixrt.memory.draft_keys import tail_keys, window_keys
from radixrt.memory.draft_search import search
from radixrt.memory.host_radix_cache import HostRadixCache
from radixrt.memory.kv_pool import PageAllocator
from radixrt.memory.kv_transfer import HostTier, KVTransferQueue
from radixrt.memory.no_prefix_cache import NoPrefixCache
from radixrt.memory.radix_cache import RadixCache

NAMESPACES = (None, "tenant-a", ("adapter", "salt"))


def _alphabet(ns_index: int) -> list[int]:
    """Each namespace writes its own tokens, so a leak between namespaces shows."""
    return [1000 * (ns_index + 1) + t for t in range(4)]


def _next_tokens(index: DraftIndex, namespace) -> set[int]:
    out: set[int] = set()
    table = index._tables.get(namespace)
    for v in table.counts.values() if table else ():
        out.update(v.keys() if isinstance(v, dict) else [v >> 32])
    return out


def _counted(index: DraftIndex, namespace) -> Counter:
    """The index's counts as {(context key, next token): count}."""
    out: Counter = Counter()
    table = index._tables.get(namespace)
    for key, v in table.counts.items() if table else ():
        for tok, c in v.items() if isinstance(v, dict) else [(v >> 32, v & 0xFFFFFFFF)]:
            out[key, tok] = c
    return out


def _brute_force(tree: RadixCache, namespace, lengths=TREE_LENGTHS) -> Counter:
    """Every (window, next token) of every root-to-node path of the namespace,
    counted from scratch with whole paths (independent of the index's code)."""
    out: Counter = Counter()
    sub = tree.root.children.get(namespace)
    stack = [(c, []) for c in sub.children.values()] if sub else []
    while stack:
        node, above = stack.pop()
        path = above + node.key
        for q in range(len(above), len(path)):
            for L in lengths:
                if q >= L:
                    out[hash(tuple(path[q - L : q])), path[q]] += 1
        stack.extend((c, path) for c in node.children.values())
    return out


class Rig:
    """A tree (device only, or over a host tier) with the index attached, fed
    as the KV manager feeds it: match, lock, private slots, insert, unlock."""

    def __init__(self, page_size: int, host: bool, device_tokens: int = 96) -> None:
        self.P = page_size
        self.alloc = PageAllocator(device_tokens // page_size, page_size)
        if host:
            tier = HostTier(PageAllocator(64 // page_size, page_size), KVTransferQueue(), "write_back")
            self.tree: RadixCache = HostRadixCache(self.alloc, page_size, tier)
        else:
            self.tree = RadixCache(self.alloc, page_size)
        self.index = DraftIndex()
        self.tree.add_observer(self.index)

    def request(self, key: list[int], namespace) -> None:
        tree, P = self.tree, self.P
        m = tree.match_prefix(key, namespace, load_back=True)
        tree.lock(m.node)
        need = len(key) - m.length
        pages = -(-need // P)
        if self.alloc.num_free_pages < pages:
            tree.evict((pages - self.alloc.num_free_pages) * P)
        got = self.alloc.alloc_pages(pages) if pages else []
        if got is None:  # too little room: the request gives up, as a retraction would
            tree.unlock(m.node)
            return
        slots = m.slots + self.alloc.pages_to_slots(got)[:need]
        present = tree.insert(key, slots, namespace)
        n = len(key) // P * P
        mine = slots[m.length : present] + slots[n:]
        if mine:
            self.alloc.free_pages(sorted({s // P for s in mine}))
        tree.unlock(m.node)
        tree.take_transfers()

    def check(self) -> None:
        self.tree.check_integrity()
        self.index.check_integrity(self.tree)
        assert self.alloc.num_free_slots + len(self.tree.all_slots()) == self.alloc.total_slots
        stats = self.index.stats()
        held = sum(len(k) for _, _, k in _runs(self.tree))
        assert stats["tokens_indexed"] == held
        assert stats["entries"] <= held * len(TREE_LENGTHS)
        for i, ns in enumerate(NAMESPACES):
            assert _next_tokens(self.index, ns) <= set(_alphabet(i))
            assert _counted(self.index, ns) == _brute_force(self.tree, ns)


def _runs(tree):
    from radixrt.memory.radix_observer import tree_runs

    return tree_runs(tree.root, 8)


_op = st.one_of(
    st.tuples(
        st.just("request"),
        st.integers(0, len(NAMESPACES) - 1),
        st.lists(st.integers(0, 3), min_size=1, max_size=40),
        st.integers(0, 10_000),  # which earlier request to continue, and where to cut it
    ),
    st.tuples(
        st.just("match"), st.integers(0, len(NAMESPACES) - 1), st.lists(st.integers(0, 3), max_size=30), st.just(0)
    ),
    st.tuples(st.just("evict"), st.integers(1, 60), st.just([]), st.just(0)),
    st.tuples(st.just("reset"), st.just(0), st.just([]), st.just(0)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 2]),
    host=st.booleans(),
    ops=st.lists(_op, min_size=1, max_size=60),
)
def test_index_mirrors_the_tree(page_size: int, host: bool, ops) -> None:
    rig = Rig(page_size, host)
    sent: list[list[int]] = []
    for kind, a, seq, reuse in ops:
        if kind == "request":
            key = [_alphabet(a)[t] for t in seq]
            earlier = [k for k in sent if k[0] in _alphabet(a)]
            if earlier and reuse % 3:  # a later turn or a fork: an earlier prompt's prefix, then new text
                old = earlier[reuse % len(earlier)]
                key = old[: reuse % (len(old) + 1)] + key
            sent.append(key)
            rig.request(key, NAMESPACES[a])
        elif kind == "match":
            rig.tree.match_prefix([_alphabet(a)[t] for t in seq], NAMESPACES[a])
        elif kind == "evict":
            rig.tree.evict(a)
        else:
            rig.tree.reset()
            assert rig.index.stats()["entries"] == 0
        rig.check()


def test_long_random_run_with_host_tier_and_large_runs() -> None:
    """Long keys take the numpy path of the index; host drops remove whole subtrees."""
    rng = random.Random(7)
    rig = Rig(1, host=True, device_tokens=400)
    sent: list[list[list[int]]] = [[] for _ in NAMESPACES]
    for step in range(300):
        i = rng.randrange(len(NAMESPACES))
        alpha = _alphabet(i)
        key = [alpha[rng.randrange(4)] for _ in range(rng.randint(1, 120))]
        if sent[i] and rng.random() < 0.6:
            old = rng.choice(sent[i])
            key = old[: rng.randint(0, len(old))] + key
        sent[i].append(key)
        rig.request(key, NAMESPACES[i])
        if step % 7 == 0:
            rig.tree.evict(rng.randint(1, 200))
        if step % 10 == 0:
            rig.check()
    rig.check()
    rig.tree.evict(10**6)
    rig.tree._evict_host(10**6)
    rig.check()
    assert rig.index.stats()["entries"] == 0


def test_keys_agree_between_numpy_and_python() -> None:
    rng = random.Random(0)
    for _ in range(100):
        seq = [rng.randrange(200_000) for _ in range(rng.randint(0, 60))]
        start = rng.randint(0, len(seq))
        for L, i0, keys in window_keys(seq, start, TREE_LENGTHS):
            for k, key in enumerate(keys.tolist()):
                i = i0 + k
                assert i >= max(start, L)
                assert key == tail_keys(seq[:i], TREE_LENGTHS)[TREE_LENGTHS.index(L)] == hash(tuple(seq[i - L : i]))


def test_attach_replays_the_tree_and_no_prefix_cache_tells_nothing() -> None:
    tree = RadixCache(None)
    tree.insert(list(range(50)), list(range(50)), "x")
    tree.match_prefix(list(range(20)) + [99], "x")  # a split
    index = DraftIndex()
    tree.add_observer(index)
    index.check_integrity(tree)
    assert index.stats()["tokens_indexed"] == 50
    empty = DraftIndex()
    NoPrefixCache().add_observer(empty)
    assert empty.stats()["entries"] == 0


def test_namespaces_never_share_drafts() -> None:
    tree = RadixCache(None)
    index = DraftIndex()
    tree.add_observer(index)
    secret = list(range(500, 600))
    tree.insert(secret, list(range(100)), "tenant-a")
    own = OwnTokens([1, 2, 3] + secret[:30])  # tenant b happens to type a's text
    assert index.propose("tenant-a", own, 8).tokens == secret[30:38]
    assert index.propose("tenant-b", own, 8).tokens == []
    assert index.propose(None, own, 8).tokens == []


def test_own_tokens_copy_from_the_prompt() -> None:
    index = DraftIndex()  # an empty tree: the request's own tokens only
    body = list(range(300, 340))
    prompt = [7, 8] + body + [9, 10, 11]
    own = OwnTokens(prompt)
    own.extend(body[:6])  # the output starts echoing the prompt
    draft = index.propose(None, own, 16)
    assert draft.tokens == body[6 : 6 + len(draft)] and len(draft) >= 3
    assert draft.parents == list(range(-1, len(draft) - 1))
    assert all(a >= b >= 0.2 for a, b in zip(draft.probs, draft.probs[1:]))
    short = index.propose(None, own, 3)
    assert short.tokens == body[6:9]
    # the copy keeps up as the output follows it, and longer matches draft more
    own.extend(body[6:20])
    longer = index.propose(None, own, 64)
    assert longer.tokens == body[20 : 20 + len(longer)] and len(longer) > len(draft)
    # a token that breaks the copy: nothing to copy after an unseen pair
    own.extend([12345, 12346])
    assert index.propose(None, own, 16).tokens == []


def test_own_tokens_pick_a_broken_copy_up_again() -> None:
    index = DraftIndex()
    body = list(range(300, 340))
    prompt = [7, 8] + body + [9, 10]
    for edit, resumed in (([body[12]], body[13:15]), ([999], body[11:13])):  # two tokens dropped; one replaced
        own = OwnTokens(prompt)
        own.extend(body[:10])
        assert index.propose(None, own, 2).tokens == body[10:12]  # copying
        own.extend(edit)  # the output leaves the source there
        assert index.propose(None, own, 2, min_prob=0.05).tokens == resumed
        assert index.propose(None, own, 2).tokens == resumed[:1]  # as a one-token match: little confidence
    own.extend([998])  # a second token of its own: the copy is lost (until two tokens match again)
    assert index.propose(None, own, 2, min_prob=0.05).tokens == []


def test_own_tokens_incremental_equals_fresh() -> None:
    rng = random.Random(3)
    seq = [rng.randrange(6) for _ in range(400)]
    inc = OwnTokens(seq[:5])
    pos = 5
    while pos < len(seq):
        step = rng.choice([1, 1, 2, 40])
        inc.extend(seq[pos : pos + step])
        pos += step
        if rng.random() < 0.3:
            inc.match()
    fresh = OwnTokens(seq)
    assert inc._latest == fresh._latest
    assert inc.match() == fresh.match()
    inc.truncate(100)
    assert inc._latest == OwnTokens(seq[:100])._latest and len(inc) == 100


def test_draft_tree_branches_where_runs_diverge() -> None:
    tree = RadixCache(None)
    index = DraftIndex()
    tree.add_observer(index)
    stem = list(range(100, 120))
    for _ in range(3):  # seen 3 times one way ...
        tree.insert([1] + stem + [200, 201, 202, 203], [0] * 25, "ns")
        tree.evict(0)
    tree.insert([2] + stem + [200, 201, 202, 203], [0] * 25, "ns")
    tree.insert([3] + stem + [300, 301, 302, 303], [0] * 25, "ns")  # ... and the other way
    own = OwnTokens([9] + stem)
    chain = index.propose("ns", own, 8)
    assert chain.tokens[:2] == [200, 201] and chain.parents == list(range(-1, len(chain) - 1))
    wide = index.propose("ns", own, 8, max_width=2, min_prob=0.05)
    assert {200, 300} <= {t for t, p in zip(wide.tokens, wide.parents) if p == -1}
    assert wide.chain()[:2] == [200, 201]
    for i, p in enumerate(wide.parents):
        assert -1 <= p < i
        assert sum(1 for q in wide.parents if q == p) <= 2
    assert len(wide) <= 8 and min(wide.probs) >= 0.05
    assert Draft([5, 6, 7], [-1, -1, 0]).chain() == [5, 7]
    # a depth cap bounds every path, not the tree's size: both branches go three deep
    deep = index.propose("ns", own, 8, max_width=2, min_prob=0.01, max_depth=3)
    depth = []
    for p in deep.parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    assert max(depth) == 3 and len(deep) > 3
    assert deep.chain() == [200, 201, 202]
    assert index.propose("ns", own, 8, min_prob=0.01, max_depth=3).tokens == [200, 201, 202]


def test_the_chain_fast_path_is_the_width_one_search() -> None:
    rng = random.Random(5)
    drafted = 0
    for trial in range(60):
        tree = RadixCache(None)
        index = DraftIndex()
        tree.add_observer(index)
        motifs = [[rng.randrange(6) for _ in range(rng.randint(3, 12))] for _ in range(4)]
        for _ in range(rng.randint(0, 30)):
            key = [t for _ in range(rng.randint(1, 8)) for t in rng.choice(motifs)]
            tree.insert(key, [0] * len(key), "ns")
        own_seq = [t for _ in range(rng.randint(1, 6)) for t in rng.choice(motifs)] + [rng.randrange(6)]
        for min_prob in (0.0, 0.05, 0.2, 0.5):
            fast = index.propose("ns", OwnTokens(own_seq), 12, 1, min_prob)
            table = index._tables.get("ns")
            slow = search(index.lengths, table.counts if table else None, OwnTokens(own_seq), 12, 1, min_prob)
            assert fast == slow, (trial, min_prob)
            drafted += len(fast)
    assert drafted > 500  # the cases draft something


def _tree_of(tokens: int, seed: int) -> tuple[RadixCache, DraftIndex]:
    rng = random.Random(seed)
    tree = RadixCache(None)
    index = DraftIndex()
    tree.add_observer(index)
    done = 0
    while done < tokens:
        key = [rng.randrange(5000) for _ in range(500)]
        tree.insert(key, [0] * len(key), "ns")
        done += len(key)
    return tree, index


def _propose_time(index: DraftIndex, own: OwnTokens, rounds: int = 300) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(rounds):
            d = index.propose("ns", own, 8)
        best = min(best, time.perf_counter() - t0)
        assert len(d) == 8
    return best


def test_proposal_cost_does_not_grow_with_the_tree() -> None:
    small_tree, small = _tree_of(1_000, 1)
    big_tree, big = _tree_of(100_000, 1)  # same first runs: the same drafts
    key = next(iter(small_tree.root.children["ns"].children.values())).key
    own = OwnTokens([1] + key[:40])
    assert small.propose("ns", own, 8).tokens == big.propose("ns", own, 8).tokens == key[40:48]
    t_small, t_big = _propose_time(small, own), _propose_time(big, own)
    assert t_big < 3 * t_small, (t_small, t_big)
    assert big.stats()["entries"] <= 100_000 * len(TREE_LENGTHS)


@pytest.mark.parametrize("bad", [(), (0, 2), (2, 40)])
def test_bad_context_lengths(bad) -> None:
    with pytest.raises(ValueError, match="context lengths"):
        DraftIndex(bad)


def test_host_tier_drop_after_dropping_its_own_host_child() -> None:
    """A device node too big for the host: backing it up first drops its own
    host-only child (to make room), then fails, and the node leaves the tree;
    the tree's leaf set and the index both forget the two nodes."""
    alloc = PageAllocator(32, 1)
    tree = HostRadixCache(alloc, 1, HostTier(PageAllocator(6, 1), KVTransferQueue(), "write_back"))
    index = DraftIndex()
    tree.add_observer(index)
    x, c = list(range(10, 18)), list(range(20, 24))
    slots = alloc.alloc_slots_for(12)
    assert tree.insert(x, slots[:8], "ns") == 0
    assert tree.insert(x + c, slots, "ns") == 8  # two nodes: x, then its child c
    assert tree.evict(4) == 4  # c, the leaf, moves to the host
    assert tree.host_size() == 4 and index.stats()["tokens_indexed"] == 12
    assert tree.evict(8) == 8  # x does not fit in the host's 6 tokens: dropped with c
    tree.check_integrity()
    index.check_integrity(tree)
    assert tree.total_size() == tree.host_size() == 0 and index.stats()["entries"] == 0
    assert alloc.num_free_slots == 32
