#!/usr/bin/env bash
# Runs benchmarks/gpu_report.py (the one-command GPU report) with the repo's
# venv python, or $PYTHON, or python3; arguments are passed on (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
exec "$py" benchmarks/gpu_report.py "$@"
