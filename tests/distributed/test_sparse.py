"""Note [Sparse gradients]: sparse gradients (nn.Embedding/nn.EmbeddingBag with sparse=True) reduced as rows
train like synchronous data parallelism on 2 ranks, on every backend (torch/Gloo, mpiexec, horovodrun); what
cannot be reduced so is refused on every rank with a DCreditError naming the parameter and the fix.

One launch per backend runs every pattern (a launch costs seconds); the workers are in ``sparse_workers.py``.
"""

from __future__ import annotations

import pytest

from . import sparse_workers as sw
from . import spawn
from .test_backends import LAUNCHES, _tool

TOL = 2e-5
NAMES = [*sw.PATTERNS, *sw.RAISE]
_launched: dict = {}


def _results(backend: str) -> list:
    return spawn.launch_once(_launched, backend, lambda: _launch(backend))


def _launch(backend: str) -> list:
    if backend == "torch":
        return spawn.run(sw.patterns, 2, timeout_s=180, names=NAMES)
    spec = LAUNCHES[backend]
    reason = spec["missing"]()
    if reason:
        return pytest.skip.Exception(f"{backend}: {reason}")
    launcher = [_tool(spec["launcher"][0]), *spec["launcher"][1:]]
    return spawn.run_launched(sw.patterns, launcher, 2, timeout_s=240, names=NAMES, backend=spec["backend"],
                              horovod_first=spec["horovod_first"])


BACKENDS = ["torch", "mpi", "horovod-gloo", "horovod-mpi"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(sw.PATTERNS))
def test_sparse_gradients_train_like_synchronous(backend, name):
    per_rank = [r[name] for r in _results(backend)]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"{name}: rank {rank} raised {r['error']}\n{r.get('traceback', '')}"
        assert r["max_diff"] < TOL, f"{name}: rank {rank} differs from synchronous training by {r['max_diff']}"
        assert r["moved"] > 1e-3, f"{name}: the reference did not train"
        if name == "tied_to_a_dense_layer":  # its gradient is never sparse: reduced in blocks, dense
            assert r["sparse"] == [] and r["numels"][0] > 0, r
        else:
            assert r["sparse"] == ["emb.weight"], r["sparse"]
            assert r["numels"][0] == 0, "a sparse weight has no blocks after the first iteration"
    for a, b in zip(per_rank[0]["checksum"], per_rank[1]["checksum"]):
        assert bool((a == b).all()), f"{name}: the ranks' weights differ"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sparse_gradient_first_seen_after_the_first_iteration_is_refused(backend):
    """Refused on every rank in a backward that had released blocks already (Note [Interrupted backward]): the
    optimizer that takes over, as the refusal advises, trains like synchronous training."""
    per_rank = [r["sparse_first_seen_later"] for r in _results(backend)]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"rank {rank} raised {r['error']}\n{r.get('traceback', '')}"
        refused = r["refused"]
        assert "DCreditError" in refused, f"rank {rank}: {refused}"
        assert "'emb.weight'" in refused and "first iteration" in refused and "sparse_as_dense=True" in refused
        assert r["released"], f"rank {rank}: no block was released before the refusal, so nothing is tested"
        assert r["finished"] == r["released"], (
            f"rank {rank}: blocks {r['released']} were released before the refusal, but only {r['finished']} had "
            "finished when the refused optimizer closed: a peer may have started one that this rank never did")
        assert r["max_diff"] < TOL, f"rank {rank} differs from synchronous training by {r['max_diff']}"
        assert r["moved"] > 1e-3, "the reference did not train"
    assert per_rank[0]["released"] == per_rank[1]["released"], "the ranks released different blocks"
    for a, b in zip(per_rank[0]["checksum"], per_rank[1]["checksum"]):
        assert bool((a == b).all()), "the ranks' weights differ"
