"""Where a rank's CPU goes: the seconds each kind of thread ran, read from ``/proc/self/task`` (Linux).

On a machine whose cores are all busy computing (two ranks on two cores),
every CPU second a communication library or our own threads spend is taken
from the training threads: an iteration can then be no shorter than the sum,
whatever the overlap. The worker reads each thread's CPU time when its
timed iterations start and when they end; the report shows
the difference per iteration, by kind of thread:

- ``training``: the thread that runs the training loop (forward, backward,
  step, the lazy step's applies);
- ``library``: threads that torch names for its communication libraries
  (Gloo's ``gloo_tcp_loop`` and ``pt_gloo_runloop``, NCCL's ``pt_nccl_*``,
  the TCP store);
- ``dcredit_opt``: ours (``dc_dispatch``, ``dc_waiter``: the C++ scheduler
  and the thread that waits for collectives);
- ``other``: everything unnamed (Horovod's background loop and its own Gloo,
  torch's intra-op pool, autograd's device threads).

A thread that starts and ends between the two readings is not counted.
Elsewhere than Linux, nothing is read and the report leaves the table out.
"""

from __future__ import annotations

import os

KINDS = ("training", "library", "dcredit_opt", "other")
_LIBRARY = ("gloo", "pt_gloo", "pt_nccl", "pt_tcpstore")
_OURS = ("dc_",)
_TASKS = "/proc/self/task"


def thread_cpu_s() -> dict[int, tuple[str, float]]:
    """Thread id -> (name, CPU seconds so far) for every thread of this process; {} where /proc is missing.
    Nanoseconds from ``schedstat`` where the kernel keeps it, else clock ticks (10 ms) from ``stat``."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return {}
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # it ended while we looked
        # "tid (name) state ..." where the name may hold spaces and parentheses: split at the last ')'.
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        try:
            with open(f"{_TASKS}/{tid}/schedstat") as f:
                seconds = int(f.read().split()[0]) / 1e9  # time on a CPU, in ns
        except (OSError, ValueError, IndexError):
            fields = stat[stat.rindex(")") + 2:].split()
            seconds = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        out[int(tid)] = (name, seconds)
    return out


def kind_of(tid: int, name: str, training_tid: int) -> str:
    if tid == training_tid:
        return "training"
    if name.startswith(_LIBRARY):
        return "library"
    if name.startswith(_OURS):
        return "dcredit_opt"
    return "other"


def cpu_by_kind(before: dict, after: dict, training_tid: int) -> dict[str, float]:
    """CPU seconds per kind of thread between two ``thread_cpu_s()`` readings (``{}`` if either is empty)."""
    if not before or not after:
        return {}
    total = dict.fromkeys(KINDS, 0.0)
    for tid, (name, seconds) in after.items():
        total[kind_of(tid, name, training_tid)] += seconds - before.get(tid, (name, 0.0))[1]
    return total
