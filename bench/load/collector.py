"""What the server's collector tuning (``service.server.launch.tune_collector``: the start's
heap frozen, the young generation collected less often) buys: the same POST /predict
load against two `orthornn serve` processes of this checkout, one as shipped and one with
Python's defaults (``gc.freeze`` and ``gc.set_threshold`` made no-ops before it starts),
in paired rounds as bench/load/capture.py runs them (both loaded at once from wrk on CPU
0, both pinned to the last CPU; who starts first alternates; a fresh pair every --fresh
rounds, one PYTHONHASHSEED a pair). Each server's collections are timed by a gc callback
(both servers carry it), so the table also says what share of its CPU each spent
collecting, per generation. Prints a table and writes bench/results/collector.json.

    python bench/load/collector.py [--rounds 20] [--fresh 4] [--round-s 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from bench.load.client import (  # noqa: E402
    Server,
    Wrk,
    bodies_for,
    build_package,
    mean_ratio,
    paired_round,
    reference_of,
    round_options,
    wrk_missing,
)

TUNED = "as shipped"
DEFAULTS = reference_of(TUNED)  # the pair's reference: Python's collector defaults

# sitecustomize of both servers: every collection timed (its thread's CPU time), the totals
# written to $COLLECTOR_OUT each half second; with COLLECTOR_DEFAULTS, the tuning undone
PROBE = """
import gc, json, os, threading, time
if os.environ.get("COLLECTOR_DEFAULTS"):
    gc.freeze = lambda: None
    gc.set_threshold = lambda *threshold: None
_totals = {"0": [0, 0.0], "1": [0, 0.0], "2": [0, 0.0]}
_started = [0.0]

def _timed(phase, info):
    if phase == "start":
        _started[0] = time.thread_time()
    else:
        total = _totals[str(info["generation"])]
        total[0] += 1
        total[1] += time.thread_time() - _started[0]

gc.callbacks.append(_timed)

def _write():
    while True:
        time.sleep(0.5)
        path = os.environ["COLLECTOR_OUT"]
        with open(path + ".tmp", "w") as f:
            json.dump(_totals, f)
        os.replace(path + ".tmp", path)

threading.Thread(target=_write, daemon=True).start()
"""


def collections(path: Path) -> dict[str, list[float]]:
    """A server's collections so far, per generation: [count, seconds]."""
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    round_options(parser, rounds=20, fresh=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.fresh < 1:
        parser.error(f"--rounds and --fresh: at least 1; got {args.rounds} and {args.fresh}")
    if (missing := wrk_missing()) is not None:
        parser.error(f"the load comes from wrk: {missing}")
    names = [TUNED]
    runs: dict[str, list] = {TUNED: []}
    spent = {n: [0.0, 0.0] for n in (TUNED, DEFAULTS)}
    done = {n: 0 for n in (TUNED, DEFAULTS)}
    gc_s = {n: {g: [0.0, 0.0] for g in "012"} for n in (TUNED, DEFAULTS)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = build_package(work, args.hidden, args.steps, args.features)
        (work / "probe").mkdir()
        (work / "probe" / "sitecustomize.py").write_text(PROBE)
        wrk = Wrk(work, bodies_for(args)[0], args.concurrency)
        measure = wrk.together
        for first in range(0, args.rounds, args.fresh):
            env = {"PYTHONHASHSEED": str(first // args.fresh + 1),
                   "PYTHONPATH": str(work / "probe")}
            outs = {TUNED: work / "tuned.json", DEFAULTS: work / "defaults.json"}
            servers = {
                TUNED: Server(repo, True, [], {**env, "COLLECTOR_OUT": str(outs[TUNED])}),
                DEFAULTS: Server(repo, True, [], {**env, "COLLECTOR_OUT": str(outs[DEFAULTS]),
                                                  "COLLECTOR_DEFAULTS": "1"})}
            try:
                for s in servers.values():
                    s.wait_ready()
                    wrk.pin(s.proc.pid)
                for s in servers.values():  # a first round each, not measured
                    measure([s.port], 1)
                before = {n: collections(outs[n]) for n in servers}
                for r in range(first, min(first + args.fresh, args.rounds)):
                    paired_round(r, servers, names, measure, args, runs, spent, done)
                    print(f"round {r + 1}/{args.rounds}", flush=True)
                time.sleep(0.6)  # the probes' next totals
                for n in servers:
                    after = collections(outs[n])
                    for g in "012":
                        gc_s[n][g][0] += after[g][0] - before[n][g][0]
                        gc_s[n][g][1] += after[g][1] - before[n][g][1]
            finally:
                for s in servers.values():
                    s.stop()
    processes = [r // args.fresh for r in range(args.rounds)]
    mine = [m for m, _ in runs[TUNED]]
    base = [b for _, b in runs[TUNED]]
    ratio, ratio_95 = mean_ratio([m[1] / m[0] / (b[1] / b[0]) for m, b in runs[TUNED]],
                                 processes)
    p99, p99_95 = mean_ratio([m[4] / b[4] for m, b in runs[TUNED]], processes)
    rows = {}
    for name, got in ((DEFAULTS, base), (TUNED, mine)):
        cpu = spent[name][1]  # the process's CPU in its pairs (paired_round)
        rows[name] = {
            "throughput": round(float(np.median([o[1] / o[0] for o in got])), 1),
            "p99_ms": round(float(np.median([o[4] for o in got])) * 1e3, 2),
            "process_cpu_us": round(cpu / max(done[name], 1) * 1e6, 1),
            "collections": {g: int(gc_s[name][g][0]) for g in "012"},
            "collecting_share": {g: round(gc_s[name][g][1] / max(cpu, 1e-9), 4)
                                 for g in "012"}}
    rows[TUNED].update(ratio=ratio, ratio_95=ratio_95, p99_ratio=p99, p99_ratio_95=p99_95)
    lines = ["| server | req/s | ratio (95%) | p99 ms | p99 ratio (95%) | process CPU "
             "µs/request | collecting, share of CPU (gen 0 / 1 / 2) | collections (0 / 1 / 2) |",
             "| --- " * 8 + "|"]
    for name, row in rows.items():
        share = row["collecting_share"]
        shown = ("1", "1") if name == DEFAULTS else (
            "{:.3f} ({:.3f}-{:.3f})".format(ratio, *ratio_95),
            "{:.3f} ({:.3f}-{:.3f})".format(p99, *p99_95))
        label = "Python's defaults" if name == DEFAULTS else TUNED
        lines.append(
            f"| {label} | {row['throughput']:.0f} | {shown[0]} | {row['p99_ms']:.1f} | "
            f"{shown[1]} | {row['process_cpu_us']:.0f} | "
            f"{sum(share.values()):.1%} ({share['0']:.1%} / {share['1']:.1%} / "
            f"{share['2']:.1%}) | " + " / ".join(str(row["collections"][g]) for g in "012")
            + " |")
    print("\n".join(lines))
    write_result(args.out or ROOT / "bench" / "results" / "collector.json",
                 {"concurrency": args.concurrency, "round_s": args.round_s,
                  "rounds": args.rounds, "fresh": args.fresh,
                  "machine": platform.processor() or platform.machine(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
