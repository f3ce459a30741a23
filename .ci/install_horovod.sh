#!/usr/bin/env bash
# Install Horovod 0.28.1 (PyTorch + Gloo + MPI) into the dcredit-opt venv.
#
# dcredit-opt benchmarks and cross-checks its distributed optimizer against
# Horovod, so CI needs a Horovod build that matches the venv's torch and the
# MPICH that ships as a Python wheel inside the same venv.  No Horovod wheel
# exists for this combination, so it is compiled from the sdist here.
#
# Usage:   .ci/install_horovod.sh            # uses <repo>/.venv
#          VENV=/path/to/venv .ci/install_horovod.sh
# The script is idempotent: if horovod.torch already imports, it exits at once.
#
# Running Horovod afterwards (all with $VENV/bin first on PATH, so that
# horovodrun finds the venv's python, mpirun and MPICH libraries):
#   horovodrun -np 2 -H localhost:2 --gloo python train.py
#   horovodrun -np 2 -H localhost:2 --mpi  python train.py
#   mpiexec -n 2 python train.py
# Notes for the MPI launchers:
#   * horovodrun --mpi runs `mpirun --version` (first mpirun on PATH) to decide
#     which MPI it drives.  Stock Horovod 0.28.1 looks for the word "MPICH",
#     but the mpirun of the MPICH 5.x wheel only prints "HYDRA build details",
#     so unpatched horovodrun --mpi fails with "horovod does not find an
#     installed MPI".  This script patches the runner to treat the Hydra
#     banner as MPICH; without $VENV/bin first on PATH, --mpi would pick up
#     another mpirun (or none).
#   * No LD_LIBRARY_PATH or HOROVOD_* variables are needed at run time: the
#     MPICH compiler wrappers bake an rpath to $VENV/lib into the extension.
set -euo pipefail

HOROVOD_VERSION=0.28.1
# dcredit-opt is developed and tested against this exact torch; it is passed
# to every pip call so that no dependency resolution can upgrade it.
TORCH_PIN="torch==2.13.0"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

VENV="${VENV:-.venv}"
VENV="$(cd "$VENV" && pwd)"
PY="$VENV/bin/python"
if [[ ! -x "$PY" ]]; then
    echo "error: no python at $PY (set VENV to the dcredit-opt virtualenv)" >&2
    exit 1
fi

# The MPI compiler wrappers, mpirun and horovodrun all live in the venv.
export PATH="$VENV/bin:$PATH"

# --- fast path ---------------------------------------------------------------
if "$PY" -c "import horovod.torch" >/dev/null 2>&1; then
    echo "horovod.torch already importable in $VENV ($("$PY" -c 'import horovod; print(horovod.__version__)')); nothing to do."
    exit 0
fi

# --- prerequisites -----------------------------------------------------------
# Horovod's setup.py and its runtime (horovodrun) need these; the build runs
# without build isolation so that it compiles against the venv's own torch.
"$PY" -m pip install "$TORCH_PIN" packaging psutil pyyaml cloudpickle wheel setuptools

# Horovod needs CMake >= 3.13, and its bundled gloo/flatbuffers declare
# cmake_minimum_required(2.8.12), which CMake 4 rejects.  Prefer a suitable
# system CMake; otherwise put a 3.x CMake from PyPI into the venv.
cmake_ok() {
    local bin="$1" ver
    ver="$("$bin" --version 2>/dev/null | sed -n 's/^cmake version \([0-9][0-9.]*\).*/\1/p')" || return 1
    [[ -n "$ver" ]] || return 1
    "$PY" - "$ver" <<'EOF'
import sys
from packaging.version import Version
v = Version(sys.argv[1])
sys.exit(0 if Version("3.13") <= v < Version("4") else 1)
EOF
}
CMAKE_BIN=""
for candidate in "$VENV/bin/cmake" "$(command -v cmake || true)"; do
    if [[ -n "$candidate" && -x "$candidate" ]] && cmake_ok "$candidate"; then
        CMAKE_BIN="$candidate"
        break
    fi
done
if [[ -z "$CMAKE_BIN" ]]; then
    "$PY" -m pip install "$TORCH_PIN" "cmake>=3.13,<4"
    CMAKE_BIN="$VENV/bin/cmake"
    cmake_ok "$CMAKE_BIN" || { echo "error: no usable CMake 3.x" >&2; exit 1; }
fi
echo "using CMake: $CMAKE_BIN ($("$CMAKE_BIN" --version | head -n1))"

for tool in mpicc mpicxx mpirun; do
    if [[ "$(command -v "$tool" || true)" != "$VENV/bin/$tool" ]]; then
        echo "error: $tool not found in $VENV/bin (is the mpich wheel installed?)" >&2
        exit 1
    fi
done

# --- fetch and patch the sdist ------------------------------------------------
WORKDIR="$(mktemp -d "${TMPDIR:-/tmp}/dcredit-horovod.XXXXXX")"
trap 'rm -rf "$WORKDIR"' EXIT

"$PY" -m pip download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$WORKDIR"
tar -xzf "$WORKDIR/horovod-$HOROVOD_VERSION.tar.gz" -C "$WORKDIR"
SRC="$WORKDIR/horovod-$HOROVOD_VERSION"

# torch 2.x headers require C++17, but Horovod 0.28.1 still asks for C++14
# (and its bundled gloo for C++11).  Raise all three; fail if any edit misses,
# since a silent miss only shows up as a long, confusing compile error.
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
sed -i 's/-std=c++11/-std=c++17/' "$SRC/third_party/gloo/CMakeLists.txt"

require_edit() {
    local file="$1" want="$2" unwanted="$3"
    if ! grep -qF -- "$want" "$file" || grep -qF -- "$unwanted" "$file"; then
        echo "error: patching $file failed (expected '$want', no '$unwanted')" >&2
        exit 1
    fi
}
require_edit "$SRC/CMakeLists.txt" "set(CMAKE_CXX_STANDARD 17)" "set(CMAKE_CXX_STANDARD 14)"
require_edit "$SRC/horovod/torch/CMakeLists.txt" "set(CMAKE_CXX_STANDARD 17)" "set(CMAKE_CXX_STANDARD 14)"
require_edit "$SRC/third_party/gloo/CMakeLists.txt" "-std=c++17" "-std=c++11"

# horovodrun --mpi identifies the MPI flavour from `mpirun --version` and only
# accepts MPICH if that text contains "MPICH".  The Hydra launcher shipped with
# the MPICH wheel (MPICH 5.x) prints just "HYDRA build details: ...", so
# horovodrun would refuse to start ("horovod does not find an installed MPI").
# Teach it that a Hydra banner means MPICH (checked after Intel MPI, which also
# uses Hydra but names itself).
RUNNER="$SRC/horovod/runner/mpi_run.py"
"$PY" - "$RUNNER" <<'PYEOF'
import sys
path = sys.argv[1]
text = open(path).read()
anchor = ("        elif 'Intel(R) MPI' in output:\n"
          "            return _IMPI_IMPL\n")
if text.count(anchor) != 1:
    sys.exit(f"error: MPI detection code in {path} not found; cannot patch")
text = text.replace(anchor, anchor +
                    "        elif 'HYDRA build details' in output:\n"
                    "            return _MPICH_IMPL\n")
open(path, "w").write(text)
PYEOF
grep -qF "elif 'HYDRA build details' in output:" "$RUNNER" || {
    echo "error: patching $RUNNER failed" >&2
    exit 1
}

# --- build -------------------------------------------------------------------
echo "building Horovod $HOROVOD_VERSION (takes several minutes)..."
start=$SECONDS
(
    cd "$SRC"
    HOROVOD_WITH_PYTORCH=1 \
    HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITH_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_CMAKE="$CMAKE_BIN" \
    MAKEFLAGS="${MAKEFLAGS:--j2}" \
        "$PY" -m pip install --no-build-isolation --no-cache-dir "$TORCH_PIN" .
)
echo "Horovod build+install took $((SECONDS - start))s"

# --- verify ------------------------------------------------------------------
# Single process: the extension loads and both controllers were compiled in.
"$PY" -c "import horovod.torch as hvd; hvd.init(); print('size', hvd.size(), 'mpi_built', hvd.mpi_built(), 'gloo_built', hvd.gloo_built())"
"$PY" -c "import horovod.torch as hvd, sys; sys.exit(0 if hvd.mpi_built() and hvd.gloo_built() else 1)" || {
    echo "error: Horovod was built without MPI or Gloo support" >&2
    exit 1
}

# Two ranks through every launcher dcredit-opt's CI uses, each doing one
# allreduce so the chosen controller (Gloo or MPI) is really exercised.  The
# line is emitted with a single write: the launchers prefix every chunk of
# output with the rank, so print()'s separate writes can come out interleaved.
RANK_PROG='import sys, torch, horovod.torch as hvd
hvd.init()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
ctrl = "mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else "none"
sys.stdout.write("rank %d of %d sum %g via %s\n" % (hvd.rank(), hvd.size(), total, ctrl))'
check_ranks() {
    local label="$1" ctrl="$2"; shift 2
    local out rank
    echo "checking $label (2 ranks)"
    out="$("$@" 2>&1)" || { echo "$out" >&2; echo "error: $label failed" >&2; exit 1; }
    echo "$out"
    for rank in 0 1; do
        if ! grep -qF "rank $rank of 2 sum 3 via $ctrl" <<<"$out"; then
            echo "error: $label: rank $rank did not report 'rank $rank of 2 sum 3 via $ctrl'" >&2
            exit 1
        fi
    done
}
check_ranks "horovodrun --gloo" gloo horovodrun -np 2 -H localhost:2 --gloo "$PY" -c "$RANK_PROG"
check_ranks "horovodrun --mpi" mpi horovodrun -np 2 -H localhost:2 --mpi "$PY" -c "$RANK_PROG"
check_ranks "mpiexec" mpi mpiexec -n 2 "$PY" -c "$RANK_PROG"

echo "Horovod $HOROVOD_VERSION installed in $VENV"
