"""The CPU C kernels' common machinery: build once, cache, check.

A kernel's shared object is compiled on first use with the system C compiler
(``$CC``, else ``cc``) into ``$RADIXRT_HOME/kernels/`` (default
``~/.cache/radixrt/kernels``), named by a hash of its source, the compiler
and flags, and the CPU's feature flags (``-march=native``: a cache shared by
different CPUs keeps one build per CPU). Loading it runs the kernel's own
self-check; a missing compiler, a failed build or a failed check gives one
warning and None, and the caller keeps its torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional, TypeVar

logger = logging.getLogger(__name__)

K = TypeVar("K")
_lock = threading.Lock()
_loaded: dict[str, object] = {}


def load_kernel(
    name: str,
    source: Path,
    compile_flags: list[str],
    link_flags: list[str],
    make: Callable[[Path], K],
    self_check: Callable[[K], None],
    disable_env: str,
    fallback: str,
) -> Optional[K]:
    """The kernel ``name`` built from ``source`` for this machine, made by ``make(path)`` and
    passed through ``self_check`` (which raises RuntimeError on a wrong answer); None when
    ``$disable_env`` is "0" or it cannot be built or checked (one warning naming ``fallback``,
    what the caller does instead). Built once per process and cache; safe from several
    threads and processes."""
    if os.environ.get(disable_env, "1") == "0":
        return None
    compiler = shlex.split(os.environ.get("CC") or "cc")
    h = hashlib.sha256(source.read_bytes())
    h.update(" ".join(compiler + compile_flags + link_flags).encode())
    h.update(platform.machine().encode() + cpu_flags().encode())
    target = cache_dir() / f"{name}-{h.hexdigest()[:16]}.so"
    with _lock:
        if str(target) not in _loaded:
            try:
                if not target.exists():
                    _compile(compiler, source, compile_flags, link_flags, target)
                kernel = make(target)
                self_check(kernel)
                _loaded[str(target)] = kernel
                logger.debug("CPU kernel %s: %s", name, target)
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                logger.warning("CPU kernel %s unavailable (%s); %s", name, exc, fallback)
                _loaded[str(target)] = None
        return _loaded[str(target)]  # type: ignore[return-value]


def cpu_flags() -> str:
    """The CPU's feature flags line (``/proc/cpuinfo``), else the processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    home = os.environ.get("RADIXRT_HOME") or Path.home() / ".cache" / "radixrt"
    return Path(home).expanduser() / "kernels"


def _compile(compiler: list[str], source: Path, compile_flags: list[str], link_flags: list[str], target: Path) -> None:
    """Compile and link in two commands (the link without the compile flags: see cpu_decode's
    LINK_FLAGS), then move the result into place atomically (a concurrent builder's copy is
    as good as ours)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        for cmd in (
            [*compiler, *compile_flags, "-c", str(source), "-o", str(obj)],
            [*compiler, str(obj), "-o", str(lib), *link_flags],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{shlex.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, target)
