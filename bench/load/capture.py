"""What capture costs the service, and that it loses nothing: the same POST /predict load
(distinct X-Request-Id per request) against `orthornn serve` processes of this checkout up
side by side on one package: capture off, off again (the noise floor), on for every
request (--capture), on for 10% (--capture-sample 0.1), and, where this machine lets a
tmpfs be mounted, on for every request into a full disk and into a read-only one (records
dropped, counted). Each round pairs every server in turn with a capture-off server of its
own (the "off" row: all of them): both loaded at once for --round-s, on the same CPU, so
that whatever slows this machine in those seconds slows both (one after the other, on a
shared VM, a server's throughput moves by a third from round to round; paired, off against
off again moves by about 4%), and both rest while the other pairs run (a reference in
every pair, never resting, ran 2% slower than a server that rested). Who starts first
alternates by round. Each ratio is the geometric mean over the rounds of the pair's ratio
(throughput, and p99 latency); on a machine other work shares, over the rounds in which
other processes took at most --quiet of the CPUs (all rounds if fewer than 3 did).
Throughputs are those of a server sharing its CPU with its reference. Every --fresh rounds
each server is a new process; a process is noise of its own (the same code, started
again, ran up to 3% faster or slower for all its rounds), so the 95% interval is over the
processes' means when there are 3 or more: many processes (a small --fresh) narrow it.
The servers of one generation share a PYTHONHASHSEED (a new one each generation), so that
a pair's two processes lay out their dictionaries alike.
Afterwards each capturing server's records plus drops are checked against the requests it
answered 200 (its /metrics), and each server's resident memory growth over the rounds and
CPU time per request (its event loop's and the whole process's) are reported. Prints a
table and writes bench/results/capture.json.

--client wrk (where wrk and taskset are installed): the load comes from wrk pinned to the
first CPU, each server's threads pinned to the last, each request with an id of its own
(a Lua script), as the peer harness measures; the asyncio client shares the CPUs with the
servers, and its rounds spread twice as wide on a 2-core machine.

With --nothing-lost N, instead: N requests (each id once) from --concurrency clients to
one server capturing every request, SIGKILL once half are answered, a restart on the same
folder, the rest of the ids sent to it; then every request answered 200 must be on disk
exactly once (a torn last line at most, cut and counted at the restart). Writes
bench/results/capture_nothing_lost.json.

    python bench/load/capture.py [--round-s 2] [--rounds 8] [--fresh 10] [--concurrency 32]
                                 [--hidden 64] [--client asyncio|wrk] [--sample P ...]
    python bench/load/capture.py --nothing-lost 20000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
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
    load,
    mean_ratio,
    paired_round,
    reference_of,
    round_options,
    wrk_missing,
)

MEMORY_LIMIT_KIB = 16 << 10  # the bound on a failing disk's memory growth


def with_id(body: bytes, rid: str) -> bytes:
    return (f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}"
            f"\r\nContent-Type: application/json\r\nX-Request-Id: {rid}\r\n\r\n"
            .encode() + body)


def requests_with_ids(bodies: list[bytes], count: int) -> list[bytes]:
    """COUNT requests cycling over BODIES, each with an X-Request-Id of its own."""
    return [with_id(bodies[i % len(bodies)], f"bench-{i}") for i in range(count)]


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str, labels: str = "") -> float:
    return sum(float(v) for v in re.findall(
        rf"^{name}(?:{{[^}}]*{labels}[^}}]*}})? (\S+)$", text, re.M))


def answered(text: str) -> float:
    return sum(float(v) for v in re.findall(
        r'^orthornn_requests_total{endpoint="/predict",[^}]*status="200"[^}]*} (\S+)$',
        text, re.M))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        found = re.search(r"VmRSS:\s+(\d+)", f.read())
    return int(found.group(1)) if found else 0


def tmpfs(folder: Path, options: str) -> bool:
    """Mount a 64 KiB tmpfs on FOLDER with OPTIONS (False: this machine does not allow
    it)."""
    folder.mkdir(parents=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=64k,{options}", "tmpfs",
                           str(folder)], capture_output=True).returncode == 0


def full_disk(folder: Path) -> bool:
    """A 64 KiB tmpfs on FOLDER, filled (False: this machine does not allow it)."""
    if not tmpfs(folder, "rw"):
        return False
    with open(folder / "filler", "wb") as f, contextlib.suppress(OSError):
        f.write(b"\0" * (1 << 20))  # until the disk is full
    return True


def _round(result: tuple) -> tuple[float, int, int, float, float]:
    """One round as (seconds, requests, errors, p50 s, p99 s), from either client."""
    if len(result) == 5:
        return result
    seconds, latencies, errors = result
    return (seconds, len(latencies), len(errors), float(np.percentile(latencies, 50)),
            float(np.percentile(latencies, 99)))


def overhead(args: argparse.Namespace, work: Path, repo: Path) -> dict:
    """The paired rounds; a row per server. Each server has a capture-off server of its own
    to be paired with (their rows together are "off"): both idle while the other pairs run,
    as a reference shared by every pair would not (it ran up to 2% slower than a server
    that rested). A fresh process of every server each --fresh rounds."""
    flags = {"off": [], "off again": [],
             "every request": ["--capture", str(work / "all")],
             "10% sampled": ["--capture", str(work / "tenth"), "--capture-sample", "0.1"]}
    for k, share in enumerate(args.sample):  # --sample: rows of other shares
        flags[f"{share:.2%} sampled"] = ["--capture", str(work / f"sample-{k}"),
                                         "--capture-sample", str(share)]
    mounts = []
    if full_disk(work / "full"):
        mounts.append(work / "full")
        flags["every request, disk full"] = ["--capture", str(work / "full")]
    if tmpfs(work / "ro", "ro"):
        mounts.append(work / "ro")
        flags["every request, read-only"] = ["--capture", str(work / "ro")]
    names = [n for n in flags if n != "off"]
    flags.update({reference_of(n): [] for n in names})
    del flags["off"]
    # per compared server, per round: its measurement and off's, over the same seconds
    runs: dict[str, list[tuple[tuple, tuple]]] = {n: [] for n in names}
    # per server, over its processes: CPU seconds (the event loop's, the process's) in the
    # pairs it was in, requests done in them, and /metrics' counts and memory growth
    spent: dict[str, list[float]] = {name: [0.0, 0.0] for name in flags}
    done: dict[str, int] = {name: 0 for name in flags}  # requests answered in the pairs
    counts: dict[str, dict[str, float]] = {
        name: {"answered_200": 0.0, "records": 0.0, "dropped": 0.0, "rss_growth_kib": 0.0,
               "batches": 0.0, "sequences": 0.0}
        for name in flags}
    others: list[float] = []  # each round's CPU share taken by other processes
    wrk = Wrk(work, bodies_for(args)[0], args.concurrency) if args.client == "wrk" else None
    requests = requests_with_ids(bodies_for(args), 100_000) if wrk is None else []

    def measure(ports: list[int], seconds: float) -> list[tuple]:
        """One measurement of each of PORTS, all at once."""
        if wrk is None:
            async def together() -> list:
                return await asyncio.gather(*[load(port, requests, args.concurrency,
                                                   seconds, 10**9) for port in ports])
            return [_round(r) for r in asyncio.run(together())]
        return wrk.together(ports, seconds)

    try:
        for first in range(0, args.rounds, args.fresh):
            # every server of a generation hashes with the same seed, a new one each
            # generation: a pair differs in its code, not in its dictionaries' layout
            seed = {"PYTHONHASHSEED": str(first // args.fresh + 1)}
            servers = {name: Server(repo, True, extra, seed) for name, extra in flags.items()}
            try:
                for s in servers.values():
                    s.wait_ready()
                    if wrk is not None:
                        wrk.pin(s.proc.pid)
                for s in servers.values():  # a first round each, not measured: paths warm
                    measure([s.port], 1)
                memory_before = {n: rss_kib(s.proc.pid) for n, s in servers.items()}
                for r in range(first, min(first + args.fresh, args.rounds)):
                    others.append(paired_round(r, servers, names, measure, args, runs,
                                                spent, done))
                    print(f"round {r + 1}/{args.rounds}: other processes took "
                          f"{others[-1]:.0%} of the CPUs", flush=True)
                for name, s in servers.items():
                    text = metrics_text(s.port)
                    got = counts[name]
                    got["answered_200"] += answered(text)
                    got["records"] += metric(text, "orthornn_capture_records_total")
                    got["dropped"] += metric(text, "orthornn_capture_dropped_total")
                    got["batches"] += metric(text, "orthornn_batch_size_count")
                    got["sequences"] += metric(text, "orthornn_batch_size_sum")
                    got["rss_growth_kib"] = max(got["rss_growth_kib"],
                                                rss_kib(s.proc.pid) - memory_before[name])
            finally:
                for s in servers.values():
                    s.stop()
    finally:
        for folder in mounts:
            subprocess.run(["umount", str(folder)], capture_output=True)
    # the rounds the rest of the machine left alone, when there are 3 or more
    quiet = [r for r in range(args.rounds) if others[r] <= args.quiet]
    chosen = quiet if len(quiet) >= 3 else list(range(args.rounds))
    rows: dict = {}
    references = [reference_of(n) for n in names]
    for name in ["off", *names]:
        if name == "off":  # every pair's reference
            mine = base = [runs[n][r][1] for n in names for r in chosen]
            keys = references
        else:
            mine, base = [runs[name][r][0] for r in chosen], [runs[name][r][1] for r in chosen]
            keys = [name]
        row = {"requests": sum(o[1] for o in mine), "errors": sum(o[2] for o in mine),
               "throughput": round(float(np.median([o[1] / o[0] for o in mine])), 1),
               "p50_ms": round(float(np.median([o[3] for o in mine])) * 1e3, 3),
               "p99_ms": round(float(np.median([o[4] for o in mine])) * 1e3, 3)}
        ratios = [o[1] / o[0] / max(b[1] / b[0], 1e-9) for b, o in zip(base, mine, strict=True)]
        p99s = [o[4] / max(b[4], 1e-9) for b, o in zip(base, mine, strict=True)]
        # the process each round's pair ran on ("off" against itself: every ratio 1)
        processes = [r // args.fresh for r in chosen] if name != "off" else None
        row["ratio"], row["ratio_95"] = mean_ratio(ratios, processes)
        row["ratios"] = [round(x, 3) for x in ratios]
        row["p99_ratio"], row["p99_ratio_95"] = mean_ratio(p99s, processes)
        row["p99_ratios"] = [round(x, 3) for x in p99s]
        # CPU per request, over every pair the server was in (all rounds)
        requests = max(sum(done[k] for k in keys), 1)
        row["loop_cpu_us"] = round(sum(spent[k][0] for k in keys) / requests * 1e6, 1)
        row["process_cpu_us"] = round(sum(spent[k][1] for k in keys) / requests * 1e6, 1)
        for field in ("answered_200", "records", "dropped"):
            row[field] = sum(counts[k][field] for k in keys)
        row["rss_growth_kib"] = int(max(counts[k]["rss_growth_kib"] for k in keys))
        # sequences per onnxruntime run (the warm-up rounds too): capture must not make
        # the batches smaller
        row["mean_batch"] = round(sum(counts[k]["sequences"] for k in keys)
                                  / max(sum(counts[k]["batches"] for k in keys), 1), 2)
        rows[name] = row
    rows["_rounds"] = {"others_cpu_share": [round(x, 3) for x in others], "quiet": quiet,
                       "used": chosen, "fresh_processes_every": args.fresh}
    return rows


async def _send(port: int, bodies: list[bytes], ids: list[str], concurrency: int,
                got: list[str], kill_at: int | None, pid: int) -> list[str]:
    """Send each of IDS once (CONCURRENCY keep-alive clients), noting those answered 200
    in GOT; with KILL_AT, SIGKILL process PID once that many are answered. A client ends
    when the server is gone. The ids never sent."""
    queue = list(reversed(ids))

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while queue:
                rid = queue.pop()
                writer.write(with_id(bodies[int(rid.rpartition("-")[2]) % len(bodies)],
                                     rid))
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                await reader.readexactly(length)
                if head[9:12] == b"200":
                    got.append(rid)
                    if kill_at is not None and len(got) == kill_at:
                        os.kill(pid, signal.SIGKILL)
        except (OSError, asyncio.IncompleteReadError):
            return  # killed
        finally:
            writer.close()
    await asyncio.gather(*[client() for _ in range(concurrency)])
    return list(reversed(queue))


def nothing_lost(args: argparse.Namespace, work: Path, repo: Path) -> dict:
    from orthornn.export.artifacts.loop.captures import read_records

    folder = work / "captured"
    extra = ["--capture", str(folder), "--capture-replica", "pod-0"]
    bodies = bodies_for(args)
    ids = [f"lost-{i}" for i in range(args.nothing_lost)]
    got: list[str] = []
    first = Server(repo, True, extra)
    first.wait_ready()
    start = time.perf_counter()
    # the ids in flight at the kill are not sent again: their records may be on disk
    rest = asyncio.run(_send(first.port, bodies, ids, args.concurrency, got,
                             args.nothing_lost // 2, first.proc.pid))
    first.proc.wait(30)
    killed = first.proc.returncode == -signal.SIGKILL
    before_kill = len(got)
    second = Server(repo, True, extra)  # recovers pod-0's open segments at its start
    try:
        second.wait_ready()
        asyncio.run(_send(second.port, bodies, rest, args.concurrency, got, None, 0))
        torn_cut = metric(metrics_text(second.port), "orthornn_capture_dropped_total",
                          'reason="torn"')
    finally:
        second.stop()
    seconds = time.perf_counter() - start
    records, torn_left = read_records(folder, "bench")
    on_disk = [r["id"] for r in records]
    counts: dict[str, int] = {}
    for rid in on_disk:
        counts[rid] = counts.get(rid, 0) + 1
    missing = [rid for rid in got if rid not in counts]
    twice = [rid for rid, n in counts.items() if n > 1]
    return {"requests": args.nothing_lost, "concurrency": args.concurrency,
            "killed": killed, "answered_before_kill": before_kill,
            "in_flight_at_kill": args.nothing_lost - before_kill - len(rest),
            "answered_200": len(got), "records": len(on_disk),
            "missing": len(missing), "twice": len(twice),
            "written_not_answered": len(counts) - len(set(got) & set(counts)),
            "torn_cut_at_restart": torn_cut, "torn_left": torn_left,
            "seconds": round(seconds, 1),
            "ok": killed and not missing and not twice and torn_cut <= 1 and not torn_left}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    round_options(parser, rounds=8, fresh=10)
    parser.add_argument("--nothing-lost", type=int, default=0, metavar="N",
                        help="the SIGKILL check with N requests instead of the rounds")
    parser.add_argument("--quiet", type=float, default=0.15, metavar="SHARE",
                        help="the ratios are taken over the rounds in which other processes "
                             "used at most this share of the CPUs (all, if under 3 do)")
    parser.add_argument("--client", choices=("asyncio", "wrk"), default="asyncio",
                        help="the load client: this script's asyncio one on the CPUs the "
                             "servers use, or wrk and the servers pinned to CPUs of their own")
    parser.add_argument("--sample", type=float, action="append", default=[], metavar="P",
                        help="also a server capturing this share of the requests (0 < P <= "
                             "1; repeatable): 0.0001 costs what deciding the sample costs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.fresh < 1:
        parser.error(f"--rounds and --fresh: at least 1; got {args.rounds} and {args.fresh}")
    if bad := [p for p in args.sample if not 0 < p <= 1]:
        parser.error(f"--sample: a share in (0, 1]; got {bad[0]}")
    if args.client == "wrk" and (missing := wrk_missing()) is not None:
        parser.error(f"--client wrk: {missing}")
    if args.nothing_lost < 0:
        parser.error(f"--nothing-lost: 0 (off) or a number of requests; got "
                     f"{args.nothing_lost}")
    results = ROOT / "bench" / "results"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = build_package(work, args.hidden, args.steps, args.features)
        if args.nothing_lost:
            result = nothing_lost(args, work, repo)
            print("\n".join(f"{k}: {v}" for k, v in result.items()))
            write_result(args.out or results / "capture_nothing_lost.json", result)
            return 0 if result["ok"] else 1
        rows = overhead(args, work, repo)
    rounds = rows.pop("_rounds")
    lines = ["| server | req/s | ratio to off (95%) | p50 ms | p99 ms | p99 ratio (95%) "
             "| event loop CPU µs/request (to off) | process CPU µs/request | answered 200 | "
             "records | dropped | RSS growth KiB | mean batch |", "| --- " * 13 + "|"]
    off_cpu = rows["off"]["loop_cpu_us"]
    for name, row in rows.items():
        spread = "{:.3f}-{:.3f}".format(*row["ratio_95"])
        p99_spread = "{:.3f}-{:.3f}".format(*row["p99_ratio_95"])
        lines.append(f"| {name} | {row['throughput']:.0f} | {row['ratio']:.3f} ({spread}) | "
                     f"{row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {row['p99_ratio']:.3f} "
                     f"({p99_spread}) | {row['loop_cpu_us']:.0f} "
                     f"({off_cpu / max(row['loop_cpu_us'], 1e-9):.3f}) | "
                     f"{row['process_cpu_us']:.0f} | {row['answered_200']:.0f} | "
                     f"{row['records']:.0f} | "
                     f"{row['dropped']:.0f} | {row['rss_growth_kib']} | "
                     f"{row['mean_batch']:.1f} |")
    print("\n".join(lines))
    used = ("the quiet rounds" if rounds["used"] == rounds["quiet"] else
            f"all rounds: under 3 were quiet (other processes <= {args.quiet:.0%} of the CPUs)")
    print(f"ratios over {used}: {len(rounds['used'])} of {args.rounds}")
    failing = [n for n in rows if "disk full" in n or "read-only" in n]
    if not failing:
        print("(no disk-full or read-only rows: this machine does not let a tmpfs be mounted)")
    for name in failing:
        print(f"{name}: memory growth {rows[name]['rss_growth_kib']} KiB "
              f"(bound {MEMORY_LIMIT_KIB} KiB)")
    write_result(args.out or results / "capture.json",
                 {"concurrency": args.concurrency, "round_s": args.round_s,
                  "rounds": args.rounds, "machine": platform.processor()
                  or platform.machine(), "round_selection": rounds, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
