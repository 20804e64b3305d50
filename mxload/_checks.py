"""The checks of mxload's public arguments that several take (the DataLoader's
options, the samplers): integers, switches and keyword names, one rule and one
message style for each.

The rule: an ``int`` or numpy integer (anything with ``__index__``), never a
bool or a float, even a whole one (``batch_size=2.0`` is almost always a
computed value gone wrong, and silently truncating ``2.7`` would hide it).
The message names the argument, what is allowed and the value given:
``batch_size must be a positive integer or None, got 0``.

A switch is ``True`` or ``False`` (numpy's bools too), never any truthy value:
``in_order="no"`` would mean True.  A misspelled keyword gets the nearest one
named (``num_worker`` -> ``num_workers``).
"""
from __future__ import annotations

import difflib
import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np

__all__ = ["check_bool", "check_int", "suggesting_keywords"]

_F = TypeVar("_F", bound=Callable[..., Any])


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


def check_bool(name: str, value: object) -> bool:
    """`value` as a Python bool when it is one (or a numpy bool), else TypeError naming `name`."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    why = (f"; any non-empty string counts as True, so {value!r} would have meant True"
           if isinstance(value, str) and value else "")
    raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__}){why}")


def suggesting_keywords(function: _F) -> _F:
    """`function` (an ``__init__``) raising, for a keyword it does not take, Python's TypeError
    with the nearest keyword it does take named (difflib's closest match, if any is close)."""
    parameters = inspect.signature(function).parameters
    names = [p.name for p in parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return function

    @functools.wraps(function)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        for key in kwargs:
            if key not in parameters:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument "
                                f"{key!r}{hint}")
        return function(self, *args, **kwargs)

    return cast(_F, checked)
