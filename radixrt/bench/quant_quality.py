"""Weight-only quantization (``--quantization``): quality and speed against float32, in one run.

    python -m radixrt.bench.quant_quality                      # embedded model: float32, int8, int4
    python -m radixrt.bench.quant_quality --formats int8 --prompts 4 --repeats 1
    python -m radixrt.bench.quant_quality --json

For each format (``float32``, then ``int8``, ``int4``, ``int4+head`` = int4 with
``--quantize-lm-head``, ``int8+head``; ``int4-G`` for another group size; the
quantized formats run with ``dtype`` auto, as a user's would: float32, with the
prefill products in bfloat16 where auto picks it on this CPU):

1. **Greedy agreement** with float32 on the first ``--prompts`` prompts of
   ``data/kv_quality_prompts.txt`` (chat template), ``--tokens`` greedy tokens
   each. ``free`` runs the format's own greedy decoding and counts the
   positions where its token equals float32's at the same position (after a
   first difference the two texts usually part, so this is strict);
   ``forced`` is teacher-forced: the format reads prompt + float32's answer
   and its top-1 is compared with float32's token at each position
   (radixrt.bench.kv_quality's method).
2. **Perplexity** on held-out text that ships with Python
   (``pydoc_data.topics``: the topics in sorted order, the first ``--ppl-tokens``
   tokens) in ``--window``-token windows, each computed ``--chunk`` tokens per
   forward (default 128: below 256 rows the native kernel runs its decode path,
   int8 activations included; 0 computes a window at once, the dense path);
   ``dppl`` against float32.
3. **Tokens/s through ``Engine.generate``**: batch 1 (a 128-token prompt, 128
   greedy tokens, ``ignore_eos``) and batch 16 (16 different 256-token
   prompts, 64 tokens each, one call); the median of ``--repeats`` runs after
   a short warm-up, output tokens over wall time (prefill included).

``--kernels`` times the linear layers alone instead: every linear of the
embedded model's 30 layers per decode step, at 1, 4 and 16 rows, for
float32 ``F.linear``, torch's packed int8 and int4 kernels and the native
kernel (kernels/quant_linear_cpu.py).

The load average is printed with the figures: the CPU machine is shared.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from radixrt.bench.kv_quality import encode_prompt, greedy_answers, load_prompts, perplexity, teacher_forced
from radixrt.help_format import HelpFormatter

FORMATS = ("float32", "int8", "int4", "int4+head")


@dataclass
class QuantRow:
    format: str
    weight_mb: float  # the linear layers' weights as stored (float32 for the float32 row)
    free_agreement: float
    forced_agreement: float
    perplexity: float
    perplexity_change: float
    tok_s_batch1: float
    tok_s_batch16: float


def engine_flags(fmt: str) -> dict[str, Any]:
    """``Engine`` keywords of a format name of the module docstring."""
    if fmt == "float32":
        return {"dtype": "float32"}
    base, _, head = fmt.partition("+")
    method, _, group = base.partition("-")
    # dtype auto: the quantized model computes in float32, its prefill products in what auto means here
    flags: dict[str, Any] = {"quantization": method, "quantize_lm_head": head == "head"}
    if group:
        flags["quantization_group_size"] = int(group)
    return flags


def heldout_text_ids(tokenizer: Any, n: int) -> list[int]:
    """The first ``n`` tokens of ``pydoc_data.topics`` (its topics in sorted order)."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for key in sorted(topics):
        ids.extend(int(t) for t in tokenizer.encode(topics[key]))
        if len(ids) >= n:
            break
    return ids[:n]


def _linear_mb(model: Any) -> float:
    from radixrt.executor.models.quantized_linear import LAYER_LINEARS, QuantizedLinear

    total = 0
    for layer in model.model.layers:
        for name in LAYER_LINEARS:
            m = layer.get_submodule(name)
            total += m.packed.nbytes() if isinstance(m, QuantizedLinear) else m.weight.numel() * m.weight.element_size()
    return total / 1e6


def _timed(fn: Any, repeats: int, clock: Any = time.perf_counter) -> float:
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def speed(engine: Any, repeats: int) -> tuple[float, float]:
    """(tokens/s at batch 1, tokens/s at batch 16) through ``engine.generate``."""
    import random

    rng = random.Random(0)

    def run(batch: int, prompt_len: int, n: int) -> None:
        """Fresh random prompts each run: no prefix-cache hit, the prefill is part of the time."""
        ids = [[rng.randrange(100, 49000) for _ in range(prompt_len)] for _ in range(batch)]
        params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        out = engine.generate(input_ids=ids, sampling_params=params)
        assert all(len(o["output_ids"]) == n for o in out)

    run(2, 16, 8)  # warm-up
    t1 = _timed(lambda: run(1, 128, 128), repeats)
    t16 = _timed(lambda: run(16, 256, 64), repeats)
    return 128 / t1, 16 * 64 / t16


def measure(fmt: str, args: argparse.Namespace, ref: Optional[dict[str, Any]]) -> tuple[QuantRow, dict[str, Any]]:
    """One format's row; ``ref`` is float32's state (None while measuring float32 itself)."""
    from radixrt.engine import Engine

    engine = Engine(model_path=args.model, max_total_tokens=8192, **engine_flags(fmt))
    nan = float("nan")
    try:
        runner = engine.scheduler.runner
        free = forced = ppl = nan
        if args.only != "speed":
            ref, free, forced, ppl = _quality(runner, args, ref)
        tok1, tok16 = speed(engine, args.repeats) if args.only != "quality" else (nan, nan)
        row = QuantRow(
            fmt, _linear_mb(runner.model), free, forced, ppl, ppl / ref["ppl"] - 1.0 if ref else nan, tok1, tok16
        )
    finally:
        engine.shutdown()
    return row, ref


def _quality(runner: Any, args: argparse.Namespace, ref: Optional[dict[str, Any]]) -> tuple[dict, float, float, float]:
    """(float32's state, free agreement, teacher-forced agreement, perplexity) of ``runner``'s format."""
    import torch

    with torch.inference_mode():
        if ref is None:  # this is float32: the reference answers are its own
            prompts = [encode_prompt(runner.tokenizer, p) for p in load_prompts()[: args.prompts]]
            ref = {"prompts": prompts, "text": heldout_text_ids(runner.tokenizer, args.ppl_tokens)}
            ref["answers"] = answers = greedy_answers(runner, prompts, args.tokens, 2048)
        else:
            answers = greedy_answers(runner, ref["prompts"], args.tokens, 2048)
        top, _ = teacher_forced(runner, ref["prompts"], ref["answers"], 2048)
        ppl = perplexity(runner, ref["text"], args.window, args.chunk)
    ref.setdefault("ppl", ppl)
    target = [t for a in ref["answers"] for t in a]
    same = sum(int(a == b) for x, y in zip(answers, ref["answers"]) for a, b in zip(x, y))
    return ref, same / len(target), float((top == torch.tensor(target)).float().mean()), ppl


def _step_fns(xs: dict, xb: dict, weights: list, packed: dict, torch_args: dict, native: Any) -> dict[str, Any]:
    """One decode step's linear layers per kernel, as callables (activations by input size)."""
    import torch

    from radixrt.kernels import quant_linear_cpu as ql

    fns = {
        "float32 F.linear": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
        "torch int8 (bf16 act)": lambda: [
            torch.ops.aten._weight_int8pack_mm(xb[a[0].shape[1]], *a) for a in torch_args[8]
        ],
        "torch int4 (bf16 act)": lambda: [
            torch.ops.aten._weight_int4pack_mm_for_cpu(xb[p.in_features], *a) for p, a in zip(packed[4], torch_args[4])
        ],
    }
    if native is None:
        return fns
    for bits in (8, 4):
        layouts = {"rows": packed[bits]}
        if native.tiles:  # the AVX-512 VNNI layout the model runs (quant_linear_cpu.to_tiles)
            layouts["tiles"] = [ql.to_tiles(p) for p in packed[bits]]
        for layout, ps in layouts.items():
            fns[f"native int{bits} {layout}"] = lambda ps=ps: [native.linear(xs[p.in_features], p) for p in ps]
    return fns


def kernel_times(rows: tuple[int, ...] = (1, 4, 16), repeats: int = 5, cpu_time: bool = False) -> list[dict[str, Any]]:
    """ms per decode step for all the embedded model's linear layers (30 layers of distinct random
    weights, so that they come from memory as in a step) per kernel and row count: the median of
    ``repeats`` after one untimed pass. ``cpu_time``: one thread, timed by its CPU time (what other
    jobs on a shared machine take does not count), instead of wall time on torch's threads."""
    import torch

    if cpu_time:
        torch.set_num_threads(1)
    clock = time.thread_time if cpu_time else time.perf_counter

    from radixrt.executor.models.quantized_linear import _torch_format
    from radixrt.kernels import quant_linear_cpu as ql

    native = ql.load()
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
    weights = [torch.randn(n, k) * 0.02 for _ in range(30) for n, k in shapes]
    packed = {8: [ql.quantize_int8(w) for w in weights], 4: [ql.quantize_int4(w, 32) for w in weights]}
    torch_args = {bits: [_torch_format(p) for p in ps] for bits, ps in packed.items()}
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        xb = {k: x.bfloat16() for k, x in xs.items()}
        kernels = _step_fns(xs, xb, weights, packed, torch_args, native)
        for name, fn in kernels.items():
            fn()
            out.append({"rows": m, "kernel": name, "ms": 1e3 * _timed(fn, repeats, clock)})
    return out


def format_table(rows: list[QuantRow], args: argparse.Namespace, load: str) -> str:
    head = ("format", "linear MB", "free agree", "forced agree", "perplexity", "dppl", "tok/s b=1", "tok/s b=16")
    body = [
        (
            r.format,
            f"{r.weight_mb:.1f}",
            f"{100 * r.free_agreement:.1f}%",
            f"{100 * r.forced_agreement:.1f}%",
            f"{r.perplexity:.3f}",
            f"{100 * r.perplexity_change:+.2f}%",
            f"{r.tok_s_batch1:.1f}",
            f"{r.tok_s_batch16:.1f}",
        )
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in [head, *body]
    ]
    note = (
        f"{args.prompts} prompts x {args.tokens} greedy tokens; perplexity: first {args.ppl_tokens} tokens of "
        f"pydoc_data.topics in {args.window}-token windows, {args.chunk or args.window} tokens per forward; "
        f"tok/s: median of {args.repeats}; load average {load}"
    )
    return "\n".join(lines + [note])


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.quant_quality",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default="default", help="'default' (the embedded model) or a model folder")
    p.add_argument("--formats", default=",".join(FORMATS[1:]), help="formats to compare with float32, comma-separated")
    p.add_argument("--prompts", type=int, default=16, help="prompts from data/kv_quality_prompts.txt")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--ppl-tokens", type=int, default=4096, help="held-out tokens for the perplexity")
    p.add_argument("--window", type=int, default=1024, help="perplexity window in tokens")
    p.add_argument(
        "--chunk",
        type=int,
        default=128,
        help="tokens per forward within a perplexity window (below 256: the quantized kernels' decode path; "
        "0: the whole window at once)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per speed figure (0: no speed figures)")
    p.add_argument("--only", choices=("quality", "speed"), default=None, help="one half of the figures")
    p.add_argument(
        "--kernels", action="store_true", help="only time the linear kernels per decode step (1, 4, 16 rows)"
    )
    p.add_argument("--cpu-time", action="store_true", help="with --kernels: one thread, timed by its CPU time")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    if args.kernels:
        found = kernel_times(cpu_time=args.cpu_time)
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        for r in found:
            print(json.dumps(r) if args.json else f"rows {r['rows']:>2}  {r['kernel']:<22} {r['ms']:7.1f} ms")
        print(f"threads {__import__('torch').get_num_threads()}; load average {load}")
        return 0
    formats = ["float32"] + [f.strip() for f in args.formats.split(",") if f.strip() and f.strip() != "float32"]
    rows: list[QuantRow] = []
    ref: Optional[dict[str, Any]] = None
    for fmt in formats:
        row, ref = measure(fmt, args, ref)
        rows.append(row)
        if not args.json:
            print(f"# {fmt}: done", flush=True)
        gc.collect()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "load_average": load}, indent=2))
    else:
        print(format_table(rows, args, load))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
