#!/usr/bin/env bash
# Set up .venv: the CPU build of torch first (so pip never pulls a multi-GB CUDA build), then
# the project in editable mode with its test tools, transformers and accelerate (the `hf`
# extra) and Lightning (the `lightning` extra). Safe to rerun: it skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
stamp=.venv/.setup-stamp
want="$torch_spec $(cat pyproject.toml | cksum)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check "$torch_spec"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev,hf,lightning]"
echo "$want" > "$stamp"
