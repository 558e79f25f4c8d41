#!/usr/bin/env bash
# Lint (ruff check and ruff format --check, whole repository) and type-check (mypy, the runtime core) with the
# versions of the `test` extra in .venv (scripts/setup.sh installs them).
# CI runs it after the tests (.ci/run); configuration: pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
status=0

echo "== ruff check"
"$BIN/ruff" check . || status=1

echo "== ruff format --check"
"$BIN/ruff" format --check . || status=1

# mypy cannot follow setuptools' package-dir mapping (radixrt.kernels -> kernels/,
# radixrt.frontend -> frontend/): lay out radixrt/ with links to the real folders.
tree=build/typecheck/radixrt
rm -rf build/typecheck
mkdir -p "$tree"
for entry in radixrt/*; do
  ln -s "$PWD/$entry" "$tree/"
done
ln -s "$PWD/kernels" "$tree/kernels"
ln -s "$PWD/frontend" "$tree/frontend"

echo "== mypy (radixrt.scheduler, .memory, .executor, .requests, .kernels)"
# report the real paths, not the links'
if ! "$BIN/mypy" -p radixrt.scheduler -p radixrt.memory -p radixrt.executor -p radixrt.requests -p radixrt.kernels \
    | sed -e "s#^build/typecheck/radixrt/kernels/#kernels/#" -e "s#^build/typecheck/##"; then
  status=1
fi
exit $status
