"""The world: which job we are in and how it was joined, below everything that communicates.

- ``runtime.py``: the world we are in (ranks, who set it up, its timeout).
- ``launchers.py``: how each launcher's job is joined (horovodrun, mpirun/mpiexec, srun).
- ``groups.py``: process groups of our own, outside torch.distributed's registry (Note [Private groups]).
- ``peers.py``: the heartbeat, and errors that name the lost peer (Note [Lost peers]).
- ``control.py``: the control plane, small collectives on the training thread.
- ``channels.py``: each backend's own process groups (Note [C++ channels under Horovod]).
- ``job.py``: joining the world (``init()``) and leaving it in order (``shutdown()``, Note [Orderly exit]).
"""
