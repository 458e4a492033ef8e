#!/usr/bin/env bash
# Sets up the environment if needed, then runs lint, the API docs' strict build and the whole test suite (what CI
# runs). Arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the fast tier, for every edit.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks examples
# the API reference must build from the docstrings without a warning (site written to a temporary folder)
docs_site=$(mktemp -d)
trap 'rm -rf "$docs_site"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d "$docs_site"  # not -q: it hides the warnings strict counts
.venv/bin/python -m pytest -q "$@"
