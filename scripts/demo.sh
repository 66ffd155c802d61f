#!/usr/bin/env bash
# The README's first command: builds everything, starts a mixed fast/slow mock GPU cluster and
# Envoy with the filter on this machine (no Docker), sends bursts of short and long prompts,
# round after round (the first one cold), and prints each round and the medians next to what
# round robin did with the same bursts. Usage: scripts/demo.sh [--rounds N] [--time-scale X]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
