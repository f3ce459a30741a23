"""The exceptions: misuse detected while training, and a launch that cannot be joined."""


class DCreditError(RuntimeError):
    """Misuse detected during training (wrong call order, bad gradient)."""


class LaunchError(RuntimeError):
    """The launcher's environment is incomplete or its rendezvous does not answer."""


def at_rank(e: Exception, where: str) -> Exception:
    """Engine error ``e`` again, same type, saying which rank saw it and where."""
    from . import runtime

    rank = f"rank {runtime.rank()} of {runtime.size()}" if runtime.is_initialized() else "a rank that has shut down"
    return type(e)(f"{rank}, {where}: {e}")
