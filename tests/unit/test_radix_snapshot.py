"""The debug view's snapshot of the radix tree (radixrt/memory/radix_snapshot.py): limits,
the size of what they hide, hits, namespaces by digest, and a cost bounded by the limits."""

from __future__ import annotations

import collections
import random

from radixrt.memory.kv_pool import PageAllocator
from radixrt.memory.radix_cache import RadixCache
from radixrt.memory.radix_snapshot import namespace_label, radix_snapshot


def _tree(sequences: list[tuple[object, list[int]]]) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(100_000, 1)
    tree = RadixCache(alloc, page_size=1)
    for namespace, key in sequences:
        slots = alloc.alloc_pages(len(key))
        present = tree.insert(key, slots, namespace=namespace)
        if present:
            alloc.free_slots(slots[:present])
    return tree, alloc


def test_every_node_once_with_its_fields_when_the_limits_allow():
    tree, _ = _tree([(None, [1, 2, 3, 4]), (None, [1, 2, 9]), ("salt", [5, 6])])
    snap = radix_snapshot(tree.root, max_depth=8, max_nodes=100, tokens_per_node=8)
    by_ns = {ns["namespace"]: ns for ns in snap["namespaces"]}
    assert by_ns["default"]["nodes"] == 3 and by_ns["default"]["tokens"] == 5  # [1,2] -> [3,4], [9]
    assert by_ns[namespace_label("salt")]["tokens"] == 2 and "salt" not in str(snap)
    assert not snap["truncated"] and snap["exact"] and len(snap["nodes"]) == 4
    shared = next(n for n in snap["nodes"] if n["token_ids"] == [1, 2])
    assert shared["children"] == 2 and shared["where"] == "device" and shared["depth"] == 1
    below = [n for n in snap["nodes"] if n["parent"] == shared["id"]]
    assert sorted(n["token_ids"] for n in below) == [[3, 4], [9]]


def test_limits_cut_the_tree_and_say_what_they_hide():
    rng = random.Random(0)
    seqs = [(None, [1, 2] + [rng.randrange(3, 50) for _ in range(6)]) for _ in range(200)]
    tree, _ = _tree(seqs)
    full = radix_snapshot(tree.root, max_depth=64, max_nodes=100_000)
    total = full["namespaces"][0]["nodes"]
    assert len(full["nodes"]) == total and not full["truncated"]
    shallow = radix_snapshot(tree.root, max_depth=1, max_nodes=100_000)
    assert len(shallow["nodes"]) == 1 and shallow["truncated"]
    assert shallow["nodes"][0]["hidden_nodes"] == total - 1  # everything below the shared [1, 2] node
    few = radix_snapshot(tree.root, max_depth=64, max_nodes=10)
    assert len(few["nodes"]) == 10
    assert 10 + sum(n.get("hidden_nodes", 0) for n in few["nodes"]) == total


def test_the_count_budget_bounds_the_walk():
    rng = random.Random(1)
    tree, _ = _tree([(None, [rng.randrange(100) for _ in range(10)]) for _ in range(3000)])
    snap = radix_snapshot(tree.root, max_depth=2, max_nodes=50, count_budget=100)
    assert not snap["exact"] and len(snap["nodes"]) <= 50
    exact = {n["id"]: n for n in radix_snapshot(tree.root, max_depth=2, max_nodes=50, count_budget=10**9)["nodes"]}
    # past the budget a node's hidden size is a lower bound: at least its hidden children (their number is
    # free), never more than the truth; what was walked beyond those children stays within the budget
    listed_children = collections.Counter(n["parent"] for n in snap["nodes"])
    walked_beyond = 0
    for n in snap["nodes"]:
        direct = n["children"] - listed_children[n["id"]]
        assert direct <= n.get("hidden_nodes", 0) <= exact[n["id"]].get("hidden_nodes", 0)
        walked_beyond += n.get("hidden_nodes", 0) - direct
    assert walked_beyond <= 100
    assert sum(exact[i].get("hidden_nodes", 0) for i in exact) > 1000  # the budget did cut the walk short


def test_hits_count_admissions_through_a_node(tiny_llama):
    from radixrt.config import EngineConfig
    from radixrt.requests.messages import GenerateReq, RadixSnapshotReq
    from radixrt.sampling.params import SamplingParams
    from radixrt.scheduler.scheduler import Scheduler

    sched = Scheduler(EngineConfig(model_path=tiny_llama, max_total_tokens=2048, disable_overlap_schedule=True))
    prefix = list(range(100, 140))
    for i in range(4):
        sched.add_request(
            GenerateReq(rid=f"r{i}", input_ids=prefix + [200 + i], sampling=SamplingParams(max_new_tokens=1))
        )
        while sched.has_work():
            sched.step()
    view = sched.handle(RadixSnapshotReq(max_nodes=50, tokens_per_node=4)).payload
    shared = next(n for n in view["nodes"] if n["token_ids"] == prefix[:4])
    assert shared["hits"] == 3  # every request after the first reused it
    assert view["kv"]["total_slots"] == 2048 and view["requests"] == []


def test_many_namespaces_and_first_level_nodes_stay_within_the_limits():
    """2,500 first-level nodes and 300 namespaces: a view of 10 nodes lists at most 10 namespaces (it
    listed every one: an answer the limits did not bound) and says how many there are; a namespace's
    size is never below the children it is known to have (it read 0 once the count budget was spent)."""
    seqs = [(None, [1000 + i, 7]) for i in range(2500)] + [(f"salt{i}", [7, 8, 9]) for i in range(300)]
    tree, _ = _tree(seqs)
    snap = radix_snapshot(tree.root, max_depth=1, max_nodes=10, count_budget=100)
    assert len(snap["nodes"]) == 10 and len(snap["namespaces"]) == 10 and snap["namespaces_total"] == 301
    assert snap["truncated"] and not snap["exact"]
    default = next(ns for ns in snap["namespaces"] if ns["namespace"] == "default")
    assert default["children"] == 2500 and default["nodes"] >= 2500
    assert all(ns["nodes"] >= ns["children"] >= 1 for ns in snap["namespaces"])
