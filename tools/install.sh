#!/usr/bin/env bash
# Creates .venv and installs the pinned stack. Safe to rerun: pip skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# FBGEMM and TorchRec releases each pair with one torch minor. EMBSHARD_TORCH picks the
# pairing (2.13 by default, what CI runs); TorchRec before 1.8 imports iopath at import.
case "${EMBSHARD_TORCH:-2.13}" in
    2.11) torch=2.11.0 fbgemm_version=1.6.0 torchrec=1.6.1 extra=(iopath) ;;
    2.12) torch=2.12.0 fbgemm_version=1.7.0 torchrec=1.7.0 extra=(iopath) ;;
    2.13) torch=2.13.0 fbgemm_version=1.8.0 torchrec=1.8.0 extra=() ;;
    *) echo "EMBSHARD_TORCH must be 2.11, 2.12 or 2.13, got '$EMBSHARD_TORCH'" >&2; exit 2 ;;
esac

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    fbgemm=fbgemm-gpu==$fbgemm_version
else
    fbgemm=fbgemm-gpu-cpu==$fbgemm_version
fi

"${pip[@]}" "torch==$torch" "$fbgemm" "${extra[@]}"
"${pip[@]}" -e '.[test]'  # embshard, and torchrec's runtime needs (pyproject.toml)
# torchrec's metadata asks for the CUDA fbgemm-gpu, which fbgemm-gpu-cpu stands in for
# on CPU: --no-deps, and last, since pip reports that mismatch as an ERROR whenever a
# later install with dependencies touches a package torchrec requires.
"${pip[@]}" --no-deps "torchrec==$torchrec"
