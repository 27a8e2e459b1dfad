"""What counts as a number in a JSON document or an argument: booleans are ints in
Python and never numbers here; NaN and infinities are not finite numbers."""

from __future__ import annotations

import math
from typing import TypeGuard


def is_integer(value: object) -> TypeGuard[int]:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[float]:
    """A finite int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and \
        math.isfinite(value)
