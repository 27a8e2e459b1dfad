"""What a rollout on live traffic costs the service: the same POST /predict load (real
sklearn digits, one sequence per request) against `orthornn serve` processes of this
checkout, up side by side, each on its own copy of one repository holding two digits
versions (version 1 promoted; version 2 published through the gate, not promoted):

- "no rollout" (the baseline) and "no rollout, again" (the noise floor: two identical
  servers);
- "shadow 0.1": a running rollout at its shadow stage, --shadow 0.1: one request in ten
  also runs version 2 after its answer is computed, and the answers are compared;
- "canary N%": a running rollout at a canary step (no shadow stage): N% of the requests
  go to version 2 by the hash of their body. At 100% every request is routed (hashed) and
  all go to version 2, in one batcher: the routing's own cost. Between 0 and 100%, each
  version batches its own requests, so at c=32 two half-full batches run where one ran:
  the cost of serving two versions at once, beside the routing.

The plans are written with export.artifacts.rollout.start (a week-long interval) and the
servers run with --rollout-controller off, so every stage stays where the benchmark puts
it. Each round measures every server once, in an order that rotates each round, with a
"no rollout" measurement before the first and after each: a server's ratio in a round is
its throughput over the mean of the two "no rollout" measurements beside it (the
machine's load drifts; a neighbour measured seconds apart sees the same load), and the
ratio shown is the median over the rounds. The same for each server process's CPU time
per request (from /proc: Linux), the work a request costs, which the load of other
processes on a shared machine moves far less than throughput. The servers' own reports (GET
/v2/repository/models/digits/rollout) show that each measured what it claims: the
shadowed share, the skipped shadow runs, the candidate's share of a canary. Prints a
table and writes bench/results/rollout.json. Issue 32's bounds: shadow at 0.1 costs at
most 12% of /predict throughput, canary routing at most 2%.

    python bench/load/rollout.py [--round-s 1] [--rounds 9] [--concurrency 32] [--canary 5 50 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from bench.load.client import Server, load, request, summary  # noqa: E402

NAME = "digits"
BASELINE, NOISE, SHADOW = "no rollout", "no rollout, again", "shadow 0.1"
#: issue 32's bounds on the throughput ratio to no rollout
BOUNDS = {"shadow": 0.88, "canary": 0.98}


def build_repository(work: Path, hidden: int, steps: int) -> Path:
    """REPO/digits/1 (promoted) and REPO/digits/2 (passed the gate, not promoted): two
    svdrnn runs on the digits task, the second trained longer."""
    from orthornn.export.builder.exporter import export_run
    from orthornn.training.config import TrainConfig
    from orthornn.training.trainer import train

    repo = work / "repo"
    for version, budget in ((1, steps), (2, 2 * steps)):
        run = work / f"run{version}"
        train(TrainConfig(arch="svdrnn", task="digits", hidden_size=hidden, steps=budget,
                          batch_size=32, lr=0.01, optimizer="adam", log_every=budget,
                          out=str(run)), progress=False)
        if version == 1:
            export_run(run, repo, NAME)
        else:  # any accuracy passes: only the rollout's cost is measured here
            export_run(run, repo, NAME, gated=True, min_metric=0.0, tolerance=1.0,
                       promote=False)
    return repo


def configurations(canary: list[int]) -> dict[str, dict | None]:
    """Each server's rollout.start arguments (None: no plan)."""
    configs: dict[str, dict | None] = {BASELINE: None, NOISE: None,
                                       SHADOW: {"shadow": 0.1, "steps": [100]}}
    for weight in canary:
        steps = [weight, 100] if weight < 100 else [100]
        configs[f"canary {weight}%"] = {"shadow": 0.0, "steps": steps}
    return configs


def repositories(repo: Path, work: Path, configs: dict[str, dict | None]) -> dict[str, Path]:
    from orthornn.export.artifacts import rollout

    out = {}
    for i, (name, plan) in enumerate(configs.items()):
        copy = work / f"repo-{i}"
        shutil.copytree(repo, copy)
        if plan is not None:
            rollout.start(copy / NAME, 2, interval_s=7 * 86400.0, min_requests=10**9, **plan)
        out[name] = copy
    return out


def digits_requests(count: int) -> list[bytes]:
    from sklearn.datasets import load_digits

    images = load_digits().data[:count] / 16.0
    return [request("POST", "/predict", json.dumps(
        {"model": NAME, "inputs": [[[round(float(v), 4)] for v in image]]}).encode())
        for image in images]


def report(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/repository/models/{NAME}/rollout",
                                timeout=5) as answer:
        return json.loads(answer.read())


def observed(state: dict) -> dict | None:
    """What the server measured of its rollout (None: it has none)."""
    plan, rep = state.get("plan"), state.get("report")
    if plan is None:
        return None
    stage = plan["stages"][plan["stage"]]
    tally = {"compared": 0, "shadow_failures": 0, "skipped": 0, "candidate": 0, "promoted": 0}
    for t in ((rep or {}).get("stages") or {}).values():
        for key in ("compared", "shadow_failures", "skipped"):
            tally[key] += t[key]
        tally["candidate"] += t["candidate"]["requests"]
        tally["promoted"] += t["promoted"]["requests"]
    live = tally["candidate"] + tally["promoted"]
    return {"stage": stage, **tally,
            "shadowed_share": round((tally["compared"] + tally["shadow_failures"]
                                     + tally["skipped"]) / max(tally["promoted"], 1), 4),
            "candidate_share": round(tally["candidate"] / max(live, 1), 4)}


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far (Linux: /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(servers: dict[str, Server], requests: list[bytes], concurrency: int,
            round_s: float, rounds: int) -> dict:
    """Per server, its summary and the median over the rounds of its throughput over the
    mean of the baseline's (the first server's) measurements just before and after; the
    same for the server process's CPU time per request ("cpu_ratio": the work a request
    costs, which other processes' load on the machine barely moves)."""
    base, *others = list(servers)
    runs: dict[str, list] = {name: [] for name in servers}
    cpu: dict[str, list[float]] = {name: [] for name in servers}
    ratios: dict[str, list[float]] = {name: [] for name in others}
    cpu_ratios: dict[str, list[float]] = {name: [] for name in others}

    def once(name: str) -> tuple[float, float]:
        pid = servers[name].proc.pid
        start = cpu_seconds(pid)
        run = asyncio.run(load(servers[name].port, requests, concurrency, round_s, 10**9))
        # the warm-up's requests are not counted: its CPU is, a constant share of both
        per_request = (cpu_seconds(pid) - start) / max(len(run[1]), 1)
        runs[name].append(run)
        cpu[name].append(per_request)
        return len(run[1]) / run[0], per_request

    for r in range(rounds):
        before = once(base)
        for name in others[r % len(others):] + others[:r % len(others)]:
            throughput, per_request = once(name)
            after = once(base)
            ratios[name].append(throughput / max((before[0] + after[0]) / 2, 1e-9))
            cpu_ratios[name].append(per_request / max((before[1] + after[1]) / 2, 1e-12))
            before = after
    row: dict = {"concurrency": concurrency}
    for name in servers:
        row[name] = {**summary(runs[name], digits=3, seconds=False),
                     "cpu_us_per_request": round(1e6 * float(np.median(cpu[name])), 1)}
    for name in others:
        row[name].update(ratio=round(float(np.median(ratios[name])), 3),
                         ratios=[round(x, 3) for x in ratios[name]],
                         cpu_ratio=round(float(np.median(cpu_ratios[name])), 3),
                         cpu_ratios=[round(x, 3) for x in cpu_ratios[name]])
    return row


def table(rows: list[dict], names: list[str]) -> str:
    lines = ["| concurrency | server | req/s | ratio to no rollout | CPU us/request | CPU ratio "
             "| p50 ms | p99 ms | errors |",
             "| ----------- | ------ | ----- | ------------------- | -------------- | --------- "
             "| ------ | ------ | ------ |"]
    for row in rows:
        for name in names:
            s = row[name]
            ratio = f"{s['ratio']:.3f}" if "ratio" in s else "1"
            cpu_ratio = f"{s['cpu_ratio']:.3f}" if "cpu_ratio" in s else "1"
            lines.append(f"| {row['concurrency']:11} | {name:17} | {s['throughput']:6.0f} | "
                         f"{ratio:19} | {s['cpu_us_per_request']:14.0f} | {cpu_ratio:9} | "
                         f"{s['p50_ms']:6.2f} | {s['p99_ms']:6.2f} | {s['errors']:6} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round-s", type=float, default=1.0,
                        help="seconds per measurement (a server, a round, a concurrency)")
    parser.add_argument("--rounds", type=int, default=9,
                        help="rounds (the servers' order rotates); ratios are their median")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32])
    parser.add_argument("--canary", type=int, nargs="+", default=[5, 50, 100],
                        help="canary percentages, one server each")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=60,
                        help="version 1's training steps (version 2: twice as many)")
    parser.add_argument("--bodies", type=int, default=512,
                        help="distinct digits images sent (the canary hashes the body)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "rollout.json"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.round_s <= 0 or any(not 0 < w <= 100 for w in args.canary):
        parser.error("--rounds >= 1, --round-s > 0 and --canary percentages in (0, 100]")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    configs = configurations(args.canary)
    names = list(configs)
    rows: list[dict] = []
    servers: dict[str, Server] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repos = repositories(build_repository(work, args.hidden, args.train_steps), work,
                             configs)
        requests = digits_requests(args.bodies)
        try:
            for name in names:
                servers[name] = Server(repos[name], True, ["--rollout-controller", "off"])
            for server in servers.values():
                server.wait_ready()
            ports = {name: s.port for name, s in servers.items()}
            for name, port in ports.items():  # each server took its plan up
                plan = report(port)["plan"]
                assert (plan is None) == (configs[name] is None), (name, plan)
            for c in args.concurrency:
                rows.append(measure(servers, requests, c, args.round_s, args.rounds))
                print("\n".join(table(rows[-1:], names).splitlines()[2:]), flush=True)
            seen = {name: observed(report(port)) for name, port in ports.items()}
        finally:
            for server in servers.values():
                server.stop()
    print()
    print(table(rows, names))
    print()
    for name, what in seen.items():
        if what is not None:
            print(f"{name}: {what['compared']} shadow comparisons ({what['shadowed_share']:.3f} "
                  f"of the promoted version's requests, {what['skipped']} skipped as busy), "
                  f"candidate share of live requests {what['candidate_share']:.3f}")
    verdicts = {}
    for row in rows:
        for name in names[2:]:
            bound = BOUNDS["shadow" if name == SHADOW else "canary"]
            verdicts[f"{name} at c={row['concurrency']}"] = row[name]["ratio"] >= bound
    print("throughput within issue 32's bounds (shadow >= 0.88, canary >= 0.98 of no "
          "rollout): " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in verdicts.items())
          + f"; the noise floor (two identical servers): {rows[-1][NOISE]['ratio']:.3f}")
    result = {"model": {"arch": "svdrnn", "task": "digits", "hidden": args.hidden,
                        "train_steps": [args.train_steps, 2 * args.train_steps]},
              "round_s": args.round_s, "rounds": args.rounds, "bodies": args.bodies,
              "cpus": os.cpu_count(), "machine": platform.platform(), "rows": rows,
              "servers": {name: {"plan": configs[name], "observed": seen[name]}
                          for name in names},
              "bounds": BOUNDS, "within_bounds": verdicts}
    write_result(Path(args.out), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
