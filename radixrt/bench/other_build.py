"""``--against-source`` of the kernel benchmarks: another version of a CPU kernel's C source,
built beside the current one, to be timed against it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def other_build(source: str, name: str, kernel_module: Any, kernel_class: Any) -> Any:
    """``kernel_class`` over the library built from ``source`` with ``kernel_module``'s
    ``COMPILE_FLAGS`` and ``LINK_FLAGS`` under the name ``name`` (no self-check: the benchmark
    compares its outputs with the current kernel's); exits with a message where it does not build."""
    from radixrt.kernels.native_build import load_kernel

    kernel = load_kernel(
        name,
        Path(source),
        kernel_module.COMPILE_FLAGS,
        kernel_module.LINK_FLAGS,
        kernel_class,
        lambda k: None,
        "RADIXRT_BENCH_OTHER_KERNEL",
        "nothing to compare",
    )
    if kernel is None:
        raise SystemExit(f"--against-source {source}: it does not build here (see the warning)")
    return kernel
