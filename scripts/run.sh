#!/usr/bin/env bash
# Sets up the environment if needed, then runs gradcomm's main job, `gradcomm bench` (arguments are passed on).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/gradcomm bench "$@"
