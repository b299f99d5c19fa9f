#!/usr/bin/env bash
# Throwaway venv + unzipped sglang 0.5.23 wheel for sglang_pages.py (not the project's
# .venv). The metrics module's import chain reaches torch, transformers and a few
# kernels-side helpers; these are the packages it needed, found by importing it.
# torchvision pulls a CUDA torch (~5 GB venv); nothing here uses a GPU.
set -euo pipefail
ROOT=${1:-/tmp/sgl}
mkdir -p "$ROOT"
cd "$ROOT"
pip download sglang==0.5.23 --no-deps -d .
unzip -q -o sglang-0.5.23-*.whl
python3 -m venv venv
venv/bin/pip install prometheus_client msgspec numpy "transformers==5.19.0" orjson psutil \
    pybase64 requests triton pillow starlette pyzmq torchvision IPython dill \
    "apache-tvm-ffi==0.1.11" sentencepiece compressed-tensors gguf
