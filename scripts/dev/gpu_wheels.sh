#!/usr/bin/env bash
# Download the pure-Python packages `make gpu-check` needs beside what a bare GPU
# machine already has (torch, triton, transformers, numpy, ...): platformdirs,
# gguf, pydantic and pydantic's own needs, as wheels for that machine's Python.
# Run it on a machine that can reach a package registry; the folder (about 3 MB)
# travels with the working tree, and gpu_check.py unpacks from it only what the
# GPU machine's Python cannot import.
#
#   scripts/dev/gpu_wheels.sh [DIR] [PYTHON_VERSION]     (default build/gpu/wheels 3.12)
set -euo pipefail
dir=${1:-build/gpu/wheels}
pyver=${2:-3.12}
abi=cp${pyver/./}
pip=${PIP:-python3 -m pip}
mkdir -p "$dir"
common=(download --quiet --only-binary=:all: --python-version "$pyver" --implementation cp --abi "$abi"
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --dest "$dir")
# pydantic pins its compiled core exactly: let pip resolve that set for the target Python
$pip "${common[@]}" pydantic
# gguf's own needs (numpy, pyyaml, requests, tqdm) are already there with transformers
$pip "${common[@]}" --no-deps platformdirs gguf
ls -1 "$dir"
du -sh "$dir"
