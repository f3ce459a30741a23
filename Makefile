# The README's two commands are `make demo` and `make test`; each installs
# what it needs first (idempotent, fast when already done).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION := 2.13.0
STAMP := $(VENV)/.dcredit-deps-$(TORCH_VERSION)
SOURCES := $(wildcard csrc/core/*.cc csrc/core/*.h csrc/torch/*.cc csrc/torch/*.h) setup.py
EXT_STAMP := $(VENV)/.dcredit-ext

.PHONY: install test test-unit test-distributed test-cpp demo bench horovod lint sanitize sanitize-ext clean faults soak

install: $(EXT_STAMP)

$(STAMP):
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -U pip setuptools wheel
	# Always pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PIP) install -q torch==$(TORCH_VERSION) numpy pytest pytest-timeout hypothesis mpi4py mpich \
		ninja tqdm matplotlib ruff
	touch $@

$(EXT_STAMP): $(STAMP) $(SOURCES)
	MAX_JOBS=2 $(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

# The suite runs every backend, so it installs Horovod first (about 8 minutes
# the first time, instant afterwards).
# The C++ core runs alone under ThreadSanitizer and ASan+UBSan first (about
# 2 minutes), then the whole extension under ASan+UBSan with the tests that
# drive it (about 5 minutes); any report fails the build.
test: install horovod sanitize sanitize-ext
	$(PY) -m pytest tests -q --durations=25

test-unit: install
	$(PY) -m pytest tests/unit -q

test-distributed: install
	$(PY) -m pytest tests/distributed -q

# The example on 2 local ranks, then DDP and dcredit-opt side by side on 2 ranks
# joined by an emulated 1 Gbit/s link (network namespaces when root, else
# loopback with a note). About 3 minutes on the 2-core development machine with
# other jobs running (load average 5), after install.
demo: install
	$(VENV)/bin/torchrun --nproc_per_node 2 --master_port 29531 examples/train.py
	@echo
	$(PY) examples/side_by_side.py

# The full comparison on an emulated network: ranks in network namespaces
# joined by rate-limited veth pairs (needs root; falls back to loopback with a
# warning). Results land in benchmarks/results/ as dated files.
BENCH_ARGS ?= --models vgg,gpt --rates 1gbit --ranks 2 --iters 15 --warmup 3 --rounds 2 \
	--schemes compute,comm,ddp,horovod,dc-wfbp,dc-mgwfbp,dc-oasr,dc-bytescheduler,dc-usbyte,dc-dear,dc-dcredit
bench: install horovod
	$(PY) -m benchmarks.harness $(BENCH_ARGS)

# Issue R1, outside CI. faults: one rank of 2 or 4 killed or stopped in every phase, 20 seeds on each backend
# (torch/Gloo, mpiexec, horovodrun --gloo); records in FAULTS_OUT (about an hour on 2 busy cores). soak: 4 ranks,
# 2,000 iterations, seeds 1 and 7; memory, threads and descriptors at iterations 100 and 2,000 (a few minutes).
FAULTS_OUT ?= /tmp/dcredit-faults.jsonl
faults: install horovod
	DC_KILL_SWEEP=1 DC_KILL_SWEEP_OUT=$(FAULTS_OUT) $(PY) -m pytest tests/distributed/test_kill_anywhere.py -q -rA

SOAK_OUT ?= /tmp/dcredit-soak.jsonl
soak: install
	DC_SOAK=1 DC_SOAK_OUT=$(SOAK_OUT) $(PY) -m pytest tests/distributed/test_soak.py -q -s

horovod: install
	PATH="$(abspath $(VENV))/bin:$$PATH" VENV=$(VENV) bash .ci/install_horovod.sh

lint: install
	$(VENV)/bin/ruff check --line-length 120 dcredit_opt tests examples benchmarks

clean:
	rm -rf build *.egg-info dcredit_opt/_C*.so dcredit_opt/_build_info.py $(EXT_STAMP)

# The C++ core alone (no torch): invariants and a multi-threaded stress test.
test-cpp:
	bash tests/cpp/run.sh plain

# The same tests under ThreadSanitizer, then AddressSanitizer + UBSan; any report fails.
sanitize:
	bash tests/cpp/run.sh thread
	bash tests/cpp/run.sh address

# The whole extension (csrc/torch too: the autograd hooks, the side sums, the
# c10d backend) under AddressSanitizer + UBSan, with the Python tests that drive
# it (build/asan-ext/, rebuilt when a source changed); any report fails.
sanitize-ext: install
	bash tests/cpp/ext_sanitize.sh

# The CUDA build of the extension, compiled with this machine's CUDA toolkit
# against the CUDA torch in a separate venv (.venv-cuda, about 5.5 GB); needs
# no GPU. CI runs it only when DCREDIT_CUDA_CHECK=1.
.PHONY: cuda-check
cuda-check:
	bash .ci/cuda_check.sh
