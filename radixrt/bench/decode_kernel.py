"""CPU paged decode attention by itself: the C kernel against the torch path.

    python -m radixrt.bench.decode_kernel                    # the tiny and the embedded model's shapes
    python -m radixrt.bench.decode_kernel --shape 32,1056,9,3,64
    python -m radixrt.bench.decode_kernel --draft 8          # each request verifying 8 draft tokens
    python -m radixrt.bench.decode_kernel --draft 15 --against-source old.c   # another build of the kernel

Each shape is ``batch, context, query heads, KV heads, head dim``. The slots
are laid out as a decode step finds them: every request's first 32 tokens
(its prompt) in consecutive slots, the rest one decode step at a time, so
consecutive tokens of a request lie ``batch`` slots apart. Times are medians
over ``--calls`` calls, with the pool warm (the same call repeated, its K/V
in cache) and cold (a 64 MiB buffer written between calls, as the rest of a
model step evicts the pool in a real step). The torch path
(``TorchReferenceBackend(native_decode=False)``: gather + SDPA) is timed the
same way and is the reference the outputs are checked against.

An untimed pass over every shape comes first. The torch path allocates its
gathered K/V on every call, and until a process has freed blocks that large,
glibc's malloc hands them back to the system each time, so that every call
page-faults them in again (several times slower; ``MALLOC_MMAP_THRESHOLD_=33554432``
removed the difference: docs/benchmarks.md, "CPU decode attention").

``--against-source`` builds another version of ``kernels/csrc/paged_decode_cpu.c``
(an older commit's, say) and times it beside the current kernel, the two
alternating call by call so that both meet the same moods of the machine; its
outputs must equal the current kernel's bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from radixrt.help_format import HelpFormatter

if TYPE_CHECKING:  # torch is imported where it is used: `radixrt bench --help` stays light
    import torch

PROMPT = 32
SHAPES = ["128,100,4,2,16", "32,1056,9,3,64"]  # the step-time bench's tiny model; the embedded model


@dataclass
class KernelTime:
    shape: str
    kernel_warm_us: float
    kernel_cold_us: float
    torch_warm_us: float
    torch_cold_us: float
    max_abs_diff: float
    kernel_apart_warm_us: Optional[float] = None  # --draft: the kernel with each row reading its keys alone
    kernel_apart_cold_us: Optional[float] = None
    other_warm_us: Optional[float] = None  # --against-source: the other build (the kernel's own figures
    other_cold_us: Optional[float] = None  # then come from the same alternating calls)


def decode_slot_table(batch: int, context: int) -> "torch.Tensor":
    """[batch, context] int64 slot ids: prompts consecutive, decode tokens interleaved."""
    import torch

    prompt = min(PROMPT, context)
    table = torch.empty(batch, context, dtype=torch.int64)
    steps = torch.arange(context - prompt) * batch
    for b in range(batch):
        table[b, :prompt] = torch.arange(b * prompt, (b + 1) * prompt)
        table[b, prompt:] = batch * prompt + steps + b
    return table


def _median_us(fn: Callable[[], object], calls: int, flush: Optional[Callable[[], None]]) -> float:
    times = []
    for _ in range(3):
        fn()
    for _ in range(calls):
        if flush is not None:
            flush()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def _paired_median_us(
    fns: tuple[Callable[[], object], Callable[[], object]], calls: int, flush: Optional[Callable[[], None]]
) -> tuple[float, float]:
    """`_median_us` of two functions whose calls alternate (their order flips every round)."""
    times: tuple[list[float], list[float]] = ([], [])
    for fn in fns:
        for _ in range(3):
            fn()
    for i in range(calls):
        for j in (0, 1) if i % 2 == 0 else (1, 0):
            if flush is not None:
                flush()
            start = time.perf_counter()
            fns[j]()
            times[j].append((time.perf_counter() - start) * 1e6)
    return statistics.median(times[0]), statistics.median(times[1])


def decode_build(source: str) -> Any:
    """The decode kernel built from ``source`` (another version of ``paged_decode_cpu.c``)."""
    from radixrt.bench.other_build import other_build
    from radixrt.kernels import cpu_decode

    return other_build(source, "paged_decode_cpu_other", cpu_decode, cpu_decode.NativeDecode)


def measure(shape: str, calls: int, draft: int = 0, other: Any = None) -> KernelTime:
    """One shape's figures (``calls`` timed calls per figure), both paths
    through `TorchReferenceBackend`'s own ``plan`` and ``forward``; with
    ``draft`` > 0 each request verifies that many draft tokens (``draft + 1``
    rows over its context), and the kernel's figures are given with its rows
    read apart as well (``kernel_apart_*``). ``other`` (`decode_build`): another
    build of the kernel, timed alternating with the current one (``other_*``)."""
    import torch

    from radixrt.kernels import AttentionMetadata, LayerKVCache, cpu_decode
    from radixrt.kernels.torch_ref import TorchReferenceBackend

    batch, context, hq, hkv, dim = (int(x) for x in shape.split(","))
    if cpu_decode.load() is None:
        raise SystemExit("the C decode kernel cannot be built here (see radixrt.kernels.cpu_decode)")
    table = decode_slot_table(batch, context)
    gen = torch.Generator().manual_seed(0)
    slots = int(table.max()) + 1
    cache = LayerKVCache(torch.randn(slots, hkv, dim, generator=gen), torch.randn(slots, hkv, dim, generator=gen))
    rows = draft + 1
    q = torch.randn(batch * rows, hq, dim, generator=gen)
    # each call writes the step's own K/V (each request's last slots) with the values already there
    last = table[:, -rows:].reshape(-1)
    k_new, v_new = cache.k[last].clone(), cache.v[last].clone()
    meta = AttentionMetadata.build(table.tolist(), [rows] * batch)
    scale = dim**-0.5

    def path(native: bool, grouped: bool = True, build: Any = None) -> Callable[[], torch.Tensor]:
        backend = TorchReferenceBackend(
            native_decode=native, cascade=False, decode_budget=batch * rows * context, group_shared_rows=grouped
        )
        if build is not None:
            backend._native = build  # the backend's kernel, swapped for the other build
        backend.plan(meta)
        return lambda: backend.forward(q, k_new, v_new, cache, scale)

    kernel, torch_path = path(True), path(False)
    apart = path(True, grouped=False) if draft else None
    junk = torch.zeros(16 << 20)  # 64 MiB, more than the last-level caches here

    def flush() -> None:
        junk.add_(1.0)

    diff = float((kernel() - torch_path()).abs().max())
    if apart is not None and not torch.equal(kernel(), apart()):
        raise SystemExit(f"{shape}: the kernel's rows read together differ from the rows read apart")
    paired = {}
    if other is not None:
        other_path = path(True, build=other)
        if not torch.equal(kernel(), other_path()):
            raise SystemExit(f"{shape}: --against-source: outputs differ from the current kernel's")
        paired = {flush_fn: _paired_median_us((kernel, other_path), calls, flush_fn) for flush_fn in (None, flush)}
    return KernelTime(
        shape,
        paired[None][0] if paired else _median_us(kernel, calls, None),
        paired[flush][0] if paired else _median_us(kernel, calls, flush),
        _median_us(torch_path, calls, None),
        _median_us(torch_path, calls, flush),
        diff,
        _median_us(apart, calls, None) if apart else None,
        _median_us(apart, calls, flush) if apart else None,
        paired[None][1] if paired else None,
        paired[flush][1] if paired else None,
    )


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.decode_kernel",
        description=__doc__.split("\n")[0],
    )
    ap.add_argument(
        "--shape",
        action="append",
        default=None,
        help="batch,context,query heads,KV heads,head dim (repeatable; default: " + " and ".join(SHAPES) + ")",
    )
    ap.add_argument("--calls", type=int, default=100, help="timed calls per figure (default: 100)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, which the kernel also uses (default: 1)")
    ap.add_argument(
        "--draft", type=int, default=0, help="draft tokens each request verifies (default: 0, plain decode)"
    )
    ap.add_argument(
        "--against-source",
        default=None,
        help="another version of kernels/csrc/paged_decode_cpu.c to time beside the current one",
    )
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    shapes = args.shape or SHAPES
    other = decode_build(args.against_source) if args.against_source else None
    for shape in shapes:  # the untimed pass (see the module doc)
        measure(shape, 1, args.draft, other)
    apart = "  rows apart warm / cold us" if args.draft else ""
    against = "  other warm / cold us  ratio warm / cold" if other is not None else ""
    header = "shape (B,ctx,Hq,Hkv,D)   kernel warm us  kernel cold us  torch warm us  torch cold us  max |diff|"
    print(header + apart + against)
    for shape in shapes:
        r = measure(shape, args.calls, args.draft, other)
        line = (
            f"{r.shape:22s}  {r.kernel_warm_us:14.0f}  {r.kernel_cold_us:14.0f}  {r.torch_warm_us:13.0f}  "
            f"{r.torch_cold_us:13.0f}  {r.max_abs_diff:10.1e}"
        )
        if r.kernel_apart_warm_us is not None:
            line += f"  {r.kernel_apart_warm_us:12.0f} / {r.kernel_apart_cold_us:.0f}"
        if r.other_warm_us is not None and r.other_cold_us is not None:
            line += (
                f"  {r.other_warm_us:12.0f} / {r.other_cold_us:<6.0f}"
                f"  {r.other_warm_us / r.kernel_warm_us:5.2f} / {r.other_cold_us / r.kernel_cold_us:.2f}"
            )
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
