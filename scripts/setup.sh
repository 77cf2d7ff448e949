#!/usr/bin/env bash
# Create .venv (Python 3.11+) and install srm-max with the reference (torch), test, Ray, serve and eval
# (lm-eval, so the lm-eval tests run rather than skip) extras.
# Idempotent: a second run only checks. Torch is pinned to the CPU build first, because an
# open range would pull the multi-GB CUDA build on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "srm-max needs Python 3.11+"'
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c 'import srm_max, torch, pytest, max, ray, fastapi, uvicorn, httptools, prometheus_client, openai, lm_eval, accelerate' 2>/dev/null; then
  # SRM_TORCH_INDEX=https://download.pytorch.org/whl/cpu where no local CPU wheel is configured.
  .venv/bin/pip install --quiet --disable-pip-version-check 'torch==2.13.*' \
    ${SRM_TORCH_INDEX:+--extra-index-url "$SRM_TORCH_INDEX"}
  .venv/bin/pip install --quiet --disable-pip-version-check -e '.[torch,dev,train,bench,ray,serve,eval]'
fi
