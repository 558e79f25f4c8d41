#!/usr/bin/env bash
# Sets everything up, fetches the embedded default model once, runs the quickstart.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
radixrt download >/dev/null
python examples/quickstart.py "$@"
