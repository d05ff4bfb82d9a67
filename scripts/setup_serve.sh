#!/usr/bin/env bash
# Build .venv-serve (idempotent): the serving pins sglang==0.5.17 + torch==2.11.0 from PyPI (~9 GB, ~5-6 min, mostly
# downloads) with this package installed --no-deps, in which scripts/test.sh runs the SGLang tests. Called by
# scripts/setup.sh with OSCAR_SETUP_SERVE=1, and by scripts/test.sh (OSCAR_SETUP_SERVE=1, no .venv-serve yet) beside
# its first tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_q() {  # quiet pip install into .venv-serve; pip's own exit status decides (the grep drops location warnings)
    local out rc=0
    out=$(.venv-serve/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1) || rc=$?
    if [ -n "$out" ]; then grep -v "^WARNING: Location" <<<"$out" || true; fi
    if [ "$rc" -ne 0 ]; then echo "setup_serve.sh: pip install $* failed (exit status $rc)" >&2; exit 1; fi
}
if ! .venv-serve/bin/python -c "import sglang" 2>/dev/null; then
    echo "setup: building .venv-serve (sglang==0.5.17, torch==2.11.0; several GB from PyPI)"
    [ -x .venv-serve/bin/python ] || "$PY" -m venv .venv-serve
    pip_q "sglang==0.5.17" "torch==2.11.0" pytest pytest-timeout
fi
pip_q --no-deps -e .
.venv-serve/bin/python -c "import pytest_timeout, sglang, torch, triton, transformers, sglang_oscar; print('setup ok (.venv-serve): sglang', sglang.__version__, '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
