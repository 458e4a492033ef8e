#!/usr/bin/env bash
# Creates .venv with the pinned CPU torch (never let pip resolve another torch) and gradcomm in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
