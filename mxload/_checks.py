"""The integer check of mxload's public arguments (the DataLoader's options,
the samplers): one rule and one message style for all of them.

The rule: an ``int`` or numpy integer (anything with ``__index__``), never a
bool or a float, even a whole one (``batch_size=2.0`` is almost always a
computed value gone wrong, and silently truncating ``2.7`` would hide it).
The message names the argument, what is allowed and the value given:
``batch_size must be a positive integer or None, got 0``.
"""
from __future__ import annotations

import operator

import numpy as np

__all__ = ["check_int"]


def check_int(name: str, value: object, minimum: int | None = None, *, or_none: bool = False,
              hint: str = "") -> int:
    """`value` as a Python int no smaller than `minimum`, else ValueError.

    `or_none` only words the message (the caller handles None: "... or
    None"); `hint` follows what is allowed (e.g. what to pass instead).
    """
    if not isinstance(value, (bool, np.bool_)):
        try:
            number = operator.index(value)   # type: ignore[arg-type]  # refused below when it is not
        except TypeError:
            pass
        else:
            if minimum is None or number >= minimum:
                return number
    if minimum is None:
        allowed = "an integer"
    elif minimum in (0, 1):
        allowed = "a non-negative integer" if minimum == 0 else "a positive integer"
    else:
        allowed = f"an integer >= {minimum}"
    raise ValueError(f"{name} must be {allowed}{' or None' if or_none else ''}{hint}, got {value!r}")
