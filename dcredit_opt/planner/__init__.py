"""The planner: pure functions from a measured profile to an executable plan.

``plan`` (the format the runtime executes), ``profile`` (what was measured),
``cost`` (the alpha-beta model), ``simulate`` (one iteration replayed under
the runtime's rules), ``dcredit`` (D-Credit's windows), ``usbyte`` and
``oasr`` (those papers' algorithms), ``policies`` (every policy and the
registry), ``search`` (the D-Credit planner's search over its own and the
baselines' plans). No processes, no torch.
"""

from .floors import lower_bound, synchronous_floor
from .plan import ALL, Plan, PlanError, validate
from .policies import POLICIES, make_plan
from .profile import Profile, ProfileError, TensorProfile, bytes_of
from .simulate import SimResult, simulate

__all__ = [
    "ALL",
    "POLICIES",
    "Plan",
    "PlanError",
    "Profile",
    "ProfileError",
    "SimResult",
    "TensorProfile",
    "bytes_of",
    "lower_bound",
    "make_plan",
    "simulate",
    "synchronous_floor",
    "validate",
]
