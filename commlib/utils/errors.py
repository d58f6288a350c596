"""The exception types every layer raises."""


class CommlibError(RuntimeError):
    """A failure inside communication (timeout, peer mismatch, use after destroy)."""
