"""What the labels route's id index costs (``service/labels.py``), in this process.

N records of a digits classifier (T = 64, d = 1, ids of --id-length characters: 32 by
default, a uuid's hex; 128, the longest an id may be, for the bound), as capture writes
them, in segments of 50,000 under a temporary capture folder; then: the first full read
of the index, its memory per id (tracemalloc, in a second pass: it slows the first),
a read after 1,000 more records were appended to an open segment and a read with nothing
new (medians of five), and a batch of 10,000 labels checked (each record read back from
its offset) and written. The package is a manifest only (the labels read nothing else).
Prints a table and writes bench/results/labels.json.

    python bench/perf/labels.py [--records 200000] [--id-length 32]
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402

MANIFEST = {"format": "orthornn-package/1", "name": "digits", "version": 1, "arch": "scornn",
            "task": "classify", "mode": "dense", "opset": 17, "recurrence": "rnn",
            "graphs": {}, "io": {}, "files": {}, "hidden_size": 8,
            "input_spec": {"kind": "float", "feature_size": 1, "max_length": 64},
            "output_spec": {"kind": "logits", "size": 10, "state_size": 8},
            "labels": [str(i) for i in range(10)]}


ID_LENGTH = 32


def rid(i: int) -> str:
    """Record I's id: its uuid's hex, padded to ID_LENGTH characters."""
    return (uuid.UUID(int=i).hex + "-" * 128)[:ID_LENGTH]


def record_line(i: int, encoded: dict) -> bytes:
    return orjson.dumps({"id": rid(i), "time": 1.0, "route": "/predict",
                         "model": "digits", "version": 1, "inputs": [encoded],
                         "outputs": [{"label": "3", "index": 3, "probabilities": [0.1] * 10}],
                         "session": None, "position": None, "compute_ms": 0.5}) + b"\n"


def run(records: int, folder: Path) -> dict:
    from orthornn.service.loop.index import CaptureIndex
    from orthornn.service.loop.labels import LabelStore

    root, repo = folder / "captures", folder / "models"
    (repo / "digits" / "1").mkdir(parents=True)
    (repo / "digits" / "1" / "manifest.json").write_text(json.dumps(MANIFEST))
    x = np.random.default_rng(0).random((64, 1), np.float32)
    encoded = {"dtype": "<f4", "shape": [64, 1], "b64": base64.b64encode(x.tobytes()).decode()}
    day = root / "digits" / "1" / "2026-11-28"
    day.mkdir(parents=True)
    for n, start in enumerate(range(0, records, 50_000), 1):
        stop = min(records, start + 50_000)
        (day / f"r-{n}.jsonl").write_bytes(b"".join(record_line(i, encoded)
                                                    for i in range(start, stop)))
    size = sum(p.stat().st_size for p in day.iterdir())
    index = CaptureIndex(root, "digits")
    start = time.perf_counter()
    index.refresh()
    full = time.perf_counter() - start
    tracemalloc.start()
    second = CaptureIndex(root, "digits")
    second.refresh()
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del second
    appended, idle = [], []  # five rounds each: the medians
    for r in range(5):
        with open(day / "r-9999.jsonl.open", "ab") as f:
            f.write(b"".join(record_line(records + 1000 * r + i, encoded)
                             for i in range(1000)))
        start = time.perf_counter()
        index.refresh()
        appended.append(time.perf_counter() - start)
        start = time.perf_counter()
        index.refresh()
        idle.append(time.perf_counter() - start)
    store = LabelStore(root, repo, "bench")
    store._indexes["digits"] = index  # the index read above: the batch's cost alone
    step = max(1, records // 10_000)
    items = [{"id": rid(i), "label": i % 10}
             for i in range(0, records, step)][:10_000]
    start = time.perf_counter()
    store.add("digits", items)
    labelled = time.perf_counter() - start
    return {"records": records, "id_length": ID_LENGTH, "segment_mib": round(size / 2**20, 1),
            "full_read_s": round(full, 3), "mib_per_s": round(size / 2**20 / full, 1),
            "bytes_per_id": round(memory / records),
            "append_1000_ms": round(float(np.median(appended)) * 1e3, 2),
            "nothing_new_ms": round(float(np.median(idle)) * 1e3, 3), "labels": len(items),
            "labels_s": round(labelled, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--id-length", type=int, default=32)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "labels.json"))
    args = parser.parse_args()
    if args.records < 10_000:
        parser.error("--records: at least 10000")
    if not 32 <= args.id_length <= 128:
        parser.error(f"--id-length: 32 to 128 (an id's longest); got {args.id_length}")
    global ID_LENGTH
    ID_LENGTH = args.id_length
    with tempfile.TemporaryDirectory() as folder:
        result = run(args.records, Path(folder))
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    write_result(Path(args.out), result)


if __name__ == "__main__":
    main()
