"""What ``dtype="auto"`` means on a CPU: bfloat16 only where the CPU computes
it natively and a start-up measurement finds it faster, float32 otherwise.

On a CPU without bf16 instructions (AVX2 only, say) PyTorch converts bf16
weights to float32 inside every matrix product, which makes a decode step
slower than in float32. With AVX512-BF16 or AMX, bf16 halves the bytes a step
reads, but whether that wins depends on the batch: it may lose at batch 1 and
win at batch 16. So the choice asks for both: the instructions, and a short
timing of a decode-shaped matrix product at both batch sizes.

`choose_cpu_dtype` holds the rule (unit-testable: flags and timings in);
`auto_cpu_dtype` feeds it this machine's flags and, only where the flags
qualify, a measurement. The measured choice is kept in
``$RADIXRT_HOME/cpu_dtype-<hash of the CPU flags and torch version>.json``, so a
machine decides once and a restart never flips the dtype (and with it the
answers). ``RADIXRT_CPU_DTYPE=float32|bfloat16`` pins the choice instead
(reproducible comparisons across machines; the test suite pins float32).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

logger = logging.getLogger(__name__)

PIN_ENV = "RADIXRT_CPU_DTYPE"
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
PROBE_ROWS = (1, 16)  # the batch sizes (rows of the activation) the probe times
MARGIN = 0.9  # bf16 must take at most this fraction of float32's time at every probed batch


@dataclass(frozen=True)
class ProbeTimes:
    """Milliseconds of one decode-shaped matrix product per batch size, in each dtype."""

    float32_ms: dict[int, float]
    bfloat16_ms: dict[int, float]


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "float32" | "bfloat16"
    reason: str


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (Linux's ``/proc/cpuinfo``); empty where that file is absent."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def choose_cpu_dtype(flags: Iterable[str], probe: Optional[Callable[[], ProbeTimes]] = None) -> DtypeChoice:
    """bfloat16 only if ``flags`` include avx512_bf16 or amx_bf16 and ``probe()``
    (called only then) times bf16 at no more than ``MARGIN`` x float32 at every
    probed batch size; float32 otherwise. The reason names what decided."""
    native = sorted(set(flags) & set(NATIVE_BF16_FLAGS))
    if not native:
        return DtypeChoice("float32", "the CPU has no native bfloat16 (neither avx512_bf16 nor amx_bf16)")
    if probe is None:
        return DtypeChoice("float32", f"the CPU has {'+'.join(native)} but bfloat16 was not measured")
    times = probe()
    ratios = {m: times.bfloat16_ms[m] / times.float32_ms[m] for m in times.float32_ms}
    shown = ", ".join(f"batch {m}: {r:.2f}x float32's time" for m, r in sorted(ratios.items()))
    if ratios and all(r <= MARGIN for r in ratios.values()):
        return DtypeChoice("bfloat16", f"the CPU has {'+'.join(native)} and bfloat16 measured faster ({shown})")
    return DtypeChoice("float32", f"the CPU has {'+'.join(native)} but bfloat16 measured no faster ({shown})")


def measure_linear(rows: Iterable[int] = PROBE_ROWS, k: int = 1024, n: int = 4096, reps: int = 10) -> ProbeTimes:
    """Median ms of ``F.linear`` of a [m, k] activation by an [n, k] weight, per ``m``,
    in float32 and bfloat16 (about 0.2 s in all on a CPU)."""
    import torch
    import torch.nn.functional as F

    out: dict[torch.dtype, dict[int, float]] = {torch.float32: {}, torch.bfloat16: {}}
    weight32 = torch.randn(n, k) / k**0.5
    for dtype in out:
        weight = weight32.to(dtype)
        for m in rows:
            x = torch.randn(m, k, dtype=dtype)
            F.linear(x, weight)  # warm
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                F.linear(x, weight)
                times.append(time.perf_counter() - start)
            out[dtype][m] = sorted(times)[len(times) // 2] * 1000
    return ProbeTimes(out[torch.float32], out[torch.bfloat16])


@functools.lru_cache(maxsize=1)
def auto_cpu_dtype() -> DtypeChoice:
    """This machine's choice: ``$RADIXRT_CPU_DTYPE`` when set, else the one kept on disk, else
    measured now (and kept); logged at info. Raises ValueError on an unknown pinned dtype."""
    pinned = os.environ.get(PIN_ENV, "").strip()
    if pinned:
        if pinned not in ("float32", "bfloat16"):
            raise ValueError(f"{PIN_ENV} must be float32 or bfloat16, got {pinned!r}")
        choice = DtypeChoice(pinned, f"pinned by {PIN_ENV}")
    else:
        choice = _kept_choice()
    logger.info("dtype auto on the CPU: %s (%s)", choice.dtype, choice.reason)
    return choice


def _kept_choice() -> DtypeChoice:
    import torch

    from radixrt.executor.model_store import radixrt_home

    flags = cpu_flags()
    if not set(flags) & set(NATIVE_BF16_FLAGS):
        return choose_cpu_dtype(flags)  # nothing to measure
    key = hashlib.sha256(" ".join(sorted(flags)).encode() + torch.__version__.encode()).hexdigest()[:16]
    path = radixrt_home() / f"cpu_dtype-{key}.json"
    try:
        kept = json.loads(path.read_text())
        if kept["dtype"] in ("float32", "bfloat16"):  # else a damaged file: measure again
            return DtypeChoice(kept["dtype"], kept["reason"] + f" (measured once, kept in {path})")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    choice = choose_cpu_dtype(flags, measure_linear)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"dtype": choice.dtype, "reason": choice.reason}))
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("dtype auto: could not keep the choice in %s (%s)", path, exc)
    return choice
