"""The exceptions. Everything dcredit_opt raises about the running job is a ``DCreditError``, so that a
script catches one type; the subclasses keep the built-in bases that earlier versions raised
(``TimeoutError``, ``ValueError``), so code that caught those still does. A bad argument to a
constructor or a function is still a plain ``ValueError`` / ``TypeError``.

The C++ engine's exceptions derive from these too (``csrc/torch/bindings.cc``): ``_C.SchedulerError``
is a ``CollectiveError`` and ``_C.Timeout`` a ``CollectiveTimeout``.
"""


class DCreditError(RuntimeError):
    """About the running job: misuse detected while training (wrong call order, bad gradient), a collective
    that failed or timed out, ranks that disagree, a launch that cannot be joined."""


class CollectiveError(DCreditError):
    """A collective of the job failed or could not run: a peer left, crashed or closed its connection, or
    the engine was shut down or used out of order."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within ``timeout_s``: a peer stopped calling (an uneven last step),
    stalled or died."""


class MismatchError(DCreditError, ValueError):
    """The ranks disagree: a different model, different settings, or a different collective."""


class LaunchError(DCreditError):
    """The launcher's environment is incomplete or its rendezvous does not answer."""
