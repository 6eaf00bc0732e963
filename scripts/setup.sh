#!/usr/bin/env bash
# Creates .venv and installs bpcompile with everything its build, serving and tests need.
# torch is pinned to the CPU build first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0" 2>/dev/null || .venv/bin/python -m pip install -q "torch>=2.4"
.venv/bin/python -m pip install -q -e ".[serve,kernels,test]"
