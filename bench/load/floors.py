"""Where a request's time goes, by taking parts away: three `orthornn serve` processes of
this checkout under the same POST /predict load (wrk from CPU 0 at --concurrency, every
server pinned to the last CPU, one at a time in an order that rotates by round): as
shipped; with onnxruntime's run answered from memory (the outputs of its first batch of
that size: everything but the model runs); and with the dataplane's predict answered from
memory (the first answer: the HTTP layer, the lean path, the codecs and the metrics run,
no checks, no queue, no inference thread); and as shipped but with Linux's default
scheduling (``launch.batch_scheduling`` a no-op: what SCHED_BATCH buys). The differences
of the first three's microseconds a request (at their median req/s) are the three parts
of a request's cost on one core;
onnxruntime alone (this process, one thread, pinned there too) at the batch the shipped
server formed says what the model would cost without a server beside it.
Prints the table and writes bench/results/floors.json.

    python bench/load/floors.py [--rounds 6] [--round-s 3] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from bench.load.client import (  # noqa: E402
    Server,
    Wrk,
    bodies_for,
    build_package,
    one_thread_session,
    round_options,
    us_per_sequence,
    wrk_missing,
)

SHIPPED, NO_MODEL, NO_DATAPLANE = "as shipped", "model from memory", "dataplane from memory"
DEFAULT_SCHEDULING = "as shipped, default scheduling"
# sitecustomize of the cut-down servers (FLOOR names the cut)
CUT = """
import os
floor = os.environ.get("FLOOR")
if floor == "scheduling":  # launch.batch_scheduling made a no-op
    os.sched_setscheduler = lambda *args: None
elif floor == "model":
    from orthornn.service.registry.runtime import Runtime
    _run, _seen = Runtime.run, {}

    def run(self, graph, feeds):
        size = len(feeds["lengths"])
        if size not in _seen:
            _seen[size] = _run(self, graph, feeds)
        return _seen[size]
    Runtime.run = run
elif floor == "dataplane":
    from orthornn.service.dataplane.dataplane import DataPlane
    _predict, _answer = DataPlane.predict, []

    async def predict(self, req, key=b"", secret=None):
        if not _answer:
            _answer.append(await _predict(self, req, key, secret))
        return _answer[0]
    DataPlane.predict = predict
"""
BATCH = re.compile(r"^orthornn_batch_size_(sum|count)\{[^}]*\} ([0-9.e+]+)$", re.M)


def mean_batch(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        found = dict(BATCH.findall(answer.read().decode()))
    return float(found["sum"]) / max(float(found["count"]), 1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    round_options(parser, rounds=6, fresh=None)
    parser.set_defaults(round_s=3.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "floors.json"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.round_s <= 0:
        parser.error("--rounds must be at least 1 and --round-s positive")
    if (missing := wrk_missing()) is not None:
        parser.error(f"the load comes from wrk: {missing}")
    names = [SHIPPED, NO_MODEL, NO_DATAPLANE, DEFAULT_SCHEDULING]
    rps: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = build_package(work, args.hidden, args.steps, args.features)
        (work / "cut").mkdir()
        (work / "cut" / "sitecustomize.py").write_text(CUT)
        wrk = Wrk(work, bodies_for(args)[0], args.concurrency)
        floors = {SHIPPED: "", NO_MODEL: "model", NO_DATAPLANE: "dataplane",
                  DEFAULT_SCHEDULING: "scheduling"}
        servers = {n: Server(repo, True, ["--inference-threads", "1"],
                             {"PYTHONPATH": str(work / "cut"), "FLOOR": floors[n]})
                   for n in names}
        try:
            for s in servers.values():
                s.wait_ready()
                wrk.pin(s.proc.pid)
                wrk.run(s.port, 1)  # warm, not measured
            for r in range(args.rounds):
                for name in names[r % 4:] + names[:r % 4]:
                    took, n, errors, _, _ = wrk.run(servers[name].port, args.round_s)
                    if errors:
                        raise SystemExit(f"floors.py: {errors} errors from {name}")
                    rps[name].append(n / took)
                print(f"round {r + 1}/{args.rounds}", flush=True)
            batch = mean_batch(servers[SHIPPED].port)
            default_batch = mean_batch(servers[DEFAULT_SCHEDULING].port)
        finally:
            for s in servers.values():
                s.stop()
        os.sched_setaffinity(0, {wrk.cpu})
        alone = us_per_sequence(one_thread_session(repo / "bench" / "1" / "model.onnx"),
                                max(1, round(batch)), args.steps, args.features)
    us = {n: 1e6 / statistics.median(v) for n, v in rps.items()}
    parts = {"the model (onnxruntime's run, in the server)": us[SHIPPED] - us[NO_MODEL],
             "the dataplane, queue, batching and the inference thread":
                 us[NO_MODEL] - us[NO_DATAPLANE],
             "HTTP, the lean path, codecs, metrics": us[NO_DATAPLANE]}
    print(f"\n/predict at c={args.concurrency} (n={args.hidden}, T={args.steps}, "
          f"d={args.features}), {args.rounds} rounds of {args.round_s:g} s; the shipped "
          f"server's mean batch {batch:.1f}")
    print("| server | median req/s | us a request |")
    print("| --- | ---: | ---: |")
    for n in names:
        print(f"| {n} | {statistics.median(rps[n]):.0f} | {us[n]:.1f} |")
    print("\n| part of a request | us | share |")
    print("| --- | ---: | ---: |")
    for part, cost in parts.items():
        print(f"| {part} | {cost:.1f} | {cost / us[SHIPPED]:.1%} |")
    print(f"| onnxruntime alone at batch {round(batch)} (no server beside it) | {alone:.1f} | "
          f"{alone / us[SHIPPED]:.1%} |")
    ratios = [a / b for a, b in zip(rps[SHIPPED], rps[DEFAULT_SCHEDULING], strict=True)]
    print(f"\nSCHED_BATCH against the default scheduling: {statistics.median(ratios):.3f}x "
          f"the req/s (rounds {min(ratios):.3f}-{max(ratios):.3f}), mean batch "
          f"{batch:.1f} against {default_batch:.1f}")
    write_result(Path(args.out), {
        "concurrency": args.concurrency, "rounds": args.rounds, "round_s": args.round_s,
        "package": {"hidden": args.hidden, "steps": args.steps, "features": args.features},
        "mean_batch": round(batch, 2), "default_scheduling_mean_batch": round(default_batch, 2),
        "scheduling_ratio": round(statistics.median(ratios), 3), "rps": rps,
        "us_per_request": {n: round(v, 1) for n, v in us.items()},
        "parts_us": {p: round(v, 1) for p, v in parts.items()},
        "onnxruntime_alone_us_per_sequence": round(alone, 1)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
