"""Float32 linear layers for a few rows: the native kernel against torch's product.

    python -m radixrt.bench.dense_linear                      # the embedded model's shapes
    python -m radixrt.bench.dense_linear --rows 1,9,32,64 --shape 4096,4096
    python -m radixrt.bench.dense_linear --quantization int4   # the quantized kernel instead
    python -m radixrt.bench.dense_linear --against-source old.c  # another build of the float32 kernel

Each shape is ``out_features,in_features``; each row count is a decode batch
(1 row per request) or a verification (9 rows per drafting request). The
weights are cold, as in a model step whose other layers evict them: every
call reads the next of enough copies to fill 256 MiB (the LM head: 2). Times
are medians over ``--calls`` calls; ``ratio`` is torch / kernel, so above 1
the kernel is faster. ``kernels/dense_linear_cpu.MAX_ROWS`` is set from where
the ratio of the decoder's shapes falls to 1 (per CPU capability: see
``_max_rows`` there). ``--against-source`` builds another
version of ``kernels/csrc/dense_linear_cpu.c`` (an older commit's, say) and adds
its times, alternating with the current kernel's, and ``G`` (multiply-adds per
second) for both; its outputs must equal the current kernel's bit for bit.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any, Callable, Optional

from radixrt.help_format import HelpFormatter

# the embedded model (SmolLM2-135M): qkv, o, gate_up, down, the LM head
SHAPES = ["960,576", "576,576", "3072,576", "576,1536", "49152,576"]
ROWS = "1,2,4,8,9,16,32,48,64,128"
COLD_BYTES = 256 << 20


def _median_ms(fn: Callable[[], object], calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _kernel_and_weights(n: int, k: int, copies: int, quantization: Optional[str]) -> tuple[Any, list, list]:
    """The product under test and its weights, beside float32 copies for torch's product."""
    import torch

    floats = [torch.randn(n, k) for _ in range(copies)]
    if quantization is None:
        from radixrt.kernels.dense_linear_cpu import load as load_dense

        dense = load_dense()
        if dense is None:
            raise SystemExit("the dense linear kernel is unavailable here (see the warning)")
        return dense.linear, floats, floats
    from radixrt.kernels import quant_linear_cpu as ql

    quant = ql.load()
    if quant is None:
        raise SystemExit("the quantized linear kernel is unavailable here (see the warning)")
    size = ql.CHUNK if quantization == "int4" else 0
    packed = [quant.prepare(ql.quantize_int4(w, size) if size else ql.quantize_int8(w)) for w in floats]
    return quant.linear, packed, floats


def bench_shape(
    n: int,
    k: int,
    rows: list[int],
    calls: int,
    quantization: Optional[str] = None,
    against: Optional[Callable[[Any, Any], Any]] = None,
) -> list[dict]:
    """One row per row count: torch and kernel milliseconds and their ratio. ``quantization``
    (int8, int4 with groups of 32): the quantized kernel on the packed copies instead of the
    float32 one (torch still multiplies the float32 weights). ``against``: another float32
    product, timed too (``against_ms``)."""
    import torch
    import torch.nn.functional as F

    copies = min(256, max(2, COLD_BYTES // (n * k * 4)))  # small weights: enough to leave the caches
    product, weights, floats = _kernel_and_weights(n, k, copies, quantization)

    def cold(fn: Callable[[Any, Any], object], x: Any, ws: list) -> Callable[[], object]:
        turn = itertools.count()
        return lambda: fn(x, ws[next(turn) % copies])

    out = []
    for m in rows:
        x = torch.randn(m, k)
        t = _median_ms(cold(F.linear, x, floats), calls)
        native = _median_ms(cold(product, x, weights), calls)
        row = {"shape": f"{n}x{k}", "rows": m, "torch_ms": t, "kernel_ms": native, "ratio": t / native}
        if against is not None:
            if not torch.equal(against(x, weights[0]), product(x, weights[0])):
                raise SystemExit(f"--against-source: {n}x{k}, {m} rows: outputs differ from the current kernel's")
            row["against_ms"] = _median_ms(cold(against, x, weights), calls)
            native = min(native, _median_ms(cold(product, x, weights), calls))  # alternated: same conditions
            row["kernel_ms"], row["ratio"] = native, t / native
        out.append(row)
    return out


def _other_build(source: str) -> Callable[[Any, Any], Any]:
    """The float32 kernel built from ``source`` (another version of its C file)."""
    from radixrt.bench.other_build import other_build
    from radixrt.kernels import dense_linear_cpu as dl

    return other_build(source, "dense_linear_cpu_other", dl, dl.NativeDenseLinear).linear


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.dense_linear",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--shape", action="append", help="out_features,in_features (repeatable; default: the embedded model's)"
    )
    p.add_argument("--rows", default=ROWS, help=f"row counts (default {ROWS})")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--quantization",
        choices=["int8", "int4"],
        default=None,
        help="time the quantized kernel (kernels/quant_linear_cpu.py; int4 in groups of 32) on packed weights",
    )
    p.add_argument(
        "--against-source",
        default=None,
        help="another version of kernels/csrc/dense_linear_cpu.c to time beside the current one",
    )
    opts = p.parse_args(argv)
    import torch

    if opts.threads:
        torch.set_num_threads(opts.threads)
    rows = [int(r) for r in opts.rows.split(",") if r.strip()]
    against = _other_build(opts.against_source) if opts.against_source else None
    if against is not None and opts.quantization:
        raise SystemExit("--against-source compares float32 kernels: leave out --quantization")
    extra = f" {'other ms':>9} {'G':>5} {'other G':>7}" if against else ""
    print(
        f"{'shape':>10} {'rows':>5} {'torch ms':>9} {'kernel ms':>9} {'ratio':>6}{extra}"
        f"  ({torch.get_num_threads()} threads)"
    )
    for shape in opts.shape or SHAPES:
        n, k = (int(v) for v in shape.split(","))
        for r in bench_shape(n, k, rows, opts.calls, opts.quantization, against):
            line = f"{r['shape']:>10} {r['rows']:>5} {r['torch_ms']:9.3f} {r['kernel_ms']:9.3f} {r['ratio']:6.2f}"
            if against:
                macs = n * k * r["rows"] / 1e6
                line += f" {r['against_ms']:9.3f} {macs / r['kernel_ms']:5.1f} {macs / r['against_ms']:7.1f}"
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
