#!/usr/bin/env bash
# Creates .venv with the pinned CPU torch (never let pip resolve another torch) and gradcomm in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch is pinned on every line so pip never swaps it; the integrations are tested against these exact releases.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[dev,bench]" \
  "lightning==2.6.6" "accelerate==1.15.0"
