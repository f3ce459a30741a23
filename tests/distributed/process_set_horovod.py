"""What each rank runs in test_process_sets.py under horovodrun (4 ranks): Horovod's process sets."""

from __future__ import annotations

import torch

import dcredit_opt as dc

from . import process_set_workers as pw
from .workers import error_of


def four_ranks() -> dict:
    import horovod.torch as hvd

    even, odd = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3])
    hvd.init(process_sets=[even, odd])
    dc.init()
    me = dc.rank()
    mine, theirs = (even, odd) if me in (0, 2) else (odd, even)
    out: dict = {}
    pw._pattern(out, "disjoint", lambda: pw.train_on(mine, mine.ranks))
    pw._pattern(out, "two_optimizers", lambda: pw._two_optimizers(mine.ranks, mine))
    # Horovod's meaning for a rank outside the set it is given: a plain optimizer there (rank 3, given the even
    # ranks' set, beside ranks 0 and 2 on it; rank 1 builds nothing).
    if me != 1:
        pw._pattern(out, "outside", lambda: pw.train_on(theirs if me == 3 else mine, [3] if me == 3 else mine.ranks,
                                                        seed=2))
    # Ours in a Horovod job: refused, naming Horovod's.
    pw._pattern(out, "ours", lambda: pw.train_on(dc.ProcessSet(mine.ranks), mine.ranks))
    # The blocks on Horovod's own operations over its set (Config(backend="horovod")); rank 3 again outside.
    pw._pattern(out, "disjoint/horovod", lambda: pw.train_on(mine, mine.ranks, backend="horovod", opt_name="adam"))
    if me != 1:
        pw._pattern(out, "outside/horovod", lambda: pw.train_on(theirs if me == 3 else mine,
                                                                [3] if me == 3 else mine.ranks, seed=4,
                                                                backend="horovod"))
    # Horovod's collectives through ours, on Horovod's sets; ours there refused, naming Horovod's.
    pw._pattern(out, "collectives", lambda: pw.collectives_on(mine, mine.ranks, theirs))
    out["collectives/ours"] = error_of(lambda: dc.allreduce(torch.ones(1), process_set=dc.ProcessSet(mine.ranks)))
    hvd.barrier()
    return out
