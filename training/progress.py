"""Progress of long work (training, export, the quickstart), one system: tqdm.

On a terminal it is tqdm's bar. When stderr is not a terminal (a log file, a pipe, a
container's log), the same tqdm object writes one plain line at most every
``ORTHORNN_PROGRESS_INTERVAL_S`` seconds (default 5), plus a first and a last line:

    train scornn digits: step 120/600 (20%), 11.8 step/s, elapsed 0:10, ETA 0:40, loss=0.91
"""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm

INTERVAL_ENV = "ORTHORNN_PROGRESS_INTERVAL_S"
DEFAULT_INTERVAL_S = 5.0


def log_interval() -> float:
    """Seconds between two progress lines in a log (ORTHORNN_PROGRESS_INTERVAL_S)."""
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV} must be a number of seconds >= 0; got {text!r}") \
            from None
    if not value >= 0:
        raise ValueError(f"{INTERVAL_ENV} must be a number of seconds >= 0; got {text!r}")
    return value


def _clock(seconds: float | None) -> str:
    return "?" if seconds is None else tqdm.format_interval(max(0.0, seconds))


class LogLines(tqdm):
    """tqdm writing plain lines (step, rate, elapsed, ETA, postfix) instead of redrawing a
    bar: the first, then at most one per ``interval`` seconds, and the last."""

    def __init__(self, *args, interval: float | None = None, **kwargs):
        self._interval = log_interval() if interval is None else interval
        self._last_line = -float("inf")
        self._final = False
        kwargs.update(mininterval=self._interval, miniters=1, leave=False)
        super().__init__(*args, **kwargs)

    def line(self) -> str:
        d = self.format_dict
        n, total, elapsed = d["n"], d["total"], d["elapsed"]
        unit = d["unit"] or "it"
        rate = d["rate"] or (n / elapsed if elapsed and n else None)
        text = f"{d['prefix'] or 'progress'}: {unit} {n}"
        if total:
            text += f"/{total} ({100 * n / total:.0f}%)"
        text += f", {rate:.3g} {unit}/s" if rate else ", rate ?"
        text += f", elapsed {_clock(elapsed)}"
        if total and n < total:
            text += f", ETA {_clock((total - n) / rate if rate else None)}"
        if d.get("postfix"):
            text += f", {d['postfix']}"
        return text

    def display(self, msg=None, pos=None):
        if msg == "":  # tqdm clearing its bar: nothing to clear in a log
            return False
        now = time.monotonic()
        if not self._final and (now - self._last_line < self._interval
                                or (self.total and self.n >= self.total)):
            return True  # the last line comes from close()
        self._last_line = now
        self.fp.write(self.line() + "\n")
        self.fp.flush()
        return True

    def close(self):
        if not self.disable and hasattr(self, "last_print_t"):
            self._final = True
            with self._lock:
                self.display()
        super().close()


def progress_bar(*, total: int | None, desc: str, unit: str, enabled: bool = True,
                 initial: int = 0, file=None) -> tqdm:
    """tqdm's bar on a terminal, LogLines elsewhere; disabled when not ``enabled``."""
    stream = file if file is not None else sys.stderr
    kind = tqdm if stream.isatty() else LogLines
    return kind(total=total, initial=initial, desc=desc, unit=unit, disable=not enabled,
                file=stream, dynamic_ncols=True)
