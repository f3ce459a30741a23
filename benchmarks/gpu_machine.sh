#!/usr/bin/env bash
# What to run on a machine with a CUDA GPU and many cores, in two parts that
# fit a short loan of such a machine (each well under 10 minutes).
#
#   bash benchmarks/gpu_machine.sh OUTDIR cuda    # CUDA build, CUDA/NCCL tests, one-GPU timings
#   bash benchmarks/gpu_machine.sh OUTDIR ranks   # 8 CPU ranks at 1 Gbit/s, the 2-rank bench's schemes
#
# It uses the machine's own python3 and torch (any torch with CUDA; the
# extension is built in place against it) and needs no network. Results land
# in OUTDIR as the harness writes them; copy them to benchmarks/results/.
set -uo pipefail
out=${1:?usage: gpu_machine.sh OUTDIR cuda|ranks}
part=${2:?usage: gpu_machine.sh OUTDIR cuda|ranks}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$out"

build() {
    if $PY -c "from dcredit_opt import _ext; _ext.load()" 2>/dev/null; then
        return 0
    fi
    local t0=$SECONDS
    if ! MAX_JOBS=$(nproc) $PY setup.py build_ext --inplace >"$out/build.log" 2>&1; then
        tail -40 "$out/build.log"
        return 1
    fi
    echo "build: $((SECONDS - t0)) s"
}

case "$part" in
cuda)
    echo "cores: $(nproc)"
    nvidia-smi -L
    $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda,
'nccl', torch.cuda.nccl.version())"
    build || exit 1
    $PY -c "from dcredit_opt import _ext; print('WITH_CUDA', _ext.load().WITH_CUDA)"
    # -rs lists every skip with its reason; -s prints the dispatch rates.
    timeout 180 $PY -m pytest -q -p no:cacheprovider -rs -s tests/distributed/test_nccl.py \
        tests/unit/test_cuda_guards.py tests/unit/test_gradient_path.py tests/unit/test_final_gate.py \
        tests/unit/test_foreach_reads.py 2>&1 | tee "$out/tests.log" | grep -v "^\.*$" | tail -25
    # One GPU: one rank (NCCL), so the difference between schemes is what each
    # costs around the same compute: DDP's hooks and buckets, our scheduler.
    # dc-dcredit-devwin: the credit window kept on the device (Config(device_windows=True), Note [Device
    # windows]), against the host's; off by default until this says it pays.
    timeout 240 $PY -m benchmarks.harness --device cuda --ranks 1 --network loopback --models vgg,gpt \
        --schemes compute,ddp,dc-dcredit,dc-dcredit-devwin --iters 40 --warmup 10 --rounds 2 --launch-timeout-s 60 \
        --results-dir "$out" --name 1gpu --no-progress 2>&1 | tail -60
    # Where the host waits for the device in steady iterations (torch.profiler), and what it does per iteration.
    for model in gpt vgg; do
        for way in dc ddp; do
            timeout 60 $PY -m benchmarks.gpu_trace --model $model --way $way --out "$out" 2>&1 | grep -v Warn | tail -9
        done
    done
    # Eight files at most are worth carrying back: the tables, the logs and the four traces; the plot is redrawn
    # from the JSON (benchmarks.report), and the build log matters only when the build failed (printed above).
    rm -f "$out"/*.png "$out/build.log"
    ;;
ranks)
    build || exit 1
    # Is the emulated network there (namespaces, tbf)? The harness falls back to loopback, and says so, if not.
    timeout 60 $PY -m benchmarks.netem --ranks 8 --mb 40 --reps 3
    timeout 420 $PY -m benchmarks.harness --models vgg,gpt --rates 1gbit --ranks 8 --iters 6 --warmup 2 \
        --rounds 1 --schemes compute,comm,ddp,dc-dcredit --launch-timeout-s 120 \
        --results-dir "$out" --name 8ranks --no-progress 2>&1 | tail -45
    ;;
*)
    echo "unknown part $part: cuda or ranks" >&2
    exit 2
    ;;
esac
