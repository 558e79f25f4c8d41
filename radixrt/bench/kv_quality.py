"""Quality of a quantized KV cache against the unquantized one.

    python -m radixrt.bench.kv_quality                       # embedded model, CPU, every kv_cache_dtype
    python -m radixrt.bench.kv_quality --dtypes int8 --prompts 10 --tokens 32
    python -m radixrt.bench.kv_quality --device cuda --model PATH --json

For each ``kv_cache_dtype`` a model runner is built with that KV pool (the
same weights, the same attention backend), and three figures are taken:

1. **Teacher-forced agreement.** The unquantized model (``auto``) answers
   each prompt of ``data/kv_quality_prompts.txt`` (chat template, greedy,
   ``--tokens`` tokens). Every runner then reads prompt + answer in one
   prefill, in which attention reads K/V back from its pool (quantized for
   int8/fp8, see ``kernels/kv_cache.py``), and predicts each answer token from
   the tokens before it, so runs are compared position by position on the
   same tokens. ``top-1`` is the share of positions where the runner's most
   likely token is the answer's token (the ``auto`` row checks the method:
   prefill and decode agree); ``|dlogprob|`` is the mean absolute difference
   of the log-probability of the answer's token against ``auto``'s, and
   ``max`` its largest value.
2. **Perplexity** on ``data/kv_quality_text.txt`` (a public-domain text
   shipped with radixrt), read in ``--window``-token windows; ``dppl`` is the
   change against ``auto``.
3. **Size**: bytes per token (scales included) and tokens per GiB, from the
   runner's pool (`KVPool.footprint`, the arithmetic ``radixrt plan`` and the
   server report).

Not a timed benchmark; on the 2-core CPU it takes a few minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from radixrt.help_format import HelpFormatter

DATA = Path(__file__).resolve().parent / "data"
PROMPTS_FILE = DATA / "kv_quality_prompts.txt"
TEXT_FILE = DATA / "kv_quality_text.txt"
ALL_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")


@dataclass
class QualityRow:
    kv_cache_dtype: str
    bytes_per_token: float
    scale_bytes_per_token: int
    tokens_per_gib: int
    positions: int
    top1_agreement: float
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    perplexity: float
    perplexity_change: float  # relative to auto
    seconds: float


def load_prompts(path: Path = PROMPTS_FILE) -> list[str]:
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """The chat template's user turn (and the assistant's opening) when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer.encode(text)]


def _runner(model: str, device: str, kv_cache_dtype: str, max_tokens: int, dtype: str) -> Any:
    from radixrt.config import EngineConfig
    from radixrt.executor.model_runner import ModelRunner

    cfg = EngineConfig(
        model_path=model,
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_total_tokens=max_tokens,
        disable_cuda_graph=True,
        max_running_requests=64,
    )
    return ModelRunner.from_config(cfg)


def _batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped so that each group's total length stays within ``budget``."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if groups[-1] and used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def greedy_answers(runner: Any, prompts: list[list[int]], n: int, budget: int) -> list[list[int]]:
    """Greedy continuations of ``n`` tokens (EOS not special: the comparison needs the same length),
    decoding a group of prompts together over consecutive slot ranges."""
    import torch

    answers: list[list[int]] = [[] for _ in prompts]
    for group in _batches([len(p) + n for p in prompts], budget):
        seqs = [list(prompts[i]) for i in group]
        bases, off = [], 0
        for s in seqs:
            bases.append(off)
            off += len(s) + n
        ids = [t for s in seqs for t in s]
        q_lens = [len(s) for s in seqs]
        for _ in range(n):
            slots = [list(range(b, b + len(s))) for b, s in zip(bases, seqs)]
            hidden = runner.forward(ids, slots, q_lens)
            last = torch.tensor(q_lens).cumsum(0) - 1
            nxt = runner.logits(hidden[last.to(hidden.device)]).argmax(-1).tolist()
            for s, t in zip(seqs, nxt):
                s.append(int(t))
            ids, q_lens = [int(t) for t in nxt], [1] * len(seqs)
        for i, s in zip(group, seqs):
            answers[i] = s[len(prompts[i]) :]
    return answers


def teacher_forced(runner: Any, prompts: list[list[int]], answers: list[list[int]], budget: int) -> tuple[Any, Any]:
    """(argmax [P], log-probability of the answer's token [P]) over every answer position P, in order."""
    import torch

    seqs = [p + a for p, a in zip(prompts, answers)]
    top: list[Any] = []
    lps: list[Any] = []
    for group in _batches([len(s) for s in seqs], budget):
        slots, off, ids, rows, targets = [], 0, [], [], []
        for i in group:
            s = seqs[i]
            slots.append(list(range(off, off + len(s))))
            start = len(ids)
            ids.extend(s)
            p = len(prompts[i])
            rows.extend(range(start + p - 1, start + len(s) - 1))  # position j predicts token j + 1
            targets.extend(s[p:])
            off += len(s)
        hidden = runner.forward(ids, slots, [len(seqs[i]) for i in group])
        rows_t = torch.tensor(rows, device=hidden.device)
        tgt = torch.tensor(targets, device=hidden.device)
        for a in range(0, len(rows), 256):
            logp = torch.log_softmax(runner.logits(hidden[rows_t[a : a + 256]]).float(), -1)
            top.append(logp.argmax(-1).cpu())
            lps.append(logp.gather(1, tgt[a : a + 256, None]).squeeze(1).cpu())
    return torch.cat(top), torch.cat(lps)


def perplexity(runner: Any, tokens: list[int], window: int, chunk: int = 0) -> float:
    """exp(mean NLL) over non-overlapping windows (each window's first token is not predicted).
    ``chunk`` > 0: each window is computed ``chunk`` tokens per forward over the KV of the ones
    before (decode-sized forwards: what a quantized kernel's small-row path computes)."""
    import torch

    nll, count = 0.0, 0
    step = chunk if chunk > 0 else window
    for a in range(0, len(tokens) - 1, window):
        w = tokens[a : a + window]
        if len(w) < 2:
            break
        tgt = torch.tensor(w[1:])
        for c in range(0, len(w) - 1, step):
            part = w[c : c + step]
            hidden = runner.forward(part, [list(range(c + len(part)))], [len(part)])
            rows = min(len(part), len(w) - 1 - c)  # the window's last token predicts nothing
            for b in range(0, rows, 256):
                logp = torch.log_softmax(runner.logits(hidden[b : min(b + 256, rows)]).float(), -1).cpu()
                nll -= float(logp.gather(1, tgt[c + b : c + min(b + 256, rows), None]).sum())
        count += len(w) - 1
    return math.exp(nll / count)


def run(
    model: str = "default",
    device: str = "cpu",
    dtypes: tuple[str, ...] = ALL_DTYPES,
    num_prompts: int = 50,
    tokens: int = 64,
    window: int = 1024,
    budget: int = 2048,
    dtype: str = "auto",
    log: Optional[Any] = print,
) -> list[QualityRow]:
    """The table's rows, ``auto`` first (it is the reference and is added when missing)."""
    import torch

    dtypes = ("auto",) + tuple(d for d in dtypes if d != "auto")
    prompt_texts = load_prompts()[:num_prompts]
    text = TEXT_FILE.read_text(encoding="utf-8")
    max_tokens = max(window, budget) + tokens + 8
    rows: list[QualityRow] = []
    ref_lp: Any = None
    ref_ppl = float("nan")
    prompts: list[list[int]] = []
    answers: list[list[int]] = []
    text_ids: list[int] = []
    for name in dtypes:
        t0 = time.perf_counter()
        runner = _runner(model, device, name, max_tokens, dtype)
        if name == "auto":
            prompts = [encode_prompt(runner.tokenizer, p) for p in prompt_texts]
            text_ids = [int(t) for t in runner.tokenizer.encode(text)]
            answers = greedy_answers(runner, prompts, tokens, budget)
        top, lp = teacher_forced(runner, prompts, answers, budget)
        ppl = perplexity(runner, text_ids, window)
        if name == "auto":
            ref_lp, ref_ppl = lp, ppl
        target = [t for a in answers for t in a]
        diff = (lp - ref_lp).abs()
        fp = runner.kv_pool.footprint
        rows.append(
            QualityRow(
                kv_cache_dtype=name if name != "auto" else f"auto ({fp.format.name})",
                bytes_per_token=fp.bytes_per_token,
                scale_bytes_per_token=fp.scale_bytes_per_token,
                tokens_per_gib=fp.tokens_per_gib,
                positions=int(top.numel()),
                top1_agreement=float((top == torch.tensor(target)).float().mean()),
                mean_abs_logprob_diff=float(diff.mean()),
                max_abs_logprob_diff=float(diff.max()),
                perplexity=ppl,
                perplexity_change=ppl / ref_ppl - 1.0,
                seconds=time.perf_counter() - t0,
            )
        )
        if log is not None:
            log(f"# {rows[-1].kv_cache_dtype}: done in {rows[-1].seconds:.0f} s", flush=True)
        del runner
        gc.collect()
    return rows


def format_table(rows: list[QualityRow], prompts: int, tokens: int) -> str:
    head = (
        "kv_cache_dtype",
        "B/token",
        "scales",
        "tokens/GiB",
        "x auto",
        "top-1",
        "|dlogprob|",
        "max",
        "perplexity",
        "dppl",
    )
    ref = rows[0]
    body = [
        (
            r.kv_cache_dtype,
            f"{r.bytes_per_token:,.0f}",
            f"{r.scale_bytes_per_token:,}",
            f"{r.tokens_per_gib:,}",
            f"{r.tokens_per_gib / ref.tokens_per_gib:.2f}x",
            f"{r.top1_agreement:.4f}",
            f"{r.mean_abs_logprob_diff:.4f}",
            f"{r.max_abs_logprob_diff:.3f}",
            f"{r.perplexity:.4f}",
            f"{100 * r.perplexity_change:+.2f}%",
        )
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
        for line in [head, *body]
    ]
    note = (
        f"{prompts} prompts x {tokens} greedy tokens of the unquantized model, teacher-forced "
        f"({ref.positions} positions); perplexity on {TEXT_FILE.name}"
    )
    return "\n".join(lines + [note])


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.kv_quality",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default="default", help="'default' (the embedded model) or a model folder")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="model dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument(
        "--dtypes", default=",".join(ALL_DTYPES[1:]), help="kv_cache_dtypes to compare with auto, comma-separated"
    )
    p.add_argument("--prompts", type=int, default=50, help="prompts from data/kv_quality_prompts.txt (at most 50)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--window", type=int, default=1024, help="perplexity window in tokens")
    p.add_argument("--budget", type=int, default=2048, help="most tokens in one forward")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    rows = run(
        args.model,
        args.device,
        dtypes,
        args.prompts,
        args.tokens,
        args.window,
        args.budget,
        args.dtype,
        log=None if args.json else print,
    )
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(format_table(rows, min(args.prompts, len(load_prompts())), args.tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
