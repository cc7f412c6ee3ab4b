#!/usr/bin/env bash
# Set up, then run one campaign (the default one without arguments); arguments are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/sdc-bench "$@"
