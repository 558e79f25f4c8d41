#!/usr/bin/env bash
# Sets everything up and runs the whole test suite (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
radixrt download >/dev/null
# Two workers (pytest-xdist), each taking whole test files so a module's
# server or engine fixture starts once (much of the suite waits on servers
# starting); tests/support/xdist_order.py deals the slowest files first and
# keeps the modules of one shared server together; tests/conftest.py gives
# each worker (and the servers it starts) cores / workers torch threads. Set
# RADIXRT_TEST_WORKERS=0 to run in this process only.
python -m pytest -q -p no:cacheprovider -n "${RADIXRT_TEST_WORKERS:-2}" --dist loadfile "$@"
