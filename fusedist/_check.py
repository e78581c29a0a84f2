"""Argument checks shared by every layer: sizes, counts and flags as users pass them.

An int argument takes any integer a user may hold (Python ints, numpy integers, 0-d integer
tensors: whatever `operator.index` accepts) and refuses bools and floats (2.5, and 2.0 too: a
float where a count belongs is a mistake worth naming). Errors are ValueError (a size out of
range) or TypeError (not an integer), each naming the function, the argument and the value.
"""

from __future__ import annotations

import operator
from typing import Optional


def as_int(where: str, name: str, v, low: Optional[int] = None, high: Optional[int] = None,
           what: str = "") -> int:
    """`v` as a Python int in [low, high]; else a ValueError (out of range, or not an integer:
    kept a ValueError so that callers catch one type) naming `where`, `name` and `v`."""
    want = what or _range_text(low, high)
    if isinstance(v, bool):
        raise ValueError(f"{where}: {name} must be {want}, got the bool {v!r}")
    try:
        i = operator.index(v)
    except TypeError:
        kind = "a float" if isinstance(v, float) else type(v).__name__
        raise ValueError(f"{where}: {name} must be {want}, got {v!r} ({kind})") from None
    if (low is not None and i < low) or (high is not None and i > high):
        raise ValueError(f"{where}: {name} must be {want}, got {i}")
    return i


def as_bool(where: str, name: str, v, allow_none: bool = False) -> Optional[bool]:
    """`v` as a bool (Python or numpy bool; None when allow_none); a string such as "false"
    is refused (it is truthy), naming the argument."""
    if v is None and allow_none:
        return None
    if isinstance(v, bool):
        return v
    if type(v).__name__ == "bool_":       # numpy.bool_
        return bool(v)
    raise ValueError(f"{where}: {name} must be True or False{' or None' if allow_none else ''}"
                     f", got {v!r} ({type(v).__name__})")


def _range_text(low, high) -> str:
    if low is not None and high is not None:
        return f"an int in [{low}, {high}]"
    if low is not None:
        return f"an int >= {low}"
    if high is not None:
        return f"an int <= {high}"
    return "an int"
