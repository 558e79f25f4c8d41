#!/usr/bin/env bash
# Creates .venv (if missing) and installs radixrt with its test extras.
#
# torch is installed first, pinned, by plain name from your pip index (PyPI by
# default). On Linux x86_64, PyPI's torch is the CUDA build (several GB of
# nvidia-* wheels). For the much smaller CPU-only build, point this script at
# PyTorch's CPU wheel index before the first run:
#
#   RADIXRT_TORCH_INDEX=https://download.pytorch.org/whl/cpu ./scripts/setup.sh
#
# (TORCH_INDEX_URL is accepted too.) The value is passed to pip as --index-url
# for the torch install only. It only matters while torch is not installed yet:
# to switch an existing .venv, remove it (rm -rf .venv) and run again.
#
# SGLang's own client (sglang.RuntimeEndpoint and its program language), which
# tests/e2e/test_sglang_client.py drives `radixrt serve` with, is installed
# pinned and WITHOUT its dependencies (they are SGLang's GPU server stack:
# flashinfer, sgl-kernel, ...); what its client imports beyond radixrt's own
# dependencies (aiohttp, pybase64, ipython, orjson, pillow, psutil, requests)
# comes with the `test` extra. The pin is SGLang's current release, 0.5.23: its
# wheels are per Python version (CPython 3.11-3.13, manylinux_2_34 x86_64; the
# client's modules are plain Python, the compiled parts are server-only).
# Where no such wheel fits this interpreter or platform, 0.5.10.post1, the last
# pure-Python release, is installed instead: it speaks the same /generate
# protocol, and the tests that need the current release's programs skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC="torch==2.13.0"
SGLANG_VERSION="0.5.23"
SGLANG_FALLBACK="0.5.10.post1"
TORCH_INDEX=${RADIXRT_TORCH_INDEX:-${TORCH_INDEX_URL:-}}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.radixrt-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  if [ -n "$TORCH_INDEX" ]; then
    echo "setup.sh: installing $TORCH_SPEC from $TORCH_INDEX" >&2
    python -m pip install -q "$TORCH_SPEC" --index-url "$TORCH_INDEX"
  else
    python -m pip install -q "$TORCH_SPEC"
  fi
  python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
sglang_installed=$(python -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)
if [ "$sglang_installed" != "$SGLANG_VERSION" ]; then
  # pip warns that sglang's own requirements are not met: expected, only its client is used
  if ! python -m pip install -q --no-deps --only-binary=:all: "sglang==$SGLANG_VERSION"; then
    echo "setup.sh: no sglang $SGLANG_VERSION wheel for this Python/platform; installing $SGLANG_FALLBACK" >&2
    if [ "$sglang_installed" != "$SGLANG_FALLBACK" ]; then
      python -m pip install -q --no-deps "sglang==$SGLANG_FALLBACK"
    fi
  fi
fi
# The editable install leaves radixrt's own modules uncompiled, and where PYTHONDONTWRITEBYTECODE is
# set no process ever writes their bytecode: every server process would compile them again (about
# 1 s of CPU per start). Writing it once here is cheap; an edited module's stale file is ignored.
python -m compileall -q radixrt frontend kernels tests/support >/dev/null
