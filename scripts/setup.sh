#!/usr/bin/env bash
# One-time (and idempotent) set-up of a fresh machine: a virtual environment in
# .venv with torch, weightstream and its test tools.
#
# torch is installed first and pinned: the package only asks for torch>=2.1,
# and without a torch already present pip would resolve that to the newest
# release with several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${WEIGHTSTREAM_TORCH_VERSION:-2.13.0}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install --quiet "torch==${TORCH_VERSION}"
fi
# Reinstall the package only when its metadata changed (keeps re-runs fast).
stamp=.venv/.weightstream-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install --quiet -e ".[test]" 2>&1 | grep -v "is ignored: it is neither" || true
  .venv/bin/python -c "import weightstream, torch; print('weightstream', weightstream.__version__, 'torch', torch.__version__)"
  touch "$stamp"
fi
