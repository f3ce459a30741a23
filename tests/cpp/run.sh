#!/usr/bin/env bash
# Builds and runs the core's C++ tests (csrc/core alone, no torch, no Python).
#
#   tests/cpp/run.sh [plain|thread|address|all] [core_tests options]
#
#   plain    g++ -std=c++17 -O1 -g                        (make test-cpp)
#   thread   the same with -fsanitize=thread              (make sanitize)
#   address  the same with -fsanitize=address,undefined   (make sanitize)
#   all      the three in turn
#
# core_tests options: --seed N, --stress-blocks N, a test-name substring.
# Exits non-zero when a test fails or a sanitizer reports anything: the
# sanitizers halt on their first report, and the log is also searched for
# reports in case one was printed without stopping the process.
# Binaries go to build/cpp/<mode>/ and are rebuilt only when a source changed.
set -euo pipefail
cd "$(dirname "$0")/../.."

CXX=${CXX:-g++}
mode=${1:-plain}
[[ $# -gt 0 ]] && shift

if [[ $mode == all ]]; then
  for m in plain thread address; do "$0" "$m" "$@"; done
  exit 0
fi

case $mode in
  plain) flags=() ;;
  thread) flags=(-fsanitize=thread) ;;
  address) flags=(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all) ;;
  *)
    echo "usage: $0 [plain|thread|address|all] [core_tests options]" >&2
    exit 2
    ;;
esac

sources=(tests/cpp/*.cc csrc/core/scheduler.cc csrc/core/backends.cc)
out=build/cpp/$mode
bin=$out/core_tests
mkdir -p "$out"
if [[ ! -x $bin ]] || [[ -n $(find tests/cpp csrc/core -newer "$bin" \( -name '*.cc' -o -name '*.h' -o -name run.sh \) -print -quit) ]]; then
  echo "building $bin"
  "$CXX" -std=c++17 -O1 -g -Wall -Wextra -pthread "${flags[@]}" -o "$bin" "${sources[@]}"
fi

export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
export ASAN_OPTIONS=halt_on_error=1:abort_on_error=1:detect_leaks=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1

log=$out/last.log
start=$(date +%s.%N)
set +e
"$bin" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
end=$(date +%s.%N)
if grep -qE 'ThreadSanitizer|AddressSanitizer|LeakSanitizer|runtime error:' "$log"; then
  echo "core_tests ($mode): sanitizer report in $log" >&2
  [[ $rc -eq 0 ]] && rc=1
fi
awk -v m="$mode" -v rc="$rc" -v s="$start" -v e="$end" 'BEGIN { printf "core_tests (%s): exit %d in %.1f s\n", m, rc, e - s }'
exit "$rc"
