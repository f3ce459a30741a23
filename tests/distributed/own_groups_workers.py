"""What each rank runs in test_own_groups.py: under mpiexec and horovodrun, dcredit_opt's groups are its own
(Note [Private groups] in world/groups.py), so the script's torch.distributed stays the script's.

The script builds an optimizer, trains, then calls ``dist.init_process_group()`` itself (on a file store the test
names), uses its default group, and trains on, with the same optimizer and with one built afterwards on backend
"torch" (Gloo channels of ours); both train as synchronous data parallelism does (the reference of
``workers.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import dcredit_opt as dc

from . import workers as w


def init_later(store_path: str, horovod_first: bool = False, steps: int = 4, leave: bool = True) -> dict:
    w._join(horovod_first)
    rank, world = dc.rank(), dc.size()
    out = {"before": dist.is_initialized()}
    config = dc.Config(policy="fixed", block_bytes=256, window=2, channels=2)
    model, ref, opt, ropt = w._make("sgd", config)
    out["after_build"] = dist.is_initialized()
    for step in range(steps):
        w.step_both(model, ref, opt, ropt, step, rank, world)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    out["after_init"] = dist.is_initialized()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    out["sum"] = float(total)
    for step in range(steps, 2 * steps):
        w.step_both(model, ref, opt, ropt, step, rank, world)
    opt.synchronize()
    out["diff"] = w.max_diff(model, ref)
    # Built while the script's default group exists; on Gloo channels of ours under every launcher.
    model2, ref2, opt2, ropt2 = w._make("adam", dc.Config(policy="fixed", block_bytes=256, backend="torch"))
    for step in range(steps):
        w.step_both(model2, ref2, opt2, ropt2, step, rank, world)
    opt2.synchronize()
    out["diff_built_after"] = w.max_diff(model2, ref2)
    out["checksum"] = w.checksum(model) + w.checksum(model2)
    if leave:
        dc.shutdown()
        out["still_initialized"] = dist.is_initialized()  # ours are gone; the script's default group is not
        dist.barrier()
        dist.destroy_process_group()
    return out
