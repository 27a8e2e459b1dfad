"""The limit a server of one package can reach on one core: onnxruntime alone (one intra-op
thread, in this process, pinned with ``taskset`` by the caller), running the package's
model.onnx at the batch sizes the loaded servers formed, read from their /metrics
(``orthornn_batch_size``: sequences per run, sum over count). Prints, per server, its
mean batch, onnxruntime's microseconds a sequence at that batch (the median of repeated
runs of zeros of the package's longest
sequence), the server's microseconds a request at its
measured req/s, and their ratio; writes the same as JSON.

    python bench/load/model_limit.py PACKAGE OUT.json NAME=URL:REQ_S [NAME=URL:REQ_S ...]
"""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from pathlib import Path

from client import one_thread_session, us_per_sequence

BATCH = re.compile(r"^orthornn_batch_size_(sum|count)\{[^}]*\} ([0-9.e+]+)$", re.M)


def mean_batch(metrics_url: str) -> float:
    """Sequences per onnxruntime run over the server's life (every model it serves)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    totals = {"sum": 0.0, "count": 0.0}
    for kind, value in BATCH.findall(text):
        totals[kind] += float(value)
    if not totals["count"]:
        raise SystemExit(f"model_limit.py: {metrics_url} counted no batch")
    return totals["sum"] / totals["count"]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not all("=" in a and ":" in a for a in argv[2:]):
        print(__doc__, file=sys.stderr)
        return 2
    package, out = Path(argv[0]), Path(argv[1])
    spec = json.loads((package / "manifest.json").read_text())["input_spec"]
    # the package's longest sequence: the harness's bodies are that long (T=128)
    steps, features = int(spec["max_length"]), int(spec["feature_size"])
    session = one_thread_session(package / "model.onnx")
    rows = []
    for given in argv[2:]:
        name, rest = given.split("=", 1)
        url, req_s = rest.rsplit(":", 1)
        batch = mean_batch(url)
        own = us_per_sequence(session, max(1, round(batch)), steps, features)
        per_request = 1e6 / float(req_s)
        rows.append({"server": name, "mean_batch": round(batch, 2),
                     "onnxruntime_us_per_sequence": round(own, 1),
                     "server_us_per_request": round(per_request, 1),
                     "ratio": round(per_request / own, 2)})
    alone = us_per_sequence(session, 1, steps, features)
    print(f"onnxruntime alone (one thread, T={steps}, d={features}): {alone:.1f} us a "
          f"sequence at batch 1")
    print("| server | mean batch | onnxruntime us/sequence at it | server us/request | ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['server']} | {r['mean_batch']} | {r['onnxruntime_us_per_sequence']} | "
              f"{r['server_us_per_request']} | {r['ratio']} |")
    out.write_text(json.dumps({"batch_1_us_per_sequence": round(alone, 1), "rows": rows},
                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
