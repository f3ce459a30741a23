#!/usr/bin/env bash
# The extension as users load it (csrc/core and csrc/torch: the gradient
# path's autograd hooks, the side sums, the engine and its c10d backend)
# built with AddressSanitizer + UBSan, and the Python tests that drive it run
# against that build. tests/cpp/run.sh covers csrc/core alone, without torch;
# this covers the code that runs inside autograd and c10d.
#
#   tests/cpp/ext_sanitize.sh [test files or pytest options]   (make sanitize-ext)
#
# The build goes to build/asan-ext/ (rebuilt only when a source changed),
# beside a copy of the package's Python, which PYTHONPATH puts first (and
# PYTHONSAFEPATH keeps first, in the ranks the tests start too); the
# ASan runtime is preloaded into the interpreter (torch and Python are not
# instrumented; leaks are not checked, since the interpreter keeps its own
# at exit). Exits non-zero when a test fails or a sanitizer reports anything:
# both halt on their first report, and the log is searched as well.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PY:-.venv/bin/python}
CXX=${CXX:-g++}
out=build/asan-ext
mkdir -p "$out"

stamp=$out/sources.sha
sum=$(cat csrc/core/*.cc csrc/core/*.h csrc/torch/*.cc csrc/torch/*.h setup.py | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$sum" ]]; then
  echo "building the extension with -fsanitize=address,undefined (a few minutes)"
  DCREDIT_SANITIZE=address MAX_JOBS=${MAX_JOBS:-2} "$PY" setup.py -q build_ext --build-lib "$out/lib" \
    --build-temp "$out/tmp" >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  echo "$sum" >"$stamp"
fi
rm -rf "$out/pkg"
mkdir -p "$out/pkg"
cp -r dcredit_opt "$out/pkg/"
find "$out/pkg" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
cp "$out"/lib/dcredit_opt/_C*.so "$out/pkg/dcredit_opt/"

if [[ $# -eq 0 ]]; then
  set -- tests/unit/test_gradient_path.py tests/unit/test_side_sums.py tests/unit/test_scheduler.py \
    tests/unit/test_zeroed_while_pending.py tests/unit/test_reads.py tests/unit/test_foreach_reads.py \
    tests/unit/test_collectives.py tests/unit/test_reduce_ops.py tests/unit/test_kept_aliases.py \
    tests/distributed/test_equivalence.py
fi
preload="$($CXX -print-file-name=libasan.so):$($CXX -print-file-name=libubsan.so)"
# The sanitized package first, then the checkout (for `tests`); PYTHONSAFEPATH keeps `python -m` and a script's
# folder from going first, here and in every process the tests start (the ranks of the 2-rank tests).
export PYTHONSAFEPATH=1 PYTHONPATH="$PWD/$out/pkg:$PWD"
# The tests, and the ranks they start with `python -m` from the checkout, must load the sanitized build, or this
# checks nothing: asked the way the ranks are started.
cat >"$out/pkg/dc_which_ext.py" <<'PY'
import sys
from dcredit_opt import _ext
f = _ext.load().__file__
sys.exit(0 if f.startswith(sys.argv[1]) else f"ext_sanitize: loaded {f}, not the sanitized build")
PY
LD_PRELOAD=$preload ASAN_OPTIONS=detect_leaks=0 "$PY" -m dc_which_ext "$PWD/$out/pkg/"
log=$out/pytest.log
status=0
LD_PRELOAD=$preload \
  ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1 \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  "$PY" -m pytest -q -p no:cacheprovider --import-mode=append "$@" 2>&1 | tee "$log" || status=$?
if grep -E "ERROR: (Address|Undefined|Leak)Sanitizer|runtime error:" "$log" >/dev/null; then
  echo "ext_sanitize: a sanitizer report is in $log" >&2
  exit 1
fi
exit $status
