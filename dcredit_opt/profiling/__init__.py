"""Measuring the live job and turning it into plans: per-tensor compute times and the network's alpha/beta
(``profiler.py``), a ``Config`` and a profile made into a plan (``planning.py``, the runtime's door into the
pure planner), and re-planning while training (``replanner.py``). Above the world and the planner; the
optimizer runs it."""
