"""Horovod names that dcredit_opt does not provide: reading one says so, and what to use instead.

``import dcredit_opt as hvd`` runs a Horovod script whose calls are all in
``dcredit_opt.__all__``; for any name below, ``hvd.<name>`` raises
``MissingHorovodName`` (an ``AttributeError``, so ``hasattr(hvd, name)`` is
False, and a ``NotImplementedError``) at the line that reads it.
"""

from __future__ import annotations

_PROCESS_SETS = ("dcredit_opt's process sets need no registration: pass process_set=dcredit_opt.ProcessSet(ranks) "
                 "to DistributedOptimizer and to the collectives (allreduce, ...); in a Horovod job, register "
                 "Horovod's with horovod.torch's add_process_set and pass that")
_ALLTOALL = ("use torch.distributed.all_to_all_single (under torchrun), or allgather and keep the rows meant for "
             "this rank")
_REDUCESCATTER = ("use allreduce and keep this rank's part (out.chunk(size())[rank()]), or "
                  "torch.distributed.reduce_scatter_tensor (under torchrun)")

MISSING = {
    "alltoall": _ALLTOALL,
    "alltoall_async": _ALLTOALL,
    "reducescatter": _REDUCESCATTER,
    "reducescatter_async": _REDUCESCATTER,
    "grouped_reducescatter": _REDUCESCATTER,
    "grouped_reducescatter_async": _REDUCESCATTER,
    "sparse_allreduce_async": "sparse tensors are not reduced by the collectives: use "
                              "allreduce(tensor.to_dense()); DistributedOptimizer reduces sparse gradients itself "
                              "(as rows, or dense with sparse_as_dense=True)",
    "join": "uneven inputs are not supported: every rank must run the same number of steps (e.g. "
            "DistributedSampler(..., drop_last=True)); a rank that stops early makes the others raise "
            "a DCreditError (CollectiveTimeout or CollectiveError) within timeout_s",
    "add_process_set": _PROCESS_SETS,
    "remove_process_set": _PROCESS_SETS,
    "SyncBatchNorm": "use torch.nn.SyncBatchNorm (under torchrun), or horovod.torch.SyncBatchNorm",
    "elastic": "elastic training is not supported: restart the job from a checkpoint (torchrun --max-restarts)",
    "HorovodInternalError": "dcredit_opt's collectives raise DCreditError subclasses: CollectiveTimeout (a "
                            "TimeoutError: a peer did not call in time), MismatchError (a ValueError: the ranks "
                            "disagree) or CollectiveError (the transport failed; in a Horovod job, Horovod's own "
                            "HorovodInternalError, a RuntimeError): catch DCreditError, or RuntimeError for both",
}


class MissingHorovodName(AttributeError, NotImplementedError):
    """A Horovod name that dcredit_opt does not provide."""


def missing(name: str) -> MissingHorovodName | None:
    """The error for Horovod's ``name`` if dcredit_opt lacks it, else None."""
    advice = MISSING.get(name)
    if advice is None:
        return None
    return MissingHorovodName(f"dcredit_opt has no {name} (Horovod's horovod.torch.{name}): {advice}", name=name)


def module_getattr(name: str):
    """``dcredit_opt.__getattr__``: only called for names the package does not have."""
    error = missing(name)
    if error is not None:
        raise error
    raise AttributeError(f"module 'dcredit_opt' has no attribute {name!r}", name=name)
