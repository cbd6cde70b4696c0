#!/usr/bin/env bash
# Creates .venv and installs the pinned stack. Safe to rerun: pip skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    fbgemm=fbgemm-gpu==1.8.0
else
    fbgemm=fbgemm-gpu-cpu==1.8.0
fi

"${pip[@]}" torch==2.13.0 "$fbgemm"
"${pip[@]}" -e '.[test]'  # embshard, and torchrec's runtime needs (pyproject.toml)
# torchrec's metadata asks for the CUDA fbgemm-gpu, which fbgemm-gpu-cpu stands in for
# on CPU: --no-deps, and last, since pip reports that mismatch as an ERROR whenever a
# later install with dependencies touches a package torchrec requires.
"${pip[@]}" --no-deps torchrec==1.8.0
