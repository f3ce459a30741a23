"""What collective each block runs: the values of ``BlockOp`` in ``csrc/core/scheduler.h``.

The lowest module of the package (it imports nothing), so that the planner,
which writes them into plans, and the backends, which launch them, share one
definition (what each costs: ``Profile.stage_cost``; Note [Two-stage blocks]
in ``csrc/core/scheduler.cc``).
"""

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = 0, 1, 2
