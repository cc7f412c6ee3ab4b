#!/usr/bin/env bash
# Set up .venv: the CPU build of torch first (so pip never pulls a multi-GB CUDA build), then
# the project in editable mode with its test tools, transformers and accelerate (the `hf`
# extra) and Lightning (the `lightning` extra). Safe to rerun: it skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
# PyPI's Linux wheel of torch is the CUDA build; PyTorch's CPU index serves the CPU one. pip's
# own configuration still applies: a machine whose pip serves the wheel locally (find-links, a
# mirror) installs that, and, where the CPU index cannot be reached, pays two quick retries a
# package (pip's default five took 90 s more). With TORCH_SPEC set (a CUDA build on a GPU
# machine), pip's own indexes unless TORCH_INDEX names one.
if [ -n "${TORCH_SPEC:-}" ]; then
  torch_index="${TORCH_INDEX:-}"
else
  torch_index="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
fi
stamp=.venv/.setup-stamp
want="$torch_spec $torch_index $(cat pyproject.toml | cksum)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
  ${torch_index:+--index-url "$torch_index" --retries 2} "$torch_spec"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev,hf,lightning]"
echo "$want" > "$stamp"
