#!/usr/bin/env bash
# Sets everything up and runs the whole test suite (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
radixrt download >/dev/null
python -m pytest -q -p no:cacheprovider "$@"
