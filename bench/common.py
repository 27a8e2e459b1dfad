"""What every benchmark script shares: a timer and the atomic JSON result file."""

from __future__ import annotations

import time
from pathlib import Path

from orthornn.export.artifacts.records import write_json


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_result(path: Path, result) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, result)
    print(f"wrote {path}")


def chosen_rows(parser, text: str, allowed) -> list[str]:
    """The rows a comma-separated --rows names; a parser error (exit 2) naming the
    allowed ones when it names none or an unknown one."""
    rows = [r for r in text.split(",") if r]
    if not rows or any(r not in allowed for r in rows):
        parser.error(f"--rows must name some of {', '.join(allowed)}; got {text!r}")
    return rows


def percentile_ms(seconds_list, q: float) -> float:
    """The Q-th percentile of latencies given in seconds, in milliseconds (2 decimals;
    NaN for none)."""
    import numpy as np

    if not len(seconds_list):
        return float("nan")
    return round(1000 * float(np.percentile(np.asarray(seconds_list), q)), 2)
