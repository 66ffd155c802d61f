#!/usr/bin/env bash
# The README's first command: builds everything, starts a mixed fast/slow mock GPU cluster and
# Envoy with the filter on this machine (no Docker), sends a burst of short and long prompts,
# and prints where each went and each node's load next to what round robin did with the same
# burst. Usage: scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/demo.py
