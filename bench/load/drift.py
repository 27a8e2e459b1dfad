"""What live drift costs the service: the same POST /predict load against `orthornn serve`
processes of this checkout on one package with a drift reference: drift off (--no-drift),
off again (the noise floor), and on (windows of 200 sequences tested in the worker
thread). Rounds alternate the servers (their order rotates each round); each ratio is the
median over the rounds of the per-round ratio to the first "off" server (throughput, p99
latency, and the server process's CPU time per request, which a busy machine disturbs
less than the throughput). Afterwards the "on" server's /metrics must show its windows'
scores. Prints a table and writes bench/results/drift.json.

    python bench/load/drift.py [--round-s 2] [--rounds 8] [--concurrency 32] [--hidden 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from bench.load.client import Server, load, request, round_options, summary  # noqa: E402


def build_package(work: Path, hidden: int, steps: int, features: int) -> Path:
    """A repository with the classifier "bench" (svdrnn, one training step: speed does not
    depend on accuracy) whose validation split is large enough for a drift reference."""
    from orthornn.export.builder.exporter import export_run
    from orthornn.training.config import TrainConfig
    from orthornn.training.trainer import train

    rng = np.random.default_rng(0)
    data = work / "data.npz"
    np.savez(data, x=rng.normal(size=(1000, steps, features)).astype(np.float32),
             y=rng.integers(0, 5, size=1000), labels=np.array(["a", "b", "c", "d", "e"]))
    train(TrainConfig(arch="svdrnn", task="classify", data=str(data), hidden_size=hidden,
                      steps=1, batch_size=16, log_every=1, out=str(work / "run")),
          progress=False)
    repo = work / "repo"
    path = export_run(work / "run", repo, "bench")
    if not (path / "reference.npz").is_file():
        raise RuntimeError("the bench package has no drift reference")
    return repo


def cpu_s(pid: int) -> float:
    """The process's CPU time so far (user + system, every thread), from /proc."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drift_lines(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return re.findall(r"^orthornn_drift_\w+\{.*$", text, re.M)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    round_options(parser, rounds=8, fresh=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(1)
    bodies = [json.dumps({"model": "bench", "inputs": [
        rng.normal(size=(args.steps, args.features)).round(4).tolist()]}).encode()
        for _ in range(64)]
    requests = [request("POST", "/predict", b) for b in bodies]
    with tempfile.TemporaryDirectory() as tmp:
        repo = build_package(Path(tmp), args.hidden, args.steps, args.features)
        flags = {"off": ["--no-drift"], "off again": ["--no-drift"], "on": ["--drift"]}
        servers = {name: Server(repo, True, extra) for name, extra in flags.items()}
        runs: dict[str, list] = {name: [] for name in servers}
        cpu: dict[str, list] = {name: [] for name in servers}  # CPU µs per request
        try:
            for s in servers.values():
                s.wait_ready()
            for s in servers.values():  # a first round each, not measured: every path warm
                asyncio.run(load(s.port, requests, args.concurrency, 0.5, 10**9))
            names = list(servers)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    before = cpu_s(servers[name].proc.pid)
                    runs[name].append(asyncio.run(load(servers[name].port, requests,
                                                       args.concurrency, args.round_s, 10**9)))
                    # the warm-up's requests (load's first 0.2 s) are not in the count:
                    # a ratio of CPU per request between servers, not an absolute
                    cpu[name].append((cpu_s(servers[name].proc.pid) - before) * 1e6
                                     / max(len(runs[name][-1][1]), 1))
                print(f"round {r + 1}/{args.rounds}", flush=True)
            tested = drift_lines(servers["on"].port)
            untested = drift_lines(servers["off"].port)
        finally:
            for s in servers.values():
                s.stop()
    rows = {}
    base = runs["off"]
    for name in names:
        row = summary(runs[name], digits=3, seconds=False)
        ratios = [len(o[1]) / o[0] / max(len(b[1]) / b[0], 1e-9)
                  for b, o in zip(base, runs[name], strict=True)]
        p99s = [float(np.percentile(o[1], 99) / np.percentile(b[1], 99))
                for b, o in zip(base, runs[name], strict=True)]
        row.update(ratio=round(float(np.median(ratios)), 3),
                   ratios=[round(x, 3) for x in ratios],
                   p99_ratio=round(float(np.median(p99s)), 3),
                   p99_ratios=[round(x, 3) for x in p99s],
                   cpu_us=round(float(np.median(cpu[name])), 1),
                   cpu_ratio=round(float(np.median([o / b for b, o in
                                                    zip(cpu["off"], cpu[name], strict=True)])), 3))
        rows[name] = row
    lines = ["| server | req/s | ratio to off (rounds) | p50 ms | p99 ms | p99 ratio | "
             "CPU µs/request | CPU ratio |", "| --- " * 8 + "|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['throughput']:.0f} | {row['ratio']:.3f} "
                     f"({', '.join(f'{x:.2f}' for x in row['ratios'])}) | {row['p50_ms']} | "
                     f"{row['p99_ms']} | {row['p99_ratio']:.3f} | {row['cpu_us']} | "
                     f"{row['cpu_ratio']:.3f} |")
    print("\n".join(lines))
    print("drift on, /metrics:", *tested, sep="\n  ")
    ok = bool(tested) and not untested
    write_result(args.out or ROOT / "bench" / "results" / "drift.json",
                 {"rows": rows, "concurrency": args.concurrency, "rounds": args.rounds,
                  "round_s": args.round_s, "metrics_on": tested, "ok": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
