"""The exception of misuse detected while training."""


class DCreditError(RuntimeError):
    """Misuse detected during training (wrong call order, bad gradient)."""
