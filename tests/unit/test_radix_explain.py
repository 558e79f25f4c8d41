"""The cache-miss explanation: the read-only tree walk (`radix_explain`) on
trees built by hand, and ``return_cache_info`` end to end through a real
Engine on the tiny random Llama (the match it reports is the one that
happened at admission)."""

from __future__ import annotations

import pytest

from radixrt.memory.radix_cache import RadixCache
from radixrt.memory.radix_explain import (
    CONTEXT_TOKENS,
    closest_neighbour,
    explain_match,
    render_cache_info,
)


def _tree(page_size: int = 1) -> RadixCache:
    return RadixCache(None, page_size=page_size)


def _snapshot(tree: RadixCache) -> list:
    return sorted((n.id, tuple(n.key), n.last_access, n.lock_ref) for n in tree._nodes())


def test_neighbour_found_inside_a_node_without_changing_the_tree():
    tree = _tree()
    tree.insert(list(range(100, 140)), list(range(40)))
    tree.insert(list(range(100, 120)) + [7, 8, 9], list(range(40, 63)))
    before = _snapshot(tree)
    stats = tree.stats()
    prompt = list(range(100, 130)) + [1, 2, 3]  # diverges at 30, inside the first prompt's node
    nb = closest_neighbour(tree, prompt)
    assert nb is not None and nb.depth == 30
    exp = explain_match(tree, prompt, None, matched=30, max_prefix_len=len(prompt) - 1, full=True)
    assert _snapshot(tree) == before and tree.stats() == stats  # no split, no touch, no counters
    assert exp["matched_tokens"] == exp["neighbour_tokens"] == exp["stop_position"] == 30
    assert exp["divergence_position"] == 30 and exp["reason"] == "diverged"
    assert exp["prompt_before"] == list(range(130 - CONTEXT_TOKENS, 130))
    assert exp["prompt_after"] == [1, 2, 3]
    assert exp["cached_after"] == list(range(130, 130 + CONTEXT_TOKENS))
    assert "namespace_differs" not in exp


def test_no_cached_prefix_and_empty_namespace():
    tree = _tree()
    tree.insert([5, 6, 7], [0, 1, 2])
    exp = explain_match(tree, [9, 9, 9], None, 0, 2, full=True)
    assert exp["reason"] == "no_cached_prefix" and exp["neighbour_tokens"] == 0
    assert exp["divergence_position"] == 0 and exp["cached_after"] == []
    exp = explain_match(tree, [5, 6, 7, 8], "tenant", 0, 3, full=True)
    assert exp["reason"] == "no_cached_prefix"
    # a salted request learns only that the shared namespace holds a longer prefix, never another salt's
    assert exp["namespace_differs"] is True and exp["default_namespace_neighbour_tokens"] == 3
    tree.insert([1, 2, 3, 4], [3, 4, 5, 6], namespace="other-tenant")
    exp = explain_match(tree, [1, 2, 3, 4, 5], "tenant", 0, 4, full=True)
    assert exp["default_namespace_neighbour_tokens"] == 0 and exp["namespace_differs"] is False


def test_whole_prompt_cached_reports_the_recomputed_last_token():
    tree = _tree()
    prompt = list(range(10, 30))
    tree.insert(prompt + [99], list(range(21)))
    exp = explain_match(tree, prompt, None, 19, 19, full=True)
    assert exp["reason"] == "last_token_recomputed" and exp["divergence_position"] is None
    assert exp["neighbour_tokens"] == 20 and exp["stop_position"] == 19 and exp["prompt_after"] == [29]
    exp = explain_match(tree, prompt, None, 4, 4, full=True)  # prompt logprobs from position 5 on
    assert exp["reason"] == "prompt_logprobs"


def test_page_alignment_and_partial_first_page():
    tree = _tree(page_size=4)
    tree.insert(list(range(16)), list(range(16)))
    prompt = list(range(10)) + [77, 78, 79]
    exp = explain_match(tree, prompt, None, 8, 12, full=True)
    assert exp["neighbour_tokens"] == 10 and exp["reason"] == "page_alignment"
    assert exp["prompt_after"] == [77, 78, 79] and exp["cached_after"][:2] == [10, 11]
    # diverging inside the first page: no page matches, but the neighbour shares 2 tokens
    exp = explain_match(tree, [0, 1, 50, 51, 52], None, 0, 4, full=True)
    assert exp["neighbour_tokens"] == 2 and exp["reason"] == "page_alignment"


def test_render_adds_text():
    wire = explain_match(_tree(), [1, 2], None, 0, 1, full=True)
    out = render_cache_info(wire, lambda ids: ",".join(map(str, ids)))
    assert out["prompt_after_text"] == "1,2" and out["cached_after_text"] == "" and out["prompt_after"] == [1, 2]


def test_own_view_shows_only_the_request_and_its_match():
    """Without ``full`` nothing depends on what else the tree holds: the same
    prompt and match give the same explanation over any two trees."""
    prompt = list(range(100, 130)) + [1, 2, 3]
    empty, busy = _tree(), _tree()
    busy.insert(list(range(100, 140)), list(range(40)))
    busy.insert(list(range(100, 130)) + [1, 2, 5, 6], list(range(40, 74)), namespace=None)
    for matched, cap, reason in (
        (30, 32, "not_cached"),
        (32, 32, "last_token_recomputed"),
        (4, 4, "prompt_logprobs"),
        (0, 32, "not_cached"),
    ):
        a = explain_match(empty, prompt, "salted", matched, cap)
        assert (
            a == explain_match(busy, prompt, "salted", matched, cap) == explain_match(busy, prompt, None, matched, cap)
        )
        assert a == {
            "view": "own",
            "prompt_tokens": 33,
            "matched_tokens": matched,
            "stop_position": matched,
            "reason": reason,
            "prompt_before": prompt[max(0, matched - CONTEXT_TOKENS) : matched],
            "prompt_after": prompt[matched : matched + CONTEXT_TOKENS],
        }
    out = render_cache_info(explain_match(busy, prompt, None, 30, 32), lambda ids: ",".join(map(str, ids)))
    assert "cached_after_text" not in out and out["prompt_after_text"] == "1,2,3"


@pytest.fixture(scope="module")
def engine(tiny_llama):
    import radixrt

    eng = radixrt.Engine(tiny_llama, max_total_tokens=4096, debug_check_invariants=True)
    yield eng
    eng.shutdown()


def test_engine_explains_a_miss_at_admission(engine):
    tok = engine.tokenizer
    base = "The quick brown fox jumps over the lazy dog near the river bank. " * 3
    first = base + "Then it slept under a tree."
    second = base + "Then it ran home."
    sp = {"max_new_tokens": 2, "temperature": 0}
    r1 = engine.generate(first, sp, return_cache_info="full")
    assert r1["meta_info"]["cache_info"]["reason"] == "no_cached_prefix"
    r2 = engine.generate(second, sp, return_cache_info="full")
    info = r2["meta_info"]["cache_info"]
    ids1, ids2 = tok.encode(first), tok.encode(second)
    common = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b)
    assert info["matched_tokens"] == r2["meta_info"]["cached_tokens"] == common
    assert info["divergence_position"] == common and info["reason"] == "diverged"
    assert info["prompt_after"] == ids2[common : common + CONTEXT_TOKENS]
    # the tree holds the first prompt and its output but the last token (whose KV was never computed)
    assert info["cached_after"] == (ids1 + r1["output_ids"][:-1])[common : common + CONTEXT_TOKENS]
    assert info["prompt_after_text"] == tok.decode(info["prompt_after"])
    assert info["cached_after_text"].startswith(tok.decode(ids1[common : common + 1]))
    own = engine.generate(second + " Again.", sp, return_cache_info=True)["meta_info"]["cache_info"]
    assert own["view"] == "own" and own["reason"] == "not_cached" and "cached_after" not in own
    assert own["prompt_after_text"] == tok.decode(tok.encode(second + " Again.")[own["matched_tokens"] :][:8])
    plain = engine.generate(second, sp)
    assert "cache_info" not in plain["meta_info"]  # nothing unless asked
    with pytest.raises(ValueError, match="return_cache_info"):
        engine.generate(second, sp, return_cache_info="yes")
    engine.wait_idle()
    engine.scheduler.check_invariants()
