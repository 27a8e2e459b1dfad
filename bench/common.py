"""What every benchmark script shares: a timer and the atomic JSON result file."""

from __future__ import annotations

import json
import time
from pathlib import Path


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_result(path: Path, result) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")
