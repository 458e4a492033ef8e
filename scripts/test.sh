#!/usr/bin/env bash
# Sets up the environment if needed, then runs lint and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks examples
.venv/bin/python -m pytest -q "$@"
