"""KV budgets (``--kv-budget``): quality and capacity of h2o, infinigen and window against full KV.

    python -m radixrt.bench.kv_budget                        # embedded model, 4k contexts, 50/25/12.5%
    python -m radixrt.bench.kv_budget --context 2048 --budgets 0.25 --policies h2o --samples 1 --needles 2
    radixrt bench --kv-budget

Everything runs through ``Engine.generate`` on one engine; each request sets
its own budget (``sampling_params`` ``kv_budget`` in tokens, a fraction of
``--context``, and ``kv_budget_policy``), and the radix cache is flushed
before each one, so every budgeted request compresses its own prefill. The
texts ship with Python: ``pydoc_data.topics`` (English prose) and the
sources of a few standard-library modules (code), alternating by sample.

Per policy and budget:

1. **Perplexity** of a held-out continuation: ``--continuation`` tokens read
   after a ``--context``-token context, scored from the prompt's logprobs
   (``logprob_start_len``) while the request compresses its KV chunk by
   chunk. ``dppl`` is the change against full KV.
2. **Greedy agreement**: full KV answers each context with ``--tokens``
   greedy tokens; the budgeted request reads context + that answer and its
   top-1 at each answer position is compared with full KV's token
   (teacher-forced, as radixrt.bench.kv_quality does).
3. **Needle retrieval**: a fact ("The access code for the <colour> vault is
   <5 digits>.") planted at 10-50% depth of a context, asked for at its
   end; found when the greedy answer holds the digits. ``found`` counts the
   needles full KV finds that the policy finds too.
4. **Peak KV per request** (``meta_info.kv_budget.peak_kv_tokens``: the most
   slots a request attended in one step) and **requests at once**: eight
   long requests sent together to an engine whose pool holds
   ``--pool-contexts`` contexts, the most that were decoding at once (their
   whole prompt in KV; the scheduler's ``peak_decoding``) and the retractions.
5. With ``--costs``: decode ms per step at a 25% budget beside full KV (the
   scoring pass and the compactions included), and the recall of
   infinigen's estimate (`estimate_recall`: of the positions with the most
   exact attention mass, the share its key sketch also ranks on top).

Not a timed benchmark; on the 2-core CPU the default run takes several minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from radixrt.help_format import HelpFormatter

POLICIES = ("window", "h2o", "infinigen")
CODE_MODULES = ("argparse", "dataclasses", "inspect", "typing", "pathlib", "json.decoder")
COLOURS = ("red", "green", "blue", "amber", "violet", "silver", "orange", "black", "white", "golden")


@dataclass
class BudgetRow:
    policy: str  # "full" for no budget
    budget: float  # fraction of the context (1.0 for full)
    perplexity: float
    perplexity_change: float  # relative to full KV
    forced_agreement: float
    needles_found: int
    needles_full: int  # found with full KV (the denominator of the target)
    needles_total: int
    peak_kv_tokens: int
    seconds: float


def prose_tokens(tokenizer: Any) -> list[int]:
    """``pydoc_data.topics``, its topics in sorted order, as tokens."""
    from pydoc_data.topics import topics

    return tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)


def code_tokens(tokenizer: Any) -> list[int]:
    """The sources of a few standard-library modules, as tokens."""
    import importlib
    import inspect

    text = "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in CODE_MODULES)
    return tokenizer.encode(text, add_special_tokens=False)


def contexts(tokenizer: Any, n: int, length: int, tail: int) -> list[list[int]]:
    """``n`` windows of ``length + tail`` tokens, prose and code alternating, each from a different offset."""
    sources = [prose_tokens(tokenizer), code_tokens(tokenizer)]
    out = []
    for i in range(n):
        src = sources[i % 2]
        start = (i // 2) * (length + tail)
        if start + length + tail > len(src):
            raise ValueError(f"not enough text for {n} contexts of {length + tail} tokens")
        out.append(src[start : start + length + tail])
    return out


def needle_prompts(tokenizer: Any, n: int, length: int, seed: int) -> list[tuple[list[int], str]]:
    """``n`` (prompt, digits): a fact planted at 10-50% depth of ``length`` tokens of prose, asked for at the end."""
    rng = random.Random(seed)
    prose = prose_tokens(tokenizer)
    out = []
    for i in range(n):
        colour, code = COLOURS[i % len(COLOURS)], f"{rng.randrange(10000, 99999)}"
        fact = tokenizer.encode(f"\nThe access code for the {colour} vault is {code}.\n", add_special_tokens=False)
        ask = tokenizer.encode(
            f"\n\nQuestion: what is the access code for the {colour} vault?\n"
            f"Answer: the access code for the {colour} vault is",
            add_special_tokens=False,
        )
        body = length - len(fact) - len(ask)
        start = rng.randrange(0, len(prose) - body)
        text = prose[start : start + body]
        depth = int(body * (0.1 + 0.4 * i / max(n - 1, 1)))
        out.append((text[:depth] + fact + text[depth:] + ask, code))
    return out


def _sampling(policy: Optional[str], budget_tokens: Optional[int], **kw: Any) -> dict:
    sp: dict[str, Any] = {"temperature": 0.0, **kw}
    if policy is not None:
        sp.update(kv_budget=budget_tokens, kv_budget_policy=policy)
    return sp


def _peak(meta: dict, prompt_len: int) -> int:
    info = meta.get("kv_budget")
    return int(info["peak_kv_tokens"]) if info else prompt_len + int(meta.get("completion_tokens", 0))


def evaluate(
    engine: Any,
    policy: Optional[str],
    budget: float,
    ctx_len: int,
    samples: list[list[int]],
    answers: list[list[int]],
    needles: list[tuple[list[int], str]],
    tokenizer: Any,
) -> tuple[float, float, list[bool], int]:
    """(perplexity, forced agreement, needle found per needle, peak KV) of one policy and budget."""
    tokens = None if policy is None else max(32, int(budget * ctx_len))
    nll, count, agree, total, peak = 0.0, 0, 0, 0, 0
    for sample, answer in zip(samples, answers):
        engine.flush_cache()
        res = engine.generate(
            input_ids=sample,
            sampling_params=_sampling(policy, tokens, max_new_tokens=1),
            return_logprob=True,
            logprob_start_len=ctx_len - 1,  # the first entry, unscored; then the continuation's
        )
        lps = [lp for lp, _, _ in res["meta_info"]["input_token_logprobs"] if lp is not None]
        nll -= sum(lps)
        count += len(lps)
        peak = max(peak, _peak(res["meta_info"], len(sample)))
        engine.flush_cache()
        prompt = sample[:ctx_len] + answer
        res = engine.generate(
            input_ids=prompt,
            sampling_params=_sampling(policy, tokens, max_new_tokens=1),
            return_logprob=True,
            logprob_start_len=ctx_len - 1,
            top_logprobs_num=1,
        )
        tops = res["meta_info"]["input_top_logprobs"][1:]  # predictions of answer[0..] from the position before
        for want, top in zip(answer, tops):
            agree += bool(top) and top[0][1] == want
            total += 1
    found = []
    for prompt, code in needles:
        engine.flush_cache()
        res = engine.generate(input_ids=prompt, sampling_params=_sampling(policy, tokens, max_new_tokens=8))
        found.append(code in res["text"].replace(" ", ""))
        peak = max(peak, _peak(res["meta_info"], len(prompt)))
    return math.exp(nll / max(count, 1)), agree / max(total, 1), found, peak


def estimate_recall(model: str, dtype: str, tokens: list[int], query_rows: int = 4) -> dict[str, float]:
    """How well infinigen's estimate finds the positions attention needs: the
    context ``tokens[:-query_rows]`` is prefilled with full KV, then the last
    ``query_rows`` tokens are computed once with the scoring pass
    (kernels/kv_scores.py) reading every position exactly *and* through the
    key sketch. Per layer and KV
    head, recall@k is the share of the k positions with the most exact mass
    that are among the k with the most estimated mass; the mean over layers
    and heads, for k = 1%, 5% and 10% of the context."""
    import torch

    from radixrt.bench.kv_quality import _runner
    from radixrt.kernels.kv_scores import OffloadSketch, ScoreJob
    from radixrt.memory.kv_budget_ops import principal_axes, sketch_keys

    runner = _runner(model, "cpu", "auto", len(tokens) + 64, dtype)
    pool = runner.kv_pool
    n = len(tokens)
    ctx = n - query_rows
    table = runner.req_to_token
    table.write(0, 0, list(range(n)))
    writes = table.take_writes()
    for a in range(0, ctx, 512):
        b = min(a + 512, ctx)
        runner.forward_batch(tokens[a:b], [0], [b - a], [b], writes)
        writes = None
    slots = torch.arange(ctx, dtype=torch.int64)
    axes = principal_axes(pool, slots)
    L, H = pool.num_layers, pool.num_kv_heads
    sketch = OffloadSketch(
        sketch_keys(pool, slots, axes),
        axes,
        torch.zeros((L, H, ctx), dtype=torch.float32),
    )
    exact = torch.zeros((L, H, n), dtype=torch.float32)
    runner.forward_batch(tokens[ctx:], [0], [query_rows], [n], None, score_jobs=[ScoreJob(0, exact, 1.0, sketch)])
    out = {}
    for share in (0.01, 0.05, 0.10):
        k = max(1, int(share * ctx))
        top_exact = exact[:, :, :ctx].topk(k, dim=-1).indices
        top_est = sketch.acc.topk(k, dim=-1).indices
        hit = (top_exact[..., :, None] == top_est[..., None, :]).any(-1).float().mean()
        out[f"recall@{share:.0%}"] = float(hit)
    return out


def decode_step_ms(engine: Any, prompt: list[int], extra: dict, new: int = 32) -> float:
    """ms per decode step of ``prompt`` under the sampling extras ``extra``: the
    difference of a 1-token and a ``new + 1``-token run (prefill alike), median of 3."""
    import statistics

    runs = []
    for _ in range(3):
        times = []
        for m in (1, new + 1):
            engine.flush_cache()
            sp = {"max_new_tokens": m, "temperature": 0.0, "ignore_eos": True, **extra}
            t0 = time.perf_counter()
            engine.generate(input_ids=prompt, sampling_params=sp)
            times.append(time.perf_counter() - t0)
        runs.append(1000 * (times[1] - times[0]) / new)
    return statistics.median(runs)


def requests_at_once(
    model: str, dtype: str, policy: Optional[str], budget: float, ctx_len: int, pool: int
) -> dict[str, int]:
    """Eight long requests sent at once to a pool of ``pool`` tokens: the most
    that were decoding together (their whole prompt computed and in KV), and the
    retractions it took (a request admitted with its first chunk that the pool
    could not hold to the end)."""
    import radixrt

    tokenizer_engine = radixrt.Engine(
        model_path=model, dtype=dtype, max_total_tokens=pool, max_running_requests=16, disable_radix_cache=True
    )
    try:
        prose = prose_tokens(tokenizer_engine.tokenizer)
        prompts = [prose[i * 97 : i * 97 + ctx_len] for i in range(8)]
        tokens = None if policy is None else max(32, int(budget * ctx_len))
        tokenizer_engine.generate(
            input_ids=prompts, sampling_params=_sampling(policy, tokens, max_new_tokens=16, ignore_eos=True)
        )
        stats = tokenizer_engine.get_stats()
        return {"decoding_at_once": int(stats["peak_decoding"]), "retractions": int(stats["retractions"])}
    finally:
        tokenizer_engine.shutdown()


def run(args: argparse.Namespace) -> list[BudgetRow]:
    import radixrt

    engine = radixrt.Engine(model_path=args.model, dtype=args.dtype, max_total_tokens=2 * (args.context + 256))
    rows: list[BudgetRow] = []
    try:
        tok = engine.tokenizer
        samples = contexts(tok, args.samples, args.context, args.continuation)
        answers = []
        for s in samples:
            res = engine.generate(
                input_ids=s[: args.context],
                sampling_params={"temperature": 0.0, "max_new_tokens": args.tokens, "ignore_eos": True},
            )
            answers.append(res["output_ids"])
        needles = needle_prompts(tok, args.needles, args.context, args.seed)
        configs: list[tuple[Optional[str], float]] = [(None, 1.0)]
        configs += [(p, b) for b in args.budgets for p in args.policies]
        full: Optional[tuple[float, list[bool]]] = None
        for policy, budget in configs:
            t0 = time.perf_counter()
            ppl, agree, found, peak = evaluate(engine, policy, budget, args.context, samples, answers, needles, tok)
            if full is None:
                full = (ppl, found)
            found_full = sum(f and g for f, g in zip(found, full[1]))
            row = BudgetRow(
                policy or "full",
                budget,
                ppl,
                ppl / full[0] - 1,
                agree,
                found_full,
                sum(full[1]),
                len(found),
                peak,
                time.perf_counter() - t0,
            )
            rows.append(row)
            print(_line(row), flush=True)
    finally:
        engine.shutdown()
    return rows


def _line(r: BudgetRow) -> str:
    return (
        f"| {r.policy} | {r.budget:.1%} | {r.perplexity:.3f} | {r.perplexity_change:+.2%} | "
        f"{r.forced_agreement:.1%} | {r.needles_found}/{r.needles_full} (of {r.needles_total}) | "
        f"{r.peak_kv_tokens} | {r.seconds:.0f} s |"
    )


def contexts_for_recall(args: argparse.Namespace) -> list[int]:
    """The first needle prompt: a fact deep in prose, asked for at the end."""
    from transformers import AutoTokenizer

    from radixrt.executor.model_store import resolve_model_path

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model)))
    return needle_prompts(tok, 1, args.context, args.seed)[0][0]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.kv_budget",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32", help="the model's dtype (float32: budgets are compared exactly)")
    p.add_argument("--context", type=int, default=4096, help="context tokens per sample and needle prompt")
    p.add_argument("--continuation", type=int, default=128, help="held-out tokens scored after each context")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens compared (teacher-forced)")
    p.add_argument(
        "--samples",
        type=int,
        default=4,
        help="contexts (prose and code alternating); each scores --continuation tokens (two samples, 256 "
        "tokens, moved h2o's figure at 25%% by more than a point from one pair of texts to the next)",
    )
    p.add_argument("--needles", type=int, default=6)
    p.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.125], help="fractions of --context")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--capacity", action="store_true", help="also count the requests that run at once in one pool")
    p.add_argument("--pool-contexts", type=float, default=2.5, help="--capacity: the pool, in contexts")
    p.add_argument(
        "--costs",
        action="store_true",
        help="also measure decode ms/step with and without a 25%% budget, and the recall of infinigen's estimate",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None, help="write the rows to this file")
    args = p.parse_args(argv)
    print(f"# KV budgets, {args.context}-token contexts, load {os.getloadavg()[0]:.1f}", flush=True)
    print("| policy | budget | ppl | dppl | forced agree | needles | peak KV | time |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = run(args)
    out: dict[str, Any] = {"rows": [asdict(r) for r in rows]}
    if args.capacity:
        pool = int(args.pool_contexts * args.context)
        print(f"\n# requests at once: 8 requests of {args.context} tokens, a pool of {pool} tokens")
        cap = {"full": requests_at_once(args.model, args.dtype, None, 1.0, args.context, pool)}
        for b in args.budgets:
            for policy in args.policies:
                cap[f"{policy} {b:.1%}"] = requests_at_once(args.model, args.dtype, policy, b, args.context, pool)
        print("| KV | decoding at once | retractions |\n|---|---:|---:|")
        for name, c in cap.items():
            print(f"| {name} | {c['decoding_at_once']} | {c['retractions']} |")
        out["requests_at_once"] = cap
    if args.costs:
        import radixrt

        engine = radixrt.Engine(model_path=args.model, dtype=args.dtype, max_total_tokens=2 * (args.context + 256))
        try:
            prompt = contexts(engine.tokenizer, 1, args.context, 0)[0]
            costs = {"full": decode_step_ms(engine, prompt, {})}
            for policy in args.policies:
                costs[f"{policy} 25%"] = decode_step_ms(
                    engine, prompt, {"kv_budget": args.context // 4, "kv_budget_policy": policy}
                )
        finally:
            engine.shutdown()
        print(f"\n# decode ms/step, {args.context}-token context (the scoring pass and compactions included)")
        for name, ms in costs.items():
            print(f"| {name} | {ms:.1f} ms |")
        out["decode_ms_per_step"] = costs
        recall = estimate_recall(args.model, args.dtype, contexts_for_recall(args))
        print(
            f"\n# infinigen's estimate, {args.context}-token context: "
            + ", ".join(f"{k} {v:.1%}" for k, v in recall.items())
        )
        out["estimate_recall"] = recall
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
