"""The router's approximate radix tree, routing keys and policies (no model, no server)."""

from __future__ import annotations

import random

import pytest

from radixrt.router.approx_tree import ApproxTree
from radixrt.router.key_marker import marker_len, namespace_marker
from radixrt.router.keys import routing_key
from radixrt.router.policies import CacheAware, CacheAwareConfig, RoundRobin, ShortestQueue, make_policy
from radixrt.router.workers import HealthConfig, WorkerPool


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


# ---------------------------------------------------------------- approximate tree
def test_tree_match_is_per_tenant_longest_prefix():
    tree = ApproxTree()
    tree.insert("system A: you are a pirate. user: hi", "w1")
    tree.insert("system A: you are a pirate. user: bye", "w2")
    tree.insert("system B: you are a cat", "w2")
    tree.check()
    m = tree.match("system A: you are a pirate. user: hi there")
    assert m == {"w1": len("system A: you are a pirate. user: hi"), "w2": len("system A: you are a pirate. user: ")}
    assert tree.match("system B: you are a dog") == {"w2": len("system B: you are a "), "w1": len("system ")}
    assert tree.match("nothing shared") == {}
    assert tree.size("w1") == len("system A: you are a pirate. user: hi")
    assert tree.size("w2") == len("system A: you are a pirate. user: bye") + len("B: you are a cat")


def test_tree_token_ids_and_partial_edges():
    tree = ApproxTree()
    tree.insert((1, 2, 3, 4, 5), "a")
    tree.insert((1, 2, 9), "b")
    tree.check()
    assert tree.match((1, 2, 3, 7)) == {"a": 3, "b": 2}
    assert tree.match((1,)) == {"a": 1, "b": 1}
    tree.insert((1, 2, 3, 4, 5), "a")  # again: nothing grows
    assert tree.size("a") == 5 and tree.size("b") == 3


def test_tree_evicts_least_recently_used_leaves_of_one_tenant():
    tree = ApproxTree(clock=Clock())
    tree.insert("shared prefix / old leaf", "w")
    tree.insert("shared prefix / new leaf", "w")
    tree.insert("shared prefix / old leaf", "other")
    tree.match("shared prefix / new leaf")  # touched last
    before = tree.size("w")
    dropped = tree.evict_tenant("w", before - 1)
    tree.check()
    assert dropped == len("old leaf") and tree.size("w") == before - dropped
    assert tree.match("shared prefix / old leaf") == {
        "other": len("shared prefix / old leaf"),
        "w": len("shared prefix / "),
    }
    assert tree.match("shared prefix / new leaf")["w"] == len("shared prefix / new leaf")
    assert tree.size("other") == len("shared prefix / old leaf")  # other tenants untouched
    tree.evict_tenant("w", 0)
    tree.check()
    assert tree.size("w") == 0 and "w" not in tree.match("shared prefix / new leaf")


def test_tree_random_operations_keep_invariants():
    rng = random.Random(0)
    tree = ApproxTree(clock=Clock())
    keys = [tuple(rng.randrange(4) for _ in range(rng.randrange(1, 12))) for _ in range(200)]
    for i, k in enumerate(keys):
        tenant = f"w{rng.randrange(3)}"
        tree.insert(k, tenant)
        assert tree.match(k)[tenant] == len(k)
        if i % 25 == 24:
            for t in list(tree.sizes()):
                tree.evict_tenant(t, 20)
                assert tree.size(t) <= 20
        if i % 70 == 69:
            tree.remove_tenant("w1")
            assert tree.size("w1") == 0
        tree.check()


# ---------------------------------------------------------------- routing keys
def test_routing_keys():
    shared = namespace_marker(None)
    assert routing_key("/generate", {"text": "abc"}) == shared + "abc"
    assert routing_key("/generate", {"text": ["first", "second"]}) == shared + "first"
    assert routing_key("/generate", {"input_ids": [5, 6, 7]}) == (shared, 5, 6, 7)
    assert routing_key("/generate", {"input_ids": [[5, 6], [7]]}) == (shared, 5, 6)
    assert routing_key("/v1/completions", {"prompt": "p"}) == shared + "p"
    assert routing_key("/v1/completions", {"prompt": [[1, 2]]}) == (shared, 1, 2)
    chat = routing_key(
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ]
        },
    )
    assert isinstance(chat, str) and chat.startswith(shared + "<system>be brief\n") and chat.endswith("<user>hi\n")
    for body in (
        None,
        [],
        {"text": 3},
        {"input_ids": ["x"]},
        {"messages": "no"},
        {"prompt": []},
        {"text": "a", "cache_salt": 1},
    ):
        assert routing_key("/generate", body) is None
        assert routing_key("/v1/chat/completions", body) is None


def test_routing_keys_carry_the_namespace_the_worker_caches_under():
    a = routing_key("/generate", {"text": "secret memo", "cache_salt": "tenant-a"})
    b = routing_key("/generate", {"text": "secret memo", "cache_salt": "tenant-b"})
    assert a != b and a == routing_key("/generate", {"text": "secret memo", "cache_salt": "tenant-a"})
    assert a.endswith("secret memo") and "tenant-a" not in a and marker_len(a) == len(a) - len("secret memo")
    ids = routing_key("/v1/completions", {"prompt": [1, 2], "prompt_cache_key": "k"})
    assert ids == (namespace_marker('[null, "k"]'), 1, 2) and marker_len(ids) == 1
    chat = routing_key("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "cache_salt": "s"})
    assert chat.startswith(namespace_marker('["s", null]'))
    keyed = routing_key("/generate", {"text": "secret memo", "extra_key": "tenant-a"})
    assert keyed.startswith(namespace_marker('[null, null, "tenant-a"]')) and keyed not in (a, b)
    assert routing_key("/generate", {"text": "secret memo", "cache_salt": ["a", "b"]}) is None  # one per prompt


def test_cache_aware_never_matches_one_namespace_against_another():
    """Tenant B guessing tenant A's prompt, under its own salt, is routed exactly as for a
    prompt nobody sent: its routing (the x-radixrt-worker header, the decision counters)
    cannot tell whether A sent it. The same guess without a salt neither."""
    p = CacheAware(CacheAwareConfig(cache_threshold=0.3))
    loads = dict.fromkeys(W, 0)
    secret = "Internal memo: merger with Acme Corp closes on March 3rd at $41 per share."
    owner = p.select(W, loads, routing_key("/generate", {"text": secret, "cache_salt": "tenant-a"}))
    guesses = [{"text": secret[:40], "cache_salt": "tenant-b"}, {"text": secret}, {"input_ids": [1, 2, 3]}]
    for body in guesses:
        before = dict(p.counts)
        assert p._match(routing_key("/generate", body))[0] == {}
        p.select(W, loads, routing_key("/generate", body))
        assert p.counts["prefix"] == before["prefix"]
    same = p.select(W, loads, routing_key("/generate", {"text": secret[:40] + " more", "cache_salt": "tenant-a"}))
    assert same == owner and p.counts["prefix"] == 1


# ---------------------------------------------------------------- policies
W = ["http://a", "http://b", "http://c"]


def test_round_robin_alternates():
    p = RoundRobin()
    assert [p.select(W, {}, "same prompt") for _ in range(6)] == W + W


def test_shortest_queue_picks_least_loaded_then_least_recent():
    p = ShortestQueue()
    assert p.select(W, {"http://a": 3, "http://b": 1, "http://c": 2}, None) == "http://b"
    loads = dict.fromkeys(W, 0)
    picks = [p.select(W, loads, None) for _ in range(3)]
    assert sorted(picks) == sorted(W)  # ties go round


def test_cache_aware_sticks_to_the_prefix_holder_and_spreads_new_prefixes():
    p = CacheAware(CacheAwareConfig(cache_threshold=0.5))
    loads = dict.fromkeys(W, 0)
    tenants = [f"system prompt number {i}: " + "x" * 40 for i in range(6)]
    first = {t: p.select(W, loads, t + "question 0") for t in tenants}
    assert sorted(first.values()) == sorted(W + W)  # new prefixes go to the smallest tree: spread evenly
    for q in range(1, 5):
        for t in tenants:
            assert p.select(W, loads, t + f"question {q}") == first[t]
    assert p.counts["prefix"] == 24 and p.counts["smallest_tree"] == 6


def test_cache_aware_threshold_and_rebalancing():
    cfg = CacheAwareConfig(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=2.0)
    p = CacheAware(cfg)
    owner = p.select(W, dict.fromkeys(W, 0), "abcdefgh")
    assert p.select(W, dict.fromkeys(W, 0), "abcdXXXXXXXX") != owner  # 4/12 matched < 0.5: not by prefix
    mild = {w: (4 if w == owner else 1) for w in W}  # 4 - 1 <= 4: balanced enough
    assert p.select(W, mild, "abcdefgh-again") == owner
    busy = {w: (10 if w == owner else 1) for w in W}  # 10 - 1 > 4 and 10 > 2 x 1: imbalanced
    assert p.select(W, busy, "abcdefgh-more") != owner and p.counts["balance"] == 1


def test_cache_aware_forgets_removed_workers_and_evicts_by_size():
    p = CacheAware(CacheAwareConfig(max_tree_size=10))
    loads = dict.fromkeys(W, 0)
    owner = p.select(W, loads, "a long shared system prompt, then a question")
    p.remove_worker(owner)
    assert owner not in p.stats()["tree_sizes"]
    rest = [w for w in W if w != owner]
    new_owner = p.select(rest, loads, "a long shared system prompt, then a question")
    assert new_owner in rest
    p.evict()
    assert all(s <= 10 for s in p.stats()["tree_sizes"].values())
    for i in range(50):  # no eviction run between them: each insert keeps the bound
        p.select(rest, loads, (7, i, i + 1, i + 2))
        assert all(s <= 10 for s in p.stats()["tree_sizes"].values())
    p.reset()
    assert p.stats()["tree_sizes"] == {}


def test_make_policy_and_config_checks():
    assert make_policy("round_robin").name == "round_robin"
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(ValueError):
        CacheAwareConfig(cache_threshold=1.5)
    with pytest.raises(ValueError):
        HealthConfig(health_failure_threshold=0)


def test_pool_routes_only_to_healthy_workers():
    pool = WorkerPool(["http://a/", "http://b"], make_policy("round_robin"))
    assert list(pool.workers) == ["http://a", "http://b"]
    pool.set_healthy("http://a", True)
    pool.set_healthy("http://b", True)
    pool.set_healthy("http://a", False, "gone")
    assert {pool.pick("k").url for _ in range(4)} == {"http://b"}
    assert pool.pick("k", exclude=()).routed >= 1
    from radixrt.router.workers import NoWorkerError

    with pytest.raises(NoWorkerError):
        pool.pick("k", exclude=("http://b",))
    with pytest.raises(ValueError, match="http://"):
        WorkerPool(["localhost:1"], make_policy("round_robin"))


def test_the_router_needs_no_model_stack():
    """`radixrt router` runs on a machine without torch: its modules import none of it."""
    import subprocess
    import sys

    code = (
        "import sys, radixrt.router.app, radixrt.router.cli; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
