"""Program benchmark: radixrt running structured programs against the same
requests sent one by one, as independent prompts, to the transformers
``generate`` loop.

    python -m radixrt.bench.programs                 # both workloads, default model
    python -m radixrt.bench.programs --questions 16 --no-cache-off --json out.json

Workloads (the programs of ``examples/``, from ``radixrt.bench.example_programs``)
  * tree of thought: a question, then two levels of ``fork(4)`` (4 thoughts,
    each expanded into 4: 20 thoughts), then an answer and a yes/no
    ``select`` self-check on each of the 16 leaves;
  * 5-shot batch: 64 capital-city questions behind the same five worked
    examples, through ``run_batch``.

How it is measured (one process, one machine, same weights and threads)
  1. radixrt runs the program; a recording backend keeps every request it
     sent (prompts, and how many tokens each generation produced);
  2. optionally, radixrt runs the same program with the radix cache off;
  3. the transformers baseline replays the recorded requests sequentially,
     each as an independent prompt: ``model.generate`` forced to produce the
     same number of tokens (greedy), or one forward pass for prefill-only
     requests (``select`` scoring, prefix prefill).
Reported: wall times, their ratios, and the radix cache hit rate in tokens
(cached prompt tokens / prompt tokens over the program's requests).
Figures are ratios from one run; absolute times only mean something on the
machine they were taken on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from radixrt.bench.example_programs import CAPITAL_QUESTIONS, TOT_QUESTION, capital_qa, tree_of_thought
from radixrt.frontend.engine_backend import EngineBackend
from radixrt.help_format import HelpFormatter


class RecordingBackend(EngineBackend):
    """The in-process engine backend, keeping every request and response."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.log: list[tuple[dict, Any]] = []

    def raw_generate(self, payload: dict[str, Any]) -> Any:
        resp = super().raw_generate(payload)
        self.log.append((payload, resp))
        return resp


def _requests(log: list[tuple[dict, Any]]) -> list[dict[str, Any]]:
    """Flatten the log into single-prompt requests with their outcomes."""
    out = []
    for payload, resp in log:
        texts = payload.get("text")
        ids = payload.get("input_ids")
        prompts = texts if isinstance(texts, list) else [texts] if texts is not None else None
        id_lists = None
        if prompts is None:
            id_lists = ids if ids and isinstance(ids[0], list) else [ids]
        resps = resp if isinstance(resp, list) else [resp]
        for i, r in enumerate(resps):
            m = r["meta_info"]
            out.append(
                {
                    "text": prompts[i] if prompts is not None else None,
                    "input_ids": id_lists[i] if id_lists is not None else None,
                    "max_new_tokens": payload.get("sampling_params", {}).get("max_new_tokens", 128),
                    "completion_tokens": m["completion_tokens"],
                    "prompt_tokens": m["prompt_tokens"],
                    "cached_tokens": m["cached_tokens"],
                }
            )
    return out


def _summary(reqs: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(r["prompt_tokens"] for r in reqs)
    cached = sum(r["cached_tokens"] for r in reqs)
    return {
        "requests": len(reqs),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "generated_tokens": sum(r["completion_tokens"] for r in reqs),
    }


def run_workload(engine: Any, name: str, args: argparse.Namespace) -> tuple[float, list[dict], dict]:
    backend = RecordingBackend(engine)
    engine.flush_cache()
    t = time.perf_counter()
    if name == "few_shot":
        batch = [{"country": c} for c, _ in (CAPITAL_QUESTIONS * 2)[: args.questions]]
        states = capital_qa.run_batch(batch, temperature=0, backend=backend, progress_bar=args.progress)
        elapsed = time.perf_counter() - t
        answers = [(CAPITAL_QUESTIONS * 2)[i][1] for i in range(args.questions)]
        extra = {
            "correct": sum(st["answer"].strip() == a for st, a in zip(states, answers)),
            "programs": len(states),
            "errors": sum(st.error() is not None for st in states),
        }
        prog = [st.get_meta_info("answer") for st in states]
        p, c = sum(m["prompt_tokens"] for m in prog), sum(m["cached_tokens"] for m in prog)
        extra["program_cache_hit_rate"] = c / p if p else 0.0  # the 64 generations alone
    else:
        st = tree_of_thought.run(question=TOT_QUESTION, width=args.tot_width, depth=args.tot_depth, backend=backend)
        elapsed = time.perf_counter() - t
        extra = {"leaves": len(st.ret_value or []), "errors": int(st.error() is not None)}
    return elapsed, _requests(backend.log), extra


def hf_replay(model: Any, tokenizer: Any, reqs: list[dict[str, Any]]) -> float:
    import torch

    t = time.perf_counter()
    with torch.inference_mode():
        for r in reqs:
            ids = r["input_ids"] if r["input_ids"] is not None else tokenizer.encode(r["text"])
            x = torch.tensor([ids])
            k = r["completion_tokens"]
            if k == 0:
                torch.log_softmax(model(x).logits.float(), dim=-1)
            else:
                model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=k,
                    min_new_tokens=k,
                    do_sample=False,
                    pad_token_id=tokenizer.eos_token_id,
                )
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.programs",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument("--model", default="default")
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--tot-width", type=int, default=4)
    ap.add_argument("--tot-depth", type=int, default=2)
    ap.add_argument("--workloads", default="tree_of_thought,few_shot")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--no-cache-off", action="store_true", help="skip the radix-cache-off run")
    ap.add_argument("--progress", action="store_true", help="show run_batch's progress bar")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from radixrt.engine import Engine

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    results: dict[str, dict[str, Any]] = {w: {} for w in workloads}
    recorded: dict[str, list[dict]] = {}

    engine = Engine(model_path=args.model)
    model_path = engine.model_path
    try:
        capital_qa.run(country="France", temperature=0, backend=EngineBackend(engine))  # warm-up
        for w in workloads:
            elapsed, reqs, extra = run_workload(engine, w, args)
            recorded[w] = reqs
            results[w].update({"radixrt_s": elapsed, **_summary(reqs), **extra})
            print(
                f"[radixrt] {w}: {elapsed:.2f}s, {len(reqs)} requests, cache hit {results[w]['cache_hit_rate']:.1%}",
                file=sys.stderr,
            )
    finally:
        engine.shutdown()

    if not args.no_cache_off:
        engine = Engine(model_path=args.model, disable_radix_cache=True)
        try:
            capital_qa.run(country="France", temperature=0, backend=EngineBackend(engine))
            for w in workloads:
                elapsed, _, _ = run_workload(engine, w, args)
                results[w]["radixrt_cache_off_s"] = elapsed
                print(f"[radixrt, cache off] {w}: {elapsed:.2f}s", file=sys.stderr)
        finally:
            engine.shutdown()

    if not args.no_hf:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        hf_replay(model, tok, recorded[workloads[0]][:2])  # warm-up
        for w in workloads:
            results[w]["hf_generate_s"] = hf_replay(model, tok, recorded[w])
            print(f"[transformers] {w}: {results[w]['hf_generate_s']:.2f}s", file=sys.stderr)

    _print_report(results, workloads, model_path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _print_report(results: dict[str, dict[str, Any]], workloads: list[str], model_path: str) -> None:
    """The table of timings per workload (adding the speedups to ``results``) and the few-shot line."""
    print(f"\nradixrt program benchmark ({model_path}, torch threads={_threads()})")
    header = (
        f"{'workload':<16}{'requests':>9}{'radixrt s':>11}{'cache off s':>13}{'HF s':>9}"
        f"{'HF/radixrt':>12}{'off/on':>8}{'hit rate':>10}"
    )
    print(header)
    print("-" * len(header))
    for w in workloads:
        r = results[w]
        off = r.get("radixrt_cache_off_s")
        hf = r.get("hf_generate_s")
        r["speedup_vs_hf"] = hf / r["radixrt_s"] if hf else None
        r["speedup_vs_cache_off"] = off / r["radixrt_s"] if off else None
        cells = [
            f"{off:.2f}" if off else "-",
            f"{hf:.2f}" if hf else "-",
            f"{r['speedup_vs_hf']:.2f}x" if hf else "-",
            f"{r['speedup_vs_cache_off']:.2f}x" if off else "-",
        ]
        print(
            f"{w:<16}{r['requests']:>9}{r['radixrt_s']:>11.2f}{cells[0]:>13}{cells[1]:>9}{cells[2]:>12}"
            f"{cells[3]:>8}{r['cache_hit_rate']:>10.1%}"
        )
    if "few_shot" in results:
        fs = results["few_shot"]
        print(
            f"\nfew-shot: {fs['correct']}/{fs['programs']} correct; cache hit rate over the "
            f"{fs['programs']} generations {fs['program_cache_hit_rate']:.1%} "
            f"(over all {fs['requests']} requests incl. the prefix prefill {fs['cache_hit_rate']:.1%})"
        )


def _threads() -> int:
    try:
        import torch

        return torch.get_num_threads()
    except ImportError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
