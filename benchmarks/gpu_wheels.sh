#!/usr/bin/env bash
# Wheels a lent GPU machine lacks for `from dolmus import LLM` + generate and for
# benchmarks/gpu_check.py (which imports tests/conftest.py, hence pytest), downloaded here into
# .whl/ (repo root) for Python 3.12 on x86-64 Linux. That image already has torch, triton,
# transformers, tokenizers, safetensors, numpy, jinja2, tqdm, httpx, aiohttp, pyyaml, packaging,
# requests and friends; the LLM path imports only msgspec and pyzmq beyond them (the server's
# fastapi/pydantic/uvicorn and llguidance are not imported by LLM.generate). gguf: GGUF loading
# and int4 GGUF unpacking import it lazily. pytest, pluggy, iniconfig, pygments: gpu_check.py
# imports tests/conftest.py (it has a stand-in for pytest too). benchmarks/gpu_check.py itself
# unpacks those of them the device's Python lacks into /tmp/dolmus-wheels (no pip needed);
# elsewhere: python -m pip install --no-deps --no-index .whl/*.whl
# Usage: benchmarks/gpu_wheels.sh [python]   (default: python3; needs pip and network here)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
WHEELS=(
    msgspec==0.23.0
    pyzmq==27.3.0
    gguf==0.19.0
    pytest==9.2.0
    pluggy==1.7.0
    iniconfig==2.3.1
    pygments==2.21.0
)
mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
ls -l .whl
du -sh .whl
