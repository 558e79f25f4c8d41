"""`radixrt bench`: workload shapes, the ideal-prefill arithmetic, and an
end-to-end run of every system on a tiny random model."""

from __future__ import annotations

import asyncio
import json
import math
import random
import subprocess
import sys

import pytest

from radixrt.bench.common import ReqResult, arrivals, ideal_prompt_tokens, pct
from radixrt.bench.workloads import (
    PERSON_SCHEMA,
    WORKLOADS,
    Tokens,
    make_workload,
    shared_prefix,
    stage_waves,
    valid_person,
)


# ---------------------------------------------------------------------- arithmetic
def test_ideal_prompt_tokens_by_hand():
    assert ideal_prompt_tokens([([1, 2, 3], []), ([1, 2, 4], [])]) == 3 + 1
    # a fully cached prompt still computes one token (for its logits)
    assert ideal_prompt_tokens([([1, 2], []), ([1, 2], [])]) == 2 + 1
    # a chat's next turn reuses the previous answer, except its last token (sampled, never fed back)
    assert ideal_prompt_tokens([([1, 2], [5, 6, 7]), ([1, 2, 5, 6, 7, 8], [])]) == 2 + 2
    # unrelated prompts: everything
    assert ideal_prompt_tokens([([1, 2, 3], [9]), ([4, 5], [9])]) == 5


def test_percentiles_and_arrivals():
    assert pct([4, 1, 3, 2], 0.5) == 2.5
    assert pct([1.0], 0.99) == 1.0
    assert math.isnan(pct([], 0.5))
    assert arrivals(random.Random(0), 4, math.inf) == [0.0] * 4
    ts = arrivals(random.Random(0), 200, 10.0)
    assert ts[0] == 0.0 and all(b > a for a, b in zip(ts, ts[1:]))
    assert 10 < ts[-1] < 30  # ~200 arrivals at 10/s


def test_stage_waves_group_by_stage_in_submission_order():
    recs = [
        {"order": 2, "stage": 1, "input_ids": [3], "completion_tokens": 1},
        {"order": 0, "stage": 0, "input_ids": [1], "completion_tokens": 4},
        {"order": 1, "stage": 1, "input_ids": [2], "completion_tokens": 2},
    ]
    assert stage_waves(recs) == [[([1], 4)], [([2], 2), ([3], 1)]]


# ---------------------------------------------------------------------- workload shapes
def _record(wl, out_token: int = 777) -> list[dict]:
    """Run a workload's programs against a fake backend that answers with
    ``max_new_tokens`` copies of a token (distinct per request)."""
    records: list[dict] = []

    async def gen(ids, sp, stage):
        n = sp["max_new_tokens"]
        k = len(records)
        out = [out_token + k] * n
        records.append({"order": k, "stage": stage, "input_ids": list(ids), "sp": sp, "output_ids": out})
        await asyncio.sleep(0)
        return ReqResult(ok=True, output_ids=out, output_tokens=n, prompt_tokens=len(ids))

    async def main():
        await asyncio.gather(*(p(gen) for p in wl.programs))

    asyncio.run(main())
    return records


@pytest.fixture(scope="module")
def tok(tokenizer):
    return Tokens(tokenizer, 49152)


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_workload_issues_what_it_announces(tok, name):
    wl = make_workload(name, tok, scale=0.25)
    recs = _record(wl)
    assert len(recs) == wl.num_requests > 0
    assert all(0 <= t < 49152 for r in recs for t in r["input_ids"])
    assert all(r["sp"]["temperature"] == 0 for r in recs)
    # building twice gives the same prompts (seeded)
    again = _record(make_workload(name, tok, scale=0.25))
    assert [r["input_ids"] for r in again] == [r["input_ids"] for r in recs]


def test_scale_changes_counts_not_shapes(tok):
    small, big = make_workload("shared-prefix", tok, scale=0.25), make_workload("shared-prefix", tok, scale=1.0)
    assert (small.num_requests, big.num_requests) == (8, 32)
    assert {len(r["input_ids"]) for r in _record(small)} == {len(r["input_ids"]) for r in _record(big)} == {1056}
    assert make_workload("tree-of-thought", tok, scale=0.01).num_requests == 36  # at least one program


def test_shared_prefix_and_few_shot_share_their_prefixes(tok):
    recs = _record(shared_prefix(tok, requests=6, prefix=100, unique=8, output=4, groups=2, scale_requests=False))
    firsts = [r["input_ids"][:100] for r in recs]
    assert firsts[0] == firsts[2] == firsts[4] != firsts[1] == firsts[3]  # interleaved groups
    assert len({tuple(r["input_ids"]) for r in recs}) == 6
    fs = make_workload("few-shot", tok, scale=0.25)
    recs = _record(fs)
    assert all(r["sp"]["max_new_tokens"] == 1 for r in recs)
    a, b = recs[0]["input_ids"], recs[2]["input_ids"]  # same subject
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common > 300  # the 5-shot block is shared


def test_multi_turn_resends_history_with_answers(tok):
    wl = make_workload("multi-turn", tok, scale=0.125)  # one user
    recs = sorted(_record(wl), key=lambda r: r["order"])
    assert [r["stage"] for r in recs] == [0, 1, 2, 3]
    for prev, nxt in zip(recs, recs[1:]):
        assert (
            nxt["input_ids"][: len(prev["input_ids"]) + len(prev["output_ids"])]
            == prev["input_ids"] + prev["output_ids"]
        )


def test_agent_fanout_forks_from_the_plan_and_joins(tok):
    wl = make_workload("agent-fanout", tok, scale=0.125)  # one program
    recs = sorted(_record(wl), key=lambda r: r["order"])
    assert [r["stage"] for r in recs] == [0, 1, 1, 1, 1, 2]
    plan = recs[0]
    base = plan["input_ids"] + plan["output_ids"]
    for br in recs[1:5]:
        assert br["input_ids"][: len(base)] == base
    first = recs[1]
    assert (
        recs[5]["input_ids"][: len(first["input_ids"]) + len(first["output_ids"])]
        == first["input_ids"] + first["output_ids"]
    )
    # every program shares the tool scaffold
    two = _record(make_workload("agent-fanout", tok, scale=0.25))
    stage0 = [r["input_ids"] for r in two if r["stage"] == 0]
    assert stage0[0][:200] == stage0[1][:200]


def test_tree_of_thought_shape(tok):
    recs = _record(make_workload("tree-of-thought", tok, scale=0.25))
    by_stage = [sum(r["stage"] == s for r in recs) for s in range(3)]
    assert by_stage == [4, 16, 16]
    ideal = ideal_prompt_tokens((r["input_ids"], r["output_ids"]) for r in sorted(recs, key=lambda r: r["order"]))
    assert ideal < sum(len(r["input_ids"]) for r in recs) / 5  # the tree shares most of its prompts


def test_json_extraction_asks_for_the_schema(tok):
    wl = make_workload("json-extraction", tok, scale=0.25)
    recs = _record(wl)
    assert all(json.loads(r["sp"]["json_schema"]) == PERSON_SCHEMA for r in recs)
    assert "ignore_eos" not in recs[0]["sp"]  # the grammar ends the answer
    assert wl.validate is valid_person
    assert valid_person('{"name": "Ada Brookson", "age": 41, "city": "Oslo", "occupation": "pilot"}')
    assert not valid_person('{"name": "Ada", "age": "41", "city": "Oslo", "occupation": "pilot"}')
    assert not valid_person('{"name": "Ada", "age": 41')


def test_bench_modules_import_no_matplotlib_or_torch():
    code = (
        "import sys, radixrt.bench.main, radixrt.bench.driver, radixrt.bench.offline, radixrt.bench.online,"
        " radixrt.bench.report, radixrt.bench.plots, radixrt.bench.workloads, radixrt.plan;"
        "print(sorted(m for m in ('matplotlib', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------- end to end
def _bench(tmp_path, *argv):
    from radixrt.cli import main

    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    rc = main(["bench", *argv, "--no-progress", "--json-out", str(out), "--markdown-out", str(md)])
    return rc, json.loads(out.read_text()), md.read_text()


@pytest.mark.slow
def test_bench_offline_every_system_on_a_tiny_model(tmp_path, tiny_llama, capsys):
    rc, rep, md = _bench(
        tmp_path,
        "--model",
        tiny_llama,
        "--offline-only",
        "--scale",
        "0.125",
        "--workload",
        "shared-prefix",
        "--workload",
        "multi-turn",
        "--workload",
        "no-sharing",
        "--max-total-tokens",
        "8192",
    )
    assert rc == 0
    by = {w["name"]: {r["system"].split(" (")[0]: r for r in w["rows"]} for w in rep["workloads"]}
    assert set(by) == {"shared-prefix", "multi-turn", "no-sharing"}
    for rows in by.values():
        assert set(rows) == {
            "radixrt",
            "radixrt, cache off",
            "radixrt fcfs",
            "radixrt dfs-weight",
            "transformers generate",
        }
        assert all(r["failed"] == 0 for r in rows.values())
        ref, off = rows["radixrt"], rows["radixrt, cache off"]
        assert ref["output_tokens"] == off["output_tokens"] == rows["transformers generate"]["output_tokens"]
        assert off["prompt_tokens_computed"] == off["prompt_tokens"]  # no cache: every prompt token
        assert off["cache_hit_rate"] == 0.0
        assert ref["time_ratio"] == 1.0
    sp = by["shared-prefix"]
    # 4 requests sharing 1024 tokens + 32 each: the cache computes exactly the ideal
    assert sp["radixrt"]["ideal_prompt_tokens"] == 1024 + 4 * 32
    assert sp["radixrt"]["prompt_tokens_computed"] == 1024 + 4 * 32
    assert sp["radixrt"]["cache_hit_rate"] == pytest.approx(3 * 1024 / (4 * 1056))
    assert sp["radixrt, cache off"]["computed_vs_ideal"] == pytest.approx(4 * 1056 / (1024 + 128))
    assert sp["radixrt"]["peak_kv_slots"] < sp["radixrt, cache off"]["peak_kv_slots"]
    assert by["multi-turn"]["radixrt"]["cache_hit_rate"] > 0.5
    assert by["no-sharing"]["radixrt"]["cache_hit_rate"] == 0.0
    text = capsys.readouterr().out
    assert "== headline" in text and "speedup vs transformers" in text
    assert "| system | mode |" in md and "### Headline ratios" in md


def test_bench_prefix_groups_give_the_shared_prefix_workload_several_prompts(tmp_path, tiny_llama):
    rc, rep, _ = _bench(
        tmp_path,
        "--model",
        tiny_llama,
        "--offline-only",
        "--scale",
        "0.125",
        "--workload",
        "shared-prefix",
        "--prefix-groups",
        "2",
        "--policies",
        "lpm",
        "--skip-cache-off",
        "--skip-transformers",
        "--max-total-tokens",
        "8192",
    )
    assert rc == 0
    (row,) = rep["workloads"][0]["rows"]
    assert "2 x 1024-token shared prefix" in rep["workloads"][0]["shape"]
    assert row["ideal_prompt_tokens"] == row["prompt_tokens_computed"] == 2 * 1024 + 4 * 32


def test_bench_sweeps_on_a_tiny_model(tmp_path, tiny_llama):
    rc, rep, md = _bench(
        tmp_path,
        "--model",
        tiny_llama,
        "--workload",
        "none",
        "--policies",
        "lpm",
        "--sweep",
        "prefix",
        "--sweep",
        "concurrency",
        "--prefix-lens",
        "64,256",
        "--concurrency",
        "1,8",
        "--sweep-requests",
        "3",
        "--skip-transformers",
    )
    assert rc == 0 and rep["workloads"] == []
    prefix, conc = rep["sweeps"]
    assert [(r["x"], r["system"]) for r in prefix["rows"]] == [
        (64, "radixrt"),
        (64, "radixrt, cache off"),
        (256, "radixrt"),
        (256, "radixrt, cache off"),
    ]
    for r in prefix["rows"]:
        if r["system"] == "radixrt":
            assert r["prompt_tokens_computed"] == r["x"] + 3 * 16
        else:
            assert r["prompt_tokens_computed"] == 3 * (r["x"] + 16)
    assert [r["x"] for r in conc["rows"]] == [1, 1, 8, 8]
    assert "### Sweep: concurrent requests" in md


def test_bench_plots_from_a_report(tmp_path, tiny_llama):
    pytest.importorskip("matplotlib")
    from radixrt.bench.plots import plot_report

    rc, rep, _ = _bench(
        tmp_path,
        "--model",
        tiny_llama,
        "--offline-only",
        "--scale",
        "0.125",
        "--workload",
        "shared-prefix",
        "--policies",
        "lpm",
        "--sweep",
        "prefix",
        "--prefix-lens",
        "64,128",
        "--sweep-requests",
        "2",
    )
    paths = plot_report(rep, str(tmp_path / "img"))
    names = sorted(p.rsplit("/", 1)[-1] for p in paths)
    assert names == ["bench_cache.png", "bench_throughput.png", "sweep_prefix.png"]
    assert all((tmp_path / "img" / n).stat().st_size > 10_000 for n in names)


@pytest.mark.slow
def test_bench_online_on_a_tiny_model(tmp_path, tiny_llama):
    rc, rep, _ = _bench(
        tmp_path,
        "--model",
        tiny_llama,
        "--scale",
        "0.125",
        "--workload",
        "json-extraction",  # the online path is the same for every workload (agent-fanout's: offline tests)
        "--skip-transformers",
        "--policies",
        "lpm",
        "--max-total-tokens",
        "8192",
    )
    assert rc == 0
    for w in rep["workloads"]:
        online = {r["system"]: r for r in w["rows"] if r["mode"] == "online"}
        assert set(online) == {"radixrt", "radixrt, cache off"}
        on, off = online["radixrt"], online["radixrt, cache off"]
        assert on["failed"] == off["failed"] == 0
        assert on["request_rate"] > 0 and on["p50_ttft_ms"] > 0
        assert on["cache_hit_rate"] > 0.3 and off["cache_hit_rate"] == 0.0
        if w["name"] == "json-extraction":
            offline = next(r for r in w["rows"] if r["mode"] == "offline" and r["system"] == "radixrt")
            assert "valid_outputs" in offline


@pytest.mark.parametrize(
    "module",
    [
        "radixrt.bench",
        "radixrt.bench.main",
        "radixrt.bench.programs",
        "radixrt.bench.constrained",
        "radixrt.bench.serving",
        "radixrt.bench.plots",
    ],
)
def test_bench_entry_points_answer_help(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: python -m {module} ")
