"""The exceptions: misuse detected while training, and a launch that cannot be joined."""


class DCreditError(RuntimeError):
    """Misuse detected during training (wrong call order, bad gradient)."""


class LaunchError(RuntimeError):
    """The launcher's environment is incomplete or its rendezvous does not answer."""

