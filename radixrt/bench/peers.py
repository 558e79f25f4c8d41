"""``radixrt bench --peers``: radixrt beside the engines people run on a CPU
today, on the same model, the same token ids and the same machine, in one run.

    radixrt bench --peers                                   # float32, bfloat16, llama.cpp, transformers
    radixrt bench --peers --radixrt-config quantization=int8 --radixrt-config quantization=int4
    python -m radixrt.bench.peers --help

Workloads (greedy, ``ignore_eos``, every request makes exactly its tokens):

* ``one conversation``: one 128-token prompt, 128 tokens (tokens/s);
* ``16 unshared``: 16 requests with different 256-token prompts, 64 tokens each
  (tokens/s; radixrt takes them as one batch, the peers one after another);
* ``32 shared prefix``: 32 requests sharing a 1,024-token prefix (each with 16
  tokens of its own), 32 tokens each (wall seconds; llama.cpp, one after
  another, reuses the prefix it still holds from the previous request).

Systems: radixrt once per ``--radixrt-config`` (``dtype=...,quantization=...``:
EngineConfig fields; a bare word is a dtype; default float32, bfloat16 and
int8 weights with the LM head, the format nearest llama.cpp's Q4_1 file in bytes),
each on a fresh radix cache per workload; llama.cpp through llama-cpp-python
(``pip install 'radixrt[peers]'``) on a GGUF of the same model (the embedded
model's own Q4_1 file, `default_model_gguf`, or ``--gguf``), ``--llama-threads``
threads, skipped with a note when either is missing; the transformers
``generate`` loop in float32, one request at a time (not on the shared-prefix
workload, where it would take minutes). Times include prefill: they are what a
caller waits for. Each system runs a short warm-up first; a radixrt row with
``enable_torch_compile`` also runs each workload once untimed (two tokens each), so
that compilation, paid once per shape, falls outside the timed runs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from radixrt.bench.common import HFGenerate, words
from radixrt.help_format import HelpFormatter

DEFAULT_CONFIGS = ("dtype=float32", "dtype=bfloat16", "quantization=int8,quantize_lm_head=true")
SHARED = "32 shared prefix"


@dataclass
class PeerWorkload:
    name: str
    prompts: list[list[int]]
    new_tokens: int
    metric: str  # "tok/s" (higher is better) or "s" (wall seconds, lower is better)
    transformers: bool = True  # whether the transformers loop runs it


@dataclass
class PeerRow:
    system: str
    results: dict[str, float] = field(default_factory=dict)  # workload -> tok/s or s
    wall_s: dict[str, float] = field(default_factory=dict)
    note: str = ""


def _token_run(tokenizer: Any, rng: random.Random, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" " + words(rng, n), add_special_tokens=False)
    return ids[:n]


def make_workloads(tokenizer: Any, seed: int = 0, scale: float = 1.0) -> list[PeerWorkload]:
    """The three workloads; ``scale`` shrinks every length (tests use a small one)."""
    rng = random.Random(seed)

    def n(x: int) -> int:
        return max(1, int(x * scale))

    prefix = _token_run(tokenizer, rng, n(1024))
    return [
        PeerWorkload("one conversation", [_token_run(tokenizer, rng, n(128))], n(128), "tok/s"),
        PeerWorkload("16 unshared", [_token_run(tokenizer, rng, n(256)) for _ in range(16)], n(64), "tok/s"),
        PeerWorkload(
            SHARED, [prefix + _token_run(tokenizer, rng, 16) for _ in range(32)], n(32), "s", transformers=False
        ),
    ]


def parse_config(text: str) -> dict[str, Any]:
    """``"dtype=bfloat16,quantization=int8"`` (or a bare dtype) -> Engine keyword arguments,
    typed as the command line types them. Raises ValueError naming an unknown field."""
    from radixrt.config import EngineConfig

    parser = argparse.ArgumentParser(formatter_class=HelpFormatter, add_help=False)
    EngineConfig.add_cli_args(parser)
    actions = {a.dest: a for a in parser._actions}
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            key, value = "dtype", part
        key = key.strip().replace("-", "_")
        action = actions.get(key)
        if action is None:
            raise ValueError(f"--radixrt-config {text!r}: {key!r} is not an EngineConfig field")
        if action.nargs == 0:  # a switch
            out[key] = value.strip().lower() in ("1", "true", "yes", "on")
        else:
            out[key] = action.type(value) if callable(action.type) else value
    return out


def config_label(flags: dict[str, Any]) -> str:
    """``radixrt bfloat16 quantization=int8``: the dtype bare, other fields as key=value."""
    parts = [str(v) if k == "dtype" else f"{k}={v}" for k, v in flags.items()]
    return " ".join(["radixrt", *parts])


def _check(outs: Sequence[int], want: int, system: str) -> None:
    if any(o != want for o in outs):
        raise RuntimeError(f"{system}: every request must make {want} tokens, got {sorted(set(outs))}")


def run_radixrt(model: str, flags: dict[str, Any], workloads: list[PeerWorkload]) -> PeerRow:
    from radixrt.engine import Engine

    row = PeerRow(config_label(flags))
    engine = Engine(model, **flags)
    try:
        warm = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=[workloads[0].prompts[0][:32]], sampling_params=warm)
        # compiled layers compile per shape: each workload's prompt and decode shapes once, untimed
        for wl in workloads if flags.get("enable_torch_compile") else ():
            engine.flush_cache()
            engine.generate(input_ids=wl.prompts, sampling_params={**warm, "max_new_tokens": 2})
        for wl in workloads:
            engine.flush_cache()
            sampling = {"max_new_tokens": wl.new_tokens, "temperature": 0, "ignore_eos": True}
            start = time.perf_counter()
            outs = engine.generate(input_ids=wl.prompts, sampling_params=sampling)
            row.wall_s[wl.name] = time.perf_counter() - start
            _check([o["meta_info"]["completion_tokens"] for o in outs], wl.new_tokens, row.system)
    finally:
        engine.shutdown()
    return row


def run_llama_cpp(gguf: str, threads: int, workloads: list[PeerWorkload]) -> PeerRow:
    """llama.cpp, each request after the previous one on one context (which keeps
    the longest prefix a request shares with the one before)."""
    from llama_cpp import Llama

    context = max(len(p) for wl in workloads for p in wl.prompts) + max(wl.new_tokens for wl in workloads) + 16
    llm = Llama(gguf, n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)
    row = PeerRow(f"llama.cpp {gguf_kind(gguf)} ({threads} thread{'' if threads == 1 else 's'})")

    def one(prompt: list[int], n: int) -> int:
        made = 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0):
            made += 1
            if made == n:
                break
        return made

    one(workloads[0].prompts[0][:32], 4)  # warm-up
    for wl in workloads:
        llm.reset()  # nothing carried over from the previous workload
        start = time.perf_counter()
        made = [one(p, wl.new_tokens) for p in wl.prompts]
        row.wall_s[wl.name] = time.perf_counter() - start
        _check(made, wl.new_tokens, row.system)
    return row


def gguf_kind(path: str) -> str:
    """The quantization named in a GGUF file name (``...Q4_1.gguf`` -> ``Q4_1``), else ``GGUF``."""
    stem = path.rsplit("/", 1)[-1].removesuffix(".gguf")
    tail = stem.rsplit(".", 1)[-1]
    return tail if tail != stem else "GGUF"


def run_transformers(model: str, workloads: list[PeerWorkload]) -> PeerRow:
    hf = HFGenerate(model, batch_size=1)
    row = PeerRow("transformers generate (float32)")
    hf.run([[(workloads[0].prompts[0][:32], 4)]])  # warm-up
    for wl in workloads:
        if wl.transformers:
            row.wall_s[wl.name] = hf.run([[(p, wl.new_tokens) for p in wl.prompts]])
    return row


def finish(row: PeerRow, workloads: list[PeerWorkload]) -> PeerRow:
    """Fill ``results`` from ``wall_s``: tokens/s or seconds, by each workload's metric."""
    for wl in workloads:
        wall = row.wall_s.get(wl.name)
        if wall is not None:
            row.results[wl.name] = wall if wl.metric == "s" else len(wl.prompts) * wl.new_tokens / wall
    return row


def llama_cpp_gguf(model: str, gguf: Optional[str]) -> tuple[Optional[str], str]:
    """(the GGUF llama.cpp runs, or None with the reason it is skipped)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None, "llama.cpp skipped: llama_cpp is not importable (pip install 'radixrt[peers]')"
    if gguf:
        return gguf, ""
    if model != "default":
        return None, "llama.cpp skipped: no --gguf of this model"
    from radixrt.executor.model_store import default_model_gguf

    path = default_model_gguf(fetch=True)
    return (str(path), "") if path else (None, "llama.cpp skipped: the embedded model's GGUF is not at hand")


def format_table(rows: list[PeerRow], workloads: list[PeerWorkload], markdown: bool = False) -> str:
    """Workloads down, systems across: tokens/s (or seconds) per cell."""
    head = ["workload", *(r.system for r in rows)]

    def cell(r: PeerRow, wl: PeerWorkload) -> str:
        v = r.results.get(wl.name)
        return "-" if v is None else (f"{v:.1f} s" if wl.metric == "s" else f"{v:.1f} tok/s")

    body = [[f"{wl.name} ({len(wl.prompts)} x {len(wl.prompts[0])} -> {wl.new_tokens})"] for wl in workloads]
    for line, wl in zip(body, workloads):
        line += [cell(r, wl) for r in rows]
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * len(rows)]
        return "\n".join(out + ["| " + " | ".join(line) + " |" for line in body])
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [head, *body])


def _said(row: PeerRow) -> PeerRow:
    """Prints a finished row on stderr (a long run that is stopped keeps what it measured)."""
    print(f"[peers] {row.system}: " + json.dumps({k: round(v, 2) for k, v in row.results.items()}), file=sys.stderr)
    return row


def run(args: argparse.Namespace) -> tuple[list[PeerRow], list[PeerWorkload], list[str]]:
    from radixrt.executor.model_store import resolve_model_path
    from radixrt.requests.tokenizer_utils import load_tokenizer

    path = resolve_model_path(args.model)
    workloads = make_workloads(load_tokenizer(path), args.seed, args.scale)
    configs = [parse_config(c) for c in (args.radixrt_config or DEFAULT_CONFIGS)]
    rows: list[PeerRow] = []
    notes: list[str] = []
    for flags in configs:
        print(f"[peers] {config_label(flags)}", file=sys.stderr)
        rows.append(_said(finish(run_radixrt(args.model, flags, workloads), workloads)))
    gguf, why = (
        (None, "llama.cpp skipped: --no-llama-cpp") if not args.llama_cpp else llama_cpp_gguf(args.model, args.gguf)
    )
    if gguf:
        print(f"[peers] llama.cpp on {gguf}", file=sys.stderr)
        rows.append(_said(finish(run_llama_cpp(gguf, args.llama_threads, workloads), workloads)))
    else:
        notes.append(why)
    if args.transformers:
        print("[peers] transformers generate", file=sys.stderr)
        rows.append(_said(finish(run_transformers(path, workloads), workloads)))
    return rows, workloads, notes


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (the embedded model) or a local model folder")
    p.add_argument(
        "--radixrt-config",
        action="append",
        default=None,
        help="a radixrt row: EngineConfig fields as key=value,... (a bare word is a dtype); repeatable "
        f"(default: {'; '.join(DEFAULT_CONFIGS)})",
    )
    p.add_argument("--gguf", default=None, help="llama.cpp's GGUF of --model (default model: its own Q4_1 file)")
    p.add_argument("--llama-threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument(
        "--no-llama-cpp", dest="llama_cpp", action="store_false", help="leave llama.cpp out (default: run it)"
    )
    p.add_argument(
        "--no-transformers", dest="transformers", action="store_false", help="leave transformers out (default: run it)"
    )
    p.add_argument("--scale", type=float, default=1.0, help="multiply every prompt and output length")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' words")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    p.add_argument("--markdown", default=None, help="also write the table as Markdown here")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.peers",
        description=__doc__.split("\n\n")[0],
    )
    add_args(p)
    args = p.parse_args(argv)
    import torch

    rows, workloads, notes = run(args)
    print(format_table(rows, workloads))
    for note in notes:
        print(note)
    print(f"torch threads {torch.get_num_threads()}")
    if args.json:
        with open(args.json, "w") as f:
            report = {"rows": [r.__dict__ for r in rows], "notes": notes, "workloads": [w.name for w in workloads]}
            json.dump(report, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_table(rows, workloads, markdown=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
