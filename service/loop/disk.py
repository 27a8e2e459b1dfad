"""The capture folder's disk: space reserved ahead of an open segment (fallocate, so that a
full disk shows as a dropped record, never a torn one), the reasons a write fails as
metric labels, and the UTC days that name the day folders and time the retention."""

from __future__ import annotations

import ctypes
import datetime as dt
import errno
from collections.abc import Callable

#: the retention's check runs this long past each midnight (UTC), in a thread of its own
RETENTION_CHECK_AFTER_S = 60.0


def day_start(now: float) -> dt.datetime:
    """Midnight (UTC) that began NOW's day: the day folders' and the retention's day."""
    return dt.datetime.fromtimestamp(now, dt.UTC).replace(hour=0, minute=0, second=0,
                                                          microsecond=0)


def until_next_check(now: float) -> float:
    """Seconds from NOW to the next retention check (a minute past midnight, UTC)."""
    check = day_start(now).timestamp() + RETENTION_CHECK_AFTER_S  # today's
    return (check if now < check else check + 86_400) - now  # a UTC day: 86,400 s


RESERVE = 4 << 20  # disk space reserved ahead for an open segment (bytes)


KEEP_SIZE = 1  # FALLOC_FL_KEEP_SIZE: the blocks are reserved, the file's length stays


REASONS = {errno.ENOSPC: "disk_full", errno.EDQUOT: "disk_full", errno.EROFS: "read_only",
            errno.EACCES: "read_only", errno.EPERM: "read_only"}


def fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's fallocate(2) (Linux), else None: then no space is reserved ahead."""
    try:
        f = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    f.restype = ctypes.c_int
    return f
