"""How mxload's messages count things: ``count(1, "worker")`` is "1 worker", never
"1 workers" (``loader.autotune``'s reasons, the profiler's report, the bench)."""
from __future__ import annotations

__all__ = ["count"]


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, plural unless `n` is 1 (`plural` where adding "s" is wrong).

    Example:
        >>> count(1, "worker"), count(2, "worker"), count(0, "batch", "batches")
        ('1 worker', '2 workers', '0 batches')
    """
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
