"""LoRA adapters: decode throughput as a batch mixes more adapters, and
activated LoRA's time to first token on a long shared history.

    python -m radixrt.bench.lora                  # embedded model, 32 requests, rank 16
    python -m radixrt.bench.lora --requests 8 --tokens 16 --history 500
    radixrt bench --lora

Adapters are made once with ``peft`` (the ``test`` extra) over the model:
random rank-``--rank`` adapters of every projection, kept under
``$RADIXRT_HOME/bench-lora/``. Everything runs through `Engine.generate`.

1. **Throughput by adapters**: ``--requests`` requests (distinct
   ``--prompt-tokens`` prompts, ``--tokens`` greedy tokens each, EOS ignored)
   sent as one batch with 0 (the base model), 1, 2, 4 and 8 distinct adapters
   dealt round robin; tokens per second of the whole batch and of its decode
   alone (the batch's wall time less that of the same batch for one token;
   medians of ``--repeats``, the cache flushed before each), and their ratios
   to the base.
2. **Activated LoRA**: a ``--history``-token conversation the base model has
   already read (it is in the radix cache), then one request with an
   activated adapter (its invocation tokens appended) against the same
   request with a plain adapter: time to first token of each. The activated
   adapter reuses the base model's KV of the history; the plain one computes
   it under its own weights.

Not a timed test; the default run takes a few minutes on the 2-core CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from radixrt.bench.common import report_out
from radixrt.help_format import HelpFormatter

INVOCATION = "<|assistant_review|>"


def make_adapters(model_path: str, count: int, rank: int, alora_ids: list[int]) -> dict[str, str]:
    """``count`` plain adapters and one activated one (``alora``) for the model, made once."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise SystemExit("python -m radixrt.bench.lora makes its adapters with peft: pip install peft") from None
    root = Path(os.environ.get("RADIXRT_HOME", "~/.cache/radixrt")).expanduser() / "bench-lora"
    tag = f"{Path(model_path).name}-r{rank}"
    names = {f"a{i}": root / f"{tag}-a{i}" for i in range(count)}
    names["alora"] = root / f"{tag}-alora-{'-'.join(map(str, alora_ids))}"
    for name, folder in names.items():
        if not (folder / "adapter_config.json").is_file():
            _make(model_path, folder, rank, seed=sum(map(ord, name)), alora=alora_ids if name == "alora" else None)
    return {n: str(f) for n, f in names.items()}


def _make(model_path: str, out: Path, rank: int, seed: int, alora: Optional[list[int]]) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    kw = {"alora_invocation_tokens": alora} if alora else {}
    cfg = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False, **kw)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.01)
    peft_model.save_pretrained(str(out))


def throughput(engine: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Tokens/s of the whole batch (prefill included) and of its decode alone: the same
    batch for one token subtracted (what the decode steps took). The adapter counts take
    turns within each repeat, so the machine's drift spreads over all of them."""
    prompts = [[(17 * i + 31 * j) % 20000 + 100 for j in range(args.prompt_tokens)] for i in range(args.requests)]
    counts = (0, 1, 2, 4, 8)
    walls: dict[tuple[int, int], list[float]] = {(k, n): [] for k in counts for n in (1, args.tokens)}
    for _ in range(args.repeats):
        for k, tokens in walls:
            loras = [None if k == 0 else f"a{i % k}" for i in range(args.requests)]
            engine.flush_cache()
            params = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
            t = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params=params, lora_path=loras)
            walls[(k, tokens)].append(time.perf_counter() - t)
    rows = []
    for k in counts:
        wall, first = statistics.median(walls[(k, args.tokens)]), statistics.median(walls[(k, 1)])
        rows.append(
            {
                "adapters": k,
                "wall_s": round(wall, 2),
                "tokens_per_s": round(args.requests * args.tokens / wall, 1),
                "decode_tokens_per_s": round(args.requests * (args.tokens - 1) / max(wall - first, 1e-9), 1),
            }
        )
    for r in rows:
        r["vs_base"] = round(r["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
        r["decode_vs_base"] = round(r["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"], 3)
    return rows


def activated(engine: Any, args: argparse.Namespace, invocation: list[int]) -> dict[str, Any]:
    history = [(13 * j) % 20000 + 200 for j in range(args.history)]
    question = invocation + [300, 301, 302]
    one = {"max_new_tokens": 1, "temperature": 0.0}
    engine.flush_cache()
    engine.generate(input_ids=history, sampling_params=one)  # the base model reads the history
    out = {}
    for name, lora in (("activated (aLoRA)", "alora"), ("plain LoRA", "a0")):
        t = time.perf_counter()
        r = engine.generate(input_ids=history + question, sampling_params=one, lora_path=lora)
        out[name] = {"ttft_s": round(time.perf_counter() - t, 3), "cached_tokens": r["meta_info"]["cached_tokens"]}
    out["speedup"] = round(out["plain LoRA"]["ttft_s"] / out["activated (aLoRA)"]["ttft_s"], 1)
    return out


def render(report: dict[str, Any]) -> str:
    lines = [
        f"{report['requests']} requests x {report['tokens']} tokens, rank {report['rank']}: "
        "adapters, tok/s (whole batch), vs base, decode tok/s, vs base"
    ]
    for r in report["throughput"]:
        lines.append(
            f"  {r['adapters']:>2}  {r['tokens_per_s']:>8.1f}  {r['vs_base']:.3f}  "
            f"{r['decode_tokens_per_s']:>8.1f}  {r['decode_vs_base']:.3f}"
        )
    a = report["activated"]
    lines.append(f"activated LoRA on a {report['history']}-token history the base model read: time to first token")
    for name in ("activated (aLoRA)", "plain LoRA"):
        lines.append(f"  {name:<18} {a[name]['ttft_s']:.3f} s (cached {a[name]['cached_tokens']} tokens)")
    lines.append(f"  activated is {a['speedup']}x faster")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.lora",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default=None)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--history", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import radixrt
    from radixrt.executor.model_store import resolve_model_path
    from radixrt.requests.tokenizer_utils import load_tokenizer

    model_path = resolve_model_path(args.model)
    invocation = list(load_tokenizer(model_path).encode(INVOCATION, add_special_tokens=False))
    adapters = make_adapters(model_path, 8, args.rank, invocation)
    flags = {"dtype": args.dtype} if args.dtype else {}
    paths = [f"{n}={f}" for n, f in adapters.items()]
    with radixrt.Engine(model_path, lora_paths=paths, max_loras_per_batch=8, **flags) as engine:
        report = {
            "requests": args.requests,
            "tokens": args.tokens,
            "rank": args.rank,
            "history": args.history,
            "throughput": throughput(engine, args),
            "activated": activated(engine, args, invocation),
        }
    return report_out(report, render(report), args.json)


if __name__ == "__main__":
    sys.exit(main())
