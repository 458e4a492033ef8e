#!/usr/bin/env bash
# Sets up the environment if needed, then runs lint and the whole test suite (what CI runs). Arguments go to
# pytest: `bash scripts/test.sh -m "not slow"` is the fast tier, for every edit.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks examples
.venv/bin/python -m pytest -q "$@"
