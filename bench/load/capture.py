"""What capture costs the service: the same POST /predict load (distinct X-Request-Id per
request) against `orthornn serve` processes of this checkout up side by side on one
package: capture off, off again (the noise floor), on for every request (--capture), on for
10% (--capture-sample 0.1), and, where this machine lets a tmpfs be mounted, on for every
request into a full disk (records dropped, counted). Rounds alternate the servers (their
order rotates each round); each ratio is the median over the rounds of the per-round
throughput ratio to the first "off" server. Afterwards each capturing server's records
plus drops are checked against the requests it answered 200 (its /metrics), and the full
disk's server's resident memory growth is reported. Prints a table and writes
bench/results/capture.json.

    python bench/load/capture.py [--round-s 2] [--rounds 6] [--concurrency 32] [--hidden 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from bench.load.client import Server, build_package, load, summary  # noqa: E402


def requests_with_ids(bodies: list[bytes], count: int) -> list[bytes]:
    """COUNT requests cycling over BODIES, each with an X-Request-Id of its own."""
    out = []
    for i in range(count):
        body = bodies[i % len(bodies)]
        out.append(f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}"
                   f"\r\nContent-Type: application/json\r\nX-Request-Id: bench-{i}\r\n\r\n"
                   .encode() + body)
    return out


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def answered(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(
        r'^orthornn_requests_total{endpoint="/predict",[^}]*status="200"[^}]*} (\S+)$',
        text, re.M))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def full_disk(folder: Path) -> bool:
    """Mount a 64 KiB tmpfs on FOLDER and fill it (False: this machine does not allow it)."""
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                             capture_output=True)
    if mounted.returncode != 0:
        return False
    with open(folder / "filler", "wb") as f, contextlib.suppress(OSError):
        f.write(b"\0" * (1 << 20))  # until the disk is full
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round-s", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--features", type=int, default=9)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "capture.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = build_package(work, args.hidden, args.steps, args.features)
        rng = np.random.default_rng(1)
        bodies = [json.dumps({"model": "bench", "inputs": [
            rng.normal(size=(args.steps, args.features)).round(4).tolist()]}).encode()
            for _ in range(64)]
        flags = {"off": [], "off again": [],
                 "every request": ["--capture", str(work / "all")],
                 "10% sampled": ["--capture", str(work / "tenth"), "--capture-sample", "0.1"]}
        mounted = full_disk(work / "full")
        if mounted:
            flags["every request, disk full"] = ["--capture", str(work / "full")]
        servers = {name: Server(repo, True, extra) for name, extra in flags.items()}
        runs: dict[str, list] = {name: [] for name in servers}
        try:
            for s in servers.values():
                s.wait_ready()
            requests = requests_with_ids(bodies, 100_000)
            memory_before = {n: rss_kib(s.proc.pid) for n, s in servers.items()}
            names = list(servers)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    runs[name].append(asyncio.run(load(servers[name].port, requests,
                                                       args.concurrency, args.round_s, 10**9)))
                print(f"round {r + 1}/{args.rounds}", flush=True)
            rows = {}
            base = runs["off"]
            for name in names:
                row = summary(runs[name], digits=3, seconds=False)
                ratios = [len(o[1]) / o[0] / max(len(b[1]) / b[0], 1e-9)
                          for b, o in zip(base, runs[name], strict=True)]
                row["ratio"] = round(float(np.median(ratios)), 3)
                row["ratios"] = [round(x, 3) for x in ratios]
                port = servers[name].port
                row["answered_200"] = answered(port)
                row["records"] = metric(port, "orthornn_capture_records_total")
                row["dropped"] = metric(port, "orthornn_capture_dropped_total")
                row["rss_growth_kib"] = rss_kib(servers[name].proc.pid) - memory_before[name]
                rows[name] = row
        finally:
            for s in servers.values():
                s.stop()
            if mounted:
                subprocess.run(["umount", str(work / "full")], capture_output=True)
    lines = ["| server | req/s | ratio to off | p50 ms | p99 ms | answered 200 | records | "
             "dropped | RSS growth KiB |", "| --- " * 9 + "|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['throughput']:.0f} | {row['ratio']:.3f} | "
                     f"{row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {row['answered_200']:.0f} | "
                     f"{row['records']:.0f} | {row['dropped']:.0f} | {row['rss_growth_kib']} |")
    print("\n".join(lines))
    if not mounted:
        print("(no disk-full row: this machine does not let a tmpfs be mounted)")
    write_result(args.out, {"concurrency": args.concurrency, "round_s": args.round_s,
                            "rounds": args.rounds, "machine": platform.processor()
                            or platform.machine(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
