#!/usr/bin/env bash
# make cuda-check: build the CUDA variant of dcredit_opt._C on a machine
# without a GPU, and fail on any compile or link error.
#
# - A separate venv (.venv-cuda, or $CUDA_VENV) holds the CUDA build of torch
#   that lies on local disk (torch==2.14.1, CUDA 13.0, about 5.5 GB with its
#   CUDA libraries); the main venv's CPU torch is never touched.
# - The build runs in a copy of the tree kept inside the venv (ignored by
#   git): building in place would overwrite the main build's
#   dcredit_opt/_C*.so and _build_info.py. The copy keeps the sources' times
#   and its build/ folder, so a rerun recompiles only what changed.
# - A shared library links even with undefined symbols, so the link check is
#   loading it (Python loads extensions with RTLD_NOW). Loading needs no GPU.
# - Then the CUDA build's CPU behaviour: the guards' unit tests, and the GPU
#   tests, which here must skip with their reasons.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${CUDA_VENV:-.venv-cuda}
TORCH_VERSION=2.14.1
STAMP=$VENV/.dcredit-cuda-deps-$TORCH_VERSION
start=$(date +%s)

if [ ! -f "$STAMP" ]; then
  test -x "$VENV/bin/python" || python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip
  # Always pinned: this is the CUDA build on local disk, matching nvcc 13.0.
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" numpy ninja setuptools wheel pytest pytest-timeout
  touch "$STAMP"
fi
PY=$ROOT/$VENV/bin/python
export PATH="$ROOT/$VENV/bin:$PATH"  # ninja

# The toolkit: CUDA_HOME if set, else the one above the nvcc on PATH, else
# /usr/local/cuda. torch's own guess stops at the first nvcc it finds, which
# here is a wrapper script in /usr/local/bin, so check for the headers.
if [ -z "${CUDA_HOME:-}" ]; then
  NVCC=$(command -v nvcc || true)
  for candidate in ${NVCC:+"$(dirname "$(dirname "$(readlink -f "$NVCC")")")"} /usr/local/cuda; do
    if [ -f "$candidate/include/cuda_runtime_api.h" ]; then CUDA_HOME=$candidate; break; fi
  done
  if [ -z "${CUDA_HOME:-}" ]; then echo "cuda-check: no CUDA toolkit found; set CUDA_HOME" >&2; exit 1; fi
  export CUDA_HOME
fi
echo "cuda-check: CUDA_HOME=$CUDA_HOME"
"$PY" -c "import torch; assert torch.version.cuda, 'torch in $VENV has no CUDA'; \
print('cuda-check: torch', torch.__version__, 'CUDA', torch.version.cuda, 'NCCL', torch.cuda.nccl.version())"
"$CUDA_HOME/bin/nvcc" --version | tail -n 2

WORK=$ROOT/$VENV/dcredit-tree
mkdir -p "$WORK"
rm -rf "$WORK/setup.py" "$WORK/csrc" "$WORK/dcredit_opt" "$WORK/tests"
tar -C "$ROOT" --exclude='__pycache__' --exclude='*.so' --exclude='_build_info.py' \
  -cf - setup.py csrc dcredit_opt tests | tar -C "$WORK" -xf -
cd "$WORK"

build_start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-2} "$PY" setup.py -q build_ext --inplace
echo "cuda-check: compiled in $(($(date +%s) - build_start)) s"

"$PY" - <<'EOF'
import glob
import subprocess

from dcredit_opt import _build_info, _ext

C = _ext.load()  # dlopen with RTLD_NOW: every symbol must resolve
assert C.WITH_CUDA is True and _build_info.WITH_CUDA is True, "built without the CUDA pieces"
(so,) = glob.glob("dcredit_opt/_C*.so")
needed = subprocess.run(["readelf", "-d", so], capture_output=True, text=True, check=True).stdout
undefined = subprocess.run(["nm", "-D", "--undefined-only", so], capture_output=True, text=True, check=True).stdout
for lib in ("c10_cuda", "cudart"):  # torch_cuda is dropped: nothing of it is used
    assert lib in needed, f"{so} does not link {lib}"
for sym in ("cudaLaunchHostFunc", "cudaStreamWaitEvent", "cudaStreamCreateWithFlags"):
    assert sym in undefined, f"{so} does not call {sym}"
print(f"cuda-check: {so} loads; WITH_CUDA={C.WITH_CUDA}, CUDA {_build_info.CUDA_VERSION}")
EOF

"$PY" -m pytest -q -p no:cacheprovider -rs tests/unit/test_cuda_guards.py tests/distributed/test_nccl.py
echo "cuda-check: OK in $(($(date +%s) - start)) s"
