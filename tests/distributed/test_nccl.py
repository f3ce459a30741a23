"""F6: the CUDA path on real GPUs: NCCL with one GPU per rank, and Gloo with ranks sharing one GPU.

Every test skips, with its reason, where there are not enough GPUs, where
torch has no NCCL, or where dcredit_opt._C was built without CUDA; on a GPU
machine they run as they are (``pytest tests/distributed/test_nccl.py -s``
prints the dispatch rates). Ranks are spawned like the Gloo tests'. Under
NCCL dc.init() picks NCCL because CUDA is available; the shared-GPU tests
create a Gloo group first, which a single GPU can hold for several ranks,
so a machine with one GPU still runs the CUDA stream ordering on 2 ranks.
"""

import pytest
import torch
import torch.distributed as dist

from . import nccl_workers, spawn

TOL = 1e-4  # float32 on a GPU: sums in another order, and Adam's sqrt
WORLDS = (2, 4)


def _skip_reason(gpus: int, backend: str = "nccl"):
    count = torch.cuda.device_count()
    if count < gpus:
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU build")
        return f"needs {gpus} CUDA GPU(s), this machine has {count} ({build})"
    if backend == "nccl" and not dist.is_nccl_available():
        return "this torch has no NCCL"
    try:
        from dcredit_opt import _ext

        if not _ext.load().WITH_CUDA:
            return "dcredit_opt._C was built without CUDA: rebuild with a CUDA torch and toolkit"
    except ImportError as e:
        return f"dcredit_opt._C is not loadable: {e}"
    return None


def needs_gpus(gpus: int):
    reason = _skip_reason(gpus)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def _check_equivalence(results, world, backend="nccl"):
    for r in results:
        assert r["backend"] == backend, f"the default group is {r['backend']}, not {backend}"
    for key in results[0]:
        if key == "backend":
            continue
        diffs = [r[key][0] for r in results]
        sums = [r[key][1] for r in results]
        assert max(diffs) < TOL, f"{world} GPU(s), {key}: parameters differ from the reference by {max(diffs)}"
        assert len({round(s, 4) for s in sums}) == 1, f"{world} GPU(s), {key}: ranks disagree: {sums}"


# Both phases, windows 1 to all, 1 to 4 channels, blocks smaller than most
# tensors; one big-block config; one that profiles and switches to a D-Credit plan.
CONFIGS = ([{"opt": o, "phase2": p2, "window": w, "channels": c, "block_bytes": 96}
            for o in ("sgd", "adam") for p2 in (True, False) for w, c in ((1, 1), (2, 2), (4, 2), (-1, 4))]
           + [{"opt": "adamw", "phase2": True, "window": 2, "channels": 2, "block_bytes": 1 << 20},
              {"opt": "adam", "phase2": True, "window": 2, "channels": 2, "block_bytes": 128, "policy": "dcredit",
               "profile_iters": 3}])


@needs_gpus(1)
@pytest.mark.timeout(600)
def test_equivalence_on_one_gpu():
    _check_equivalence(spawn.run(nccl_workers.equivalence, 1, timeout_s=560, configs=CONFIGS), 1)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.timeout(600)
def test_equivalence_on_several_gpus(world):
    reason = _skip_reason(world)
    if reason:
        pytest.skip(reason)
    _check_equivalence(spawn.run(nccl_workers.equivalence, world, timeout_s=560, configs=CONFIGS), world)


@needs_gpus(1)
@pytest.mark.timeout(600)
def test_equivalence_two_ranks_sharing_one_gpu_over_gloo():
    results = spawn.run(nccl_workers.equivalence, 2, timeout_s=560, configs=CONFIGS, backend="gloo")
    _check_equivalence(results, 2, backend="gloo")


# (world, backend, GPUs needed): NCCL takes a GPU per rank, Gloo's ranks share GPU 0.
STREAM_CASES = [(1, "nccl", 1), (2, "nccl", 2), (2, "gloo", 1)]


@pytest.mark.parametrize("world,backend,gpus", STREAM_CASES)
@pytest.mark.timeout(300)
def test_gradient_written_late_on_a_side_stream_is_what_is_reduced(world, backend, gpus):
    reason = _skip_reason(gpus, backend)
    if reason:
        pytest.skip(reason)
    for r in spawn.run(nccl_workers.side_stream_engine, world, timeout_s=240, backend=backend):
        assert r["errors"] == [], r["errors"]
        # Without the event the same launch must race, or this test proves nothing.
        assert all(r["control_raced"]), f"the control run did not race: {r['control_raced']}"


@pytest.mark.parametrize("world,backend,gpus", STREAM_CASES)
@pytest.mark.timeout(300)
def test_training_on_a_side_stream_matches_the_reference(world, backend, gpus):
    reason = _skip_reason(gpus, backend)
    if reason:
        pytest.skip(reason)
    results = spawn.run(nccl_workers.side_stream_training, world, timeout_s=240, backend=backend)
    for r in results:
        assert r["diff"] < TOL, f"differs from the reference by {r['diff']}"
    assert len({round(r["checksum"], 4) for r in results}) == 1


@needs_gpus(1)
@pytest.mark.timeout(300)
def test_core_dispatch_on_cuda_tensors(capsys):
    """The dispatch microbenchmark on CUDA blocks: checks that it runs and is right; prints, never asserts, speed."""
    (r,) = spawn.run(nccl_workers.dispatch_rate, 1, timeout_s=240)
    assert r["values_ok"]
    with capsys.disabled():
        print(f"\ncore dispatch on {r['device']} (world of {r['world']}, NCCL, 1 KiB blocks): "
              f"{r['nccl_blocks_per_s']:,.0f} blocks/s through the CUDA adapter; "
              f"{r['noop_blocks_per_s']:,.0f} blocks/s through the scheduler alone (no-op engine); "
              f"{r['c10d_blocks_per_s']:,.0f} blocks/s as plain async c10d all_reduce calls")
