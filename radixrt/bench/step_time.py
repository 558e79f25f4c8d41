"""Host cost of the step loop: milliseconds per decode step by batch size.

    python -m radixrt.bench.step_time                  # CPU, tiny random Llama
    python -m radixrt.bench.step_time --device cuda --model PATH
    python -m radixrt.bench.step_time --no-engine --no-http   # the scheduler alone

Drives `Scheduler.step` directly (no HTTP, no detokenization): ``B`` greedy
requests with ``--prompt-len``-token prompts (default 32) decode until their
KV is warm, then ``--steps`` decode steps are timed, ``--repeats`` times; the
median is reported. ``model ms`` is the time spent inside the model forward
(which also gathers the attention metadata from the request-to-slot table),
the logits and the sampler; ``host ms`` is the rest of the wall time: the
scheduler's own work that the model waits for (scheduling, inputs, results).
With overlap on, host work that runs while the forward does is not counted.
The timers synchronize the device after each call, so on CUDA (where that
would stop the host from running ahead of the GPU) each repeat runs twice:
once without them for ``ms/step``, once with them for ``model ms``; the torch
profiler (without the timers) gives the fraction of the wall time the GPU was
busy.

The same workload is also timed, in the same run, through the public
``Engine.generate`` (`radixrt.bench.engine_step`; ``--no-engine`` skips it)
and through ``POST /generate`` on a real server on 127.0.0.1: one batch
request, non-streaming and streaming, and ``B`` streaming requests at once
(`radixrt.bench.http_step`; ``--no-http`` skips it): one
repeat of each after each scheduler-only repeat, so that all figures share
the machine's moods. Each is printed beside the scheduler-only figure, with
their ratio.

The default CPU model is a tiny random Llama (hidden 64, 2 layers) with a
512-token vocabulary, so that the model's math is small and the figure is the
loop's; with the real 49,152-token vocabulary the LM head and argmax alone
cost several ms per step at batch 64 on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from radixrt.help_format import HelpFormatter

PROMPT_LEN = 32
WARM_STEPS = 8


@dataclass
class StepTime:
    batch: int
    ms_per_step: float
    model_ms_per_step: float
    host_ms_per_step: float
    gpu_busy: Optional[float] = None  # CUDA only: GPU kernel time / wall time


class _ModelTimers:
    """Timers around the runner's forward and logits and the sampler (``model
    ms``). Each synchronizes the device after its call, which on CUDA stops the
    host from running ahead of the GPU, so CUDA's wall time per step is taken
    with them removed (`off`)."""

    NAMES = (("runner", "forward_batch"), ("runner", "logits"), ("sampler", "sample"))

    def __init__(self, scheduler: Any, sync: Callable[[], None]) -> None:
        self.scheduler, self.sync, self.total_s = scheduler, sync, 0.0

    def on(self) -> None:
        for owner, name in self.NAMES:
            obj = getattr(self.scheduler, owner)
            fn = getattr(obj, name)

            def timed(*args: Any, _fn: Callable[..., Any] = fn, **kwargs: Any) -> Any:
                start = time.perf_counter()
                out = _fn(*args, **kwargs)
                self.sync()
                self.total_s += time.perf_counter() - start
                return out

            setattr(obj, name, timed)

    def off(self) -> None:
        for owner, name in self.NAMES:
            getattr(self.scheduler, owner).__dict__.pop(name, None)


def _run_steps(scheduler: Any, steps: int, sync: Callable[[], None]) -> float:
    """Milliseconds per step over ``steps`` steps."""
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        scheduler.step()
    sync()
    return (time.perf_counter() - start) * 1000 / steps


def _gpu_busy(scheduler: Any, steps: int) -> float:
    """Fraction of the wall time of ``steps`` steps during which CUDA kernels ran."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            scheduler.step()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - start) * 1e6
    busy_us = sum(e.self_device_time_total for e in prof.key_averages())
    return min(1.0, busy_us / wall_us)


def measure(
    model_path: str,
    batches: list[int],
    steps: int,
    repeats: int,
    device: str = "cpu",
    overlap: Optional[bool] = None,
    prompt_len: int = PROMPT_LEN,
    after_repeat: Optional[Callable[[int], None]] = None,
) -> list[StepTime]:
    """``overlap`` None: the engine's default for the device (overlap on CUDA only).
    ``after_repeat(batch)`` runs after each timed repeat, untimed (``--engine``
    times its own repeat there, so that both figures share the machine's moods)."""
    import torch

    from radixrt.config import EngineConfig
    from radixrt.requests.messages import GenerateReq
    from radixrt.sampling.params import SamplingParams
    from radixrt.scheduler.scheduler import Scheduler

    cuda = device.startswith("cuda")
    max_new = WARM_STEPS + steps * ((2 if cuda else 1) * repeats + 1) + 64
    config = EngineConfig(
        model_path=model_path,
        device=device,
        max_running_requests=max(batches),
        max_total_tokens=max(batches) * (prompt_len + max_new + 16),
        chunked_prefill_size=1 << 16,
        context_length=prompt_len + max_new + 16,
        disable_overlap_schedule=None if overlap is None else not overlap,
    )
    scheduler = Scheduler(config)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    timers = _ModelTimers(scheduler, sync)
    sampling = SamplingParams.from_dict({"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0})
    results = []
    for batch in batches:
        for i in range(batch):
            prompt = [(7 * i + j) % 500 + 3 for j in range(prompt_len)]
            scheduler.add_request(GenerateReq(rid=f"b{batch}-{i}", input_ids=prompt, sampling=sampling))
        for _ in range(WARM_STEPS):
            scheduler.step()
        times, model_times = [], []
        for _ in range(repeats):
            if cuda:  # the wall time without the timers' synchronizations
                times.append(_run_steps(scheduler, steps, sync))
            timers.total_s = 0.0
            timers.on()
            timed_ms = _run_steps(scheduler, steps, sync)
            timers.off()
            times += [] if cuda else [timed_ms]
            model_times.append(timers.total_s * 1000 / steps)
            if after_repeat is not None:
                after_repeat(batch)
        busy = _gpu_busy(scheduler, steps) if cuda else None
        assert len(scheduler.running) == batch, "every request must still be decoding"
        ms, model_ms = statistics.median(times), statistics.median(model_times)
        results.append(StepTime(batch, ms, model_ms, max(ms - model_ms, 0.0), busy))
        scheduler.abort("")
        while scheduler.has_work():
            scheduler.step()
    scheduler.close()
    return results


def op_overhead_us(repeats: int = 5, calls: int = 2000) -> float:
    """This machine's fixed cost of one small torch op, in microseconds: the
    median over ``repeats`` of ``calls`` adds on a [64, 64] tensor. The tiny
    model's step is mostly such ops on the CPU, so step times from machines of
    different speed compare as multiples of it."""
    import torch

    x = torch.zeros(64, 64)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            x.add(1)
        times.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(times)


def tiny_cpu_model(folder: str, tokenizer_from: Optional[str] = None) -> str:
    """A tiny random Llama with the default model's tokenizer (copied from
    ``tokenizer_from`` when given: a machine without the default model)."""
    from radixrt.bench.tiny_model import copy_default_tokenizer, make_tiny_model

    path = make_tiny_model(
        folder, "llama", tokenizer=tokenizer_from is None, vocab_size=512, max_position_embeddings=8192
    )
    if tokenizer_from is not None:
        copy_default_tokenizer(path, tokenizer_from)
    return path


def cpu_decode_kernel() -> bool:
    """Whether CPU decode attention runs in the C kernel here (else the torch path)."""
    from radixrt.kernels import cpu_decode

    return cpu_decode.load() is not None


def format_table(rows: list[StepTime]) -> str:
    lines = ["batch  ms/step  model ms  host ms  GPU busy"]
    for r in rows:
        busy = "-" if r.gpu_busy is None else f"{100 * r.gpu_busy:.0f}%"
        lines.append(
            f"{r.batch:5d}  {r.ms_per_step:7.2f}  {r.model_ms_per_step:8.2f}  {r.host_ms_per_step:7.2f}  {busy:>8}"
        )
    return "\n".join(lines)


def _measure_all(model: str, batches: list[int], args: argparse.Namespace) -> tuple[list[StepTime], list[Any]]:
    """The scheduler-only rows and the user-facing rows (``--engine``: Engine.generate,
    ``--http``: POST /generate non-streaming and streaming), their repeats alternated."""
    from contextlib import ExitStack

    shape = (model, batches, args.steps, args.repeats, args.device, args.overlap, args.prompt_len)
    with ExitStack() as stack:
        fronts: list[Any] = []
        if args.engine:
            from radixrt.bench.engine_step import EngineBench

            fronts.append(stack.enter_context(EngineBench(*shape)))
        if args.http:
            from radixrt.bench.http_step import HttpBench

            fronts.append(stack.enter_context(HttpBench(*shape, threads=args.threads)))

        def after_repeat(batch: int) -> None:
            for front in fronts:
                front.repeat(batch)

        rows = measure(
            model,
            batches,
            args.steps,
            args.repeats,
            args.device,
            overlap=args.overlap,
            prompt_len=args.prompt_len,
            after_repeat=after_repeat if fronts else None,
        )
        return rows, [r for front in fronts for r in front.rows()]


def front_rows(rows: list[StepTime], front: list[Any]) -> list[dict[str, Any]]:
    """Each user-facing row (``mode``: engine, http or http-stream) with the
    scheduler-only figure of its batch and their ratio."""
    by_batch = {r.batch: r.ms_per_step for r in rows}
    out = []
    for f in front:
        base = by_batch[f.batch]
        d = {"mode": getattr(f, "mode", "engine"), **asdict(f), "scheduler_ms_per_step": base}
        out.append({**d, "ratio": f.ms_per_step / base if base > 0 else float("nan")})
    return sorted(out, key=lambda d: (d["batch"], MODE_ORDER.index(d["mode"])))


MODE_ORDER = ("engine", "http", "http-stream", "http-streams")
MODE_NAMES = {
    "engine": "Engine.generate",
    "http": "POST /generate",
    "http-stream": "POST /generate stream",
    "http-streams": "B streaming requests",
}


def format_front_table(rows: list[dict[str, Any]]) -> str:
    """The user-facing paths' ms per step beside the scheduler-only figure of the same batch."""
    lines = ["batch  path                    ms/step  scheduler-only ms/step  ratio"]
    for r in rows:
        lines.append(
            f"{r['batch']:5d}  {MODE_NAMES[r['mode']]:22s}  {r['ms_per_step']:7.2f}  "
            f"{r['scheduler_ms_per_step']:22.2f}  {r['ratio']:5.2f}x"
        )
    return "\n".join(lines)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="model folder (default: a tiny random Llama on CPU)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    ap.add_argument("--batches", default="1,64,128", help="batch sizes, comma-separated (default: 1,64,128)")
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help=f"prompt tokens (default: {PROMPT_LEN})")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per repeat (default: 20)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats; the median is reported (default: 5)")
    ap.add_argument(
        "--threads", type=int, default=1, help="CPU torch threads (default: 1, steadier on a shared machine)"
    )
    ap.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force the overlap scheduler on (--overlap) or off (--no-overlap); default: the "
        "engine's choice for the device (on for CUDA, off on the CPU)",
    )
    ap.add_argument(
        "--engine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the same workload through Engine.generate (radixrt.bench.engine_step; default: on)",
    )
    ap.add_argument(
        "--http",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time it through POST /generate on a local server: one batch request, non-streaming and "
        "streaming, and B streaming requests "
        "(radixrt.bench.http_step; default: on)",
    )
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.step_time",
        description=__doc__.split("\n")[0],
    )
    add_args(ap)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_cpu_model(tmp)
        rows, fronts = _measure_all(model, batches, args)
    front = front_rows(rows, fronts)
    overhead = op_overhead_us()
    kernel = cpu_decode_kernel()
    print(format_table(rows))
    if front:
        print(format_front_table(front))
    if args.device == "cpu":
        print("decode attention: " + ("the C kernel (radixrt.kernels.cpu_decode)" if kernel else "the torch path"))
    print(
        f"one small torch op costs {overhead:.1f} us on this machine ({torch.get_num_threads()} threads); "
        f"in those units: " + ", ".join(f"batch {r.batch} {1000 * r.ms_per_step / overhead:.0f}" for r in rows)
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "op_overhead_us": overhead,
                    "threads": torch.get_num_threads(),
                    "cpu_decode_kernel": kernel,
                    "rows": [asdict(r) for r in rows],
                    "engine_rows": [r for r in front if r["mode"] == "engine"],
                    "http_rows": [r for r in front if r["mode"] != "engine"],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
