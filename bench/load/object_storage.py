"""What serving a repository from a bucket costs against from a folder, with a real S3
server on loopback (SeaweedFS, `weed server -s3`: tests/objectstore.py) and `orthornn
serve` processes of this checkout:

- start to ready: a server started on the folder, one on the bucket with an empty cache
  (everything downloaded first), one on the bucket with the cache a previous start left
  (nothing new to download); each --starts times, alternated; the ratio is of medians;
- swap delay: a new version published to the bucket (`orthornn export`'s code, another
  opset each time) until the first answer from it, at the default poll interval (2 s);
- throughput: POST /predict at --concurrency from this script's asyncio client against a
  folder server and a bucket server polling every second, alternated for --rounds rounds;
  the ratio is of the medians; the servers pinned to the last CPU, the client and the S3
  server to the others (the peers harness's layout: a remote store takes no CPU of the
  server's); before the load, each idle server's CPU time a second (the poll's own cost);
- capture's upload: POST /predict with every request captured to a folder, and to the
  bucket, a segment closed every second in both (and uploaded), alternated likewise;
  beside the rates, each server's CPU time per request, and the share of the server's
  CPU that its upload threads (the uploader, obstore's runtime) used;
- a node lost with its disk: a server capturing every request to the bucket (segments
  closed at --loss-segment-age-s) answers one client for --loss-s, is killed (SIGKILL) and
  its spool deleted; the answered requests missing from the bucket, and how long before
  the kill the oldest of them was answered.

--repo DIR serves the models of that repository (for instance the quickstart's
`.quickstart/models`: its two models), for the start-to-ready rows only; by default a
small svdrnn classifier is built and every row measured.
Prints a table and writes bench/results/object_storage.json.

    python bench/load/object_storage.py [--repo DIR] [--starts 5] [--swaps 3] [--rounds 6]
                                        [--round-s 2] [--concurrency 32] [--idle-s 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from client import Server, build_package, cpu_s, load, request  # noqa: E402


def ready_s(repo: str, extra: list[str], env: dict[str, str]) -> tuple[float, Server]:
    start = time.perf_counter()
    server = Server(repo, True, extra, env)
    server.wait_ready()
    return time.perf_counter() - start, server


def answer_version(port: int, body: bytes) -> int | None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())["version"]
    except OSError:
        return None


def upload(folder: Path, uri: str) -> None:
    """Every model of the repository FOLDER published as it is into the bucket URI (each
    version manifest last, the records after)."""
    from orthornn.export.artifacts import remote
    from orthornn.export.artifacts.storage import open_store

    for model in sorted(p for p in folder.iterdir() if p.is_dir()):
        store = open_store(f"{uri}/{model.name}")
        for version in sorted((p for p in model.iterdir() if p.name.isdigit()),
                              key=lambda p: int(p.name)):
            store.write_if_absent(f"{version.name}/.claim", b"{}")
            remote.upload(store, version.name, version, last="manifest.json")
        for record in remote.RECORDS:
            if (model / record).is_file():
                store.write(record, (model / record).read_bytes())


def main(argv: list[str] | None = None) -> int:
    from tests.objectstore import SeaweedFS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", help="a repository folder to serve (default: one built)")
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--swaps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--round-s", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--idle-s", type=float, default=10.0,
                        help="how long the idle servers' CPU is measured")
    parser.add_argument("--loss-segment-age-s", type=float, default=5.0)
    parser.add_argument("--loss-s", type=float, default=12.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "object_storage.json"))
    args = parser.parse_args(argv)
    for name in ("starts", "swaps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if not (args.loss_segment_age_s > 0 and args.loss_s > 0 and args.idle_s > 0):
        parser.error("--loss-segment-age-s, --loss-s and --idle-s must be positive")
    work = Path(tempfile.mkdtemp(prefix="orthornn-bench-s3-"))
    try:
        if args.repo:
            folder = Path(args.repo)
            if not folder.is_dir():
                parser.error(f"--repo {args.repo!r} is not a folder")
            run = None
        else:
            folder, run = build_package(work, 64, 32, 9), work / "run"
        models = sorted(p.name for p in folder.iterdir() if p.is_dir())
        saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_REGION",
                                                   "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        with SeaweedFS(work / "weed") as s3:
            os.environ.update(s3.env)  # this process's uploads and exports
            uri = f"s3://{s3.shared}/repo"
            upload(folder, uri)
            assert s3.proc is not None
            results = measure(args, folder, uri, models, run, s3.env, work, s3.proc.pid)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(work, ignore_errors=True)
    table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def measure(args: argparse.Namespace, folder: Path, uri: str, models: list[str],
            run: Path | None, env: dict[str, str], work: Path, store_pid: int) -> dict:
    starts: dict[str, list[float]] = {"folder": [], "bucket, empty cache": [],
                                      "bucket, warm cache": []}
    warm = work / "warm-cache"
    _, server = ready_s(uri, ["--repository-cache", str(warm)], env)  # fills it, unmeasured
    server.stop()
    for k in range(args.starts):
        order = list(starts) if k % 2 == 0 else list(reversed(starts))
        for kind in order:
            if kind == "folder":
                repo, extra = str(folder), []
            elif kind == "bucket, empty cache":
                repo, extra = uri, ["--repository-cache", str(work / f"cold-{k}")]
            else:
                repo, extra = uri, ["--repository-cache", str(warm)]
            seconds, server = ready_s(repo, extra, env)
            server.stop()
            starts[kind].append(seconds)
            print(f"start {k + 1}/{args.starts}: {kind} ready in {seconds:.2f} s", flush=True)
    results: dict = {"models": models, "start_to_ready_s": {
        kind: round(statistics.median(v), 3) for kind, v in starts.items()}}
    base = results["start_to_ready_s"]["folder"]
    results["start_ratio"] = {kind: round(v / base, 2)
                              for kind, v in results["start_to_ready_s"].items()}
    if run is None:  # --repo: its models' inputs are not known here
        return results
    body = json.dumps({"model": models[0], "inputs": [[[0.1] * 9] * 32]}).encode()
    results["swap_delay_s"] = swaps(args, uri, run, body, env, work)
    results["throughput"] = throughput(args, folder, uri, body, env, work, store_pid)
    results["capture_throughput"] = capture_throughput(args, folder, uri, body, env, work,
                                                       store_pid)
    results["node_loss"] = node_loss(args, folder, uri, body, env, work)
    return results


def swaps(args: argparse.Namespace, uri: str, run: Path, body: bytes,
          env: dict[str, str], work: Path) -> dict:
    from orthornn.export.artifacts import repository
    from orthornn.export.builder.exporter import export_run

    _, server = ready_s(uri, ["--repository-cache", str(work / "swap-cache")], env)
    delays = []
    try:
        for k in range(args.swaps):
            opset = 19 + k % 3
            mode = "factored" if k >= 3 else "dense"
            published = time.perf_counter()
            path = export_run(run, uri, "bench", mode=mode, opset=opset)
            done = time.perf_counter()
            version = repository.version_of(path)
            while answer_version(server.port, body) != version:
                time.sleep(0.02)
            delays.append(time.perf_counter() - done)
            print(f"swap {k + 1}/{args.swaps}: version {version} answered "
                  f"{delays[-1]:.2f} s after its upload (export {done - published:.1f} s)",
                  flush=True)
    finally:
        server.stop()
    return {"median": round(statistics.median(delays), 3), "max": round(max(delays), 3),
            "poll_interval_s": 2.0}


def throughput(args: argparse.Namespace, folder: Path, uri: str, body: bytes,
               env: dict[str, str], work: Path, store_pid: int) -> dict:
    """/predict against the folder and against the bucket polled every second; first,
    each one's CPU time a second while idle (--idle-s): the poll's own cost, which no
    load's noise blurs."""
    servers = {
        "folder": ready_s(str(folder), [], env)[1],
        "bucket, polled every 1 s": ready_s(uri, [
            "--repository-cache", str(work / "load-cache"), "--poll-interval-s", "1"],
            env)[1]}
    time.sleep(1.0)  # past the first polls
    before = {kind: cpu_s(server.proc.pid, False) for kind, server in servers.items()}
    time.sleep(args.idle_s)
    idle = {kind: round((cpu_s(server.proc.pid, False) - before[kind]) / args.idle_s
                       * 1000, 2)
            for kind, server in servers.items()}
    rows = compare(args, body, servers, (store_pid,))
    for kind, row in rows.items():
        row["idle_cpu_ms_per_s"] = idle[kind]
    return rows


def capture_throughput(args: argparse.Namespace, folder: Path, uri: str, body: bytes,
                       env: dict[str, str], work: Path, store_pid: int) -> dict:
    """/predict capturing every request to a folder, and to the bucket, with a segment
    closed every second in both (the default is every 60 s at most: this is the upload's
    cost sixty times over; the closing itself is on both sides)."""
    from orthornn.export.artifacts.storage import open_store

    captures = uri.rsplit("/", 1)[0] + "/captures"
    rows = compare(args, body, {
        "capture to a folder": ready_s(str(folder), [
            "--capture", str(work / "capture"), "--capture-segment-age-s", "1"], env)[1],
        "capture to the bucket, a segment a second": ready_s(str(folder), [
            "--capture", captures, "--capture-spool", str(work / "spool"),
            "--capture-segment-age-s", "1"], env)[1]}, (store_pid,))
    return {**rows, "segments_uploaded": len(open_store(captures).list())}


def node_loss(args: argparse.Namespace, folder: Path, uri: str, body: bytes,
              env: dict[str, str], work: Path) -> dict:
    """What a node that disappears with its local disk loses: every request captured to
    the bucket, one client answered for --loss-s, then SIGKILL and the spool deleted."""
    from orthornn.export.artifacts.loop.captures import line_records
    from orthornn.export.artifacts.storage import open_store

    captures = uri.rsplit("/", 1)[0] + "/loss-captures"
    spool = work / "loss-spool"
    _, server = ready_s(str(folder), [
        "--capture", captures, "--capture-spool", str(spool), "--capture-replica", "lost",
        "--capture-segment-age-s", str(args.loss_segment_age_s)], env)
    answered: dict[str, float] = {}  # request id -> when its answer came
    try:
        deadline = time.time() + args.loss_s
        while time.time() < deadline:
            rid = f"loss-{len(answered)}"
            req = urllib.request.Request(
                f"http://127.0.0.1:{server.port}/predict", data=body,
                headers={"Content-Type": "application/json", "X-Request-Id": rid})
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()
            answered[rid] = time.time()
        server.proc.kill()
        killed = time.time()
        server.proc.wait()
    finally:
        server.stop()
    shutil.rmtree(spool)  # the node's disk, gone with it
    store = open_store(captures)
    kept = {record["id"] for key in store.list() if "/labels/" not in key
            for line in store.read(key).data.splitlines()
            for record in line_records(line) or []}  # a batch's line: its records
    lost = [rid for rid in answered if rid not in kept]
    oldest = max((killed - answered[rid] for rid in lost), default=0.0)
    print(f"node loss: {len(lost)} of {len(answered)} answered requests not in the bucket, "
          f"the oldest answered {oldest:.2f} s before the kill (segment age "
          f"{args.loss_segment_age_s:g} s)", flush=True)
    return {"segment_age_s": args.loss_segment_age_s, "answered": len(answered),
            "in_bucket": len(kept & answered.keys()), "lost": len(lost),
            "oldest_lost_s": round(oldest, 3),
            "not_answered_in_bucket": len(kept - answered.keys())}


#: the server's threads that upload capture segments: the uploader (service/loop/upload.py
#: names it) and obstore's runtime, which sends the requests
UPLOAD_THREADS = ("capture-upload", "tokio-rt-worker")


def threads_cpu_s(pid: int, threads: tuple[str, ...]) -> float:
    """The CPU time the threads of process PID named THREADS have used, in seconds (the
    whole process's: client.cpu_s)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        if name in threads:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process PID on CPUS (threads it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, OSError):  # the thread ended meanwhile
            continue


def compare(args: argparse.Namespace, body: bytes, servers: dict[str, Server],
            beside: tuple[int, ...] = ()) -> dict:
    """--rounds rounds of POST /predict on each of SERVERS, alternated; each one's median
    rate and its ratio to the first's, and the server's own CPU time per request and its
    ratio. With two CPUs or more, as the peers harness does: the servers on the last CPU,
    this client and the processes BESIDE (the S3 server) on the others, so that the
    client's and the store's work (a remote store's, in a cluster) does not take the
    server's; each server is then bound by its one CPU."""
    everything = os.sched_getaffinity(0)
    if len(everything) >= 2:
        server_cpu = {max(everything)}
        for server in servers.values():
            pin(server.proc.pid, server_cpu)
        for pid in beside:
            pin(pid, everything - server_cpu)
        os.sched_setaffinity(0, everything - server_cpu)
    requests = [request("POST", "/predict", body)]
    rates: dict[str, list[float]] = {kind: [] for kind in servers}
    cpu: dict[str, list[float]] = {kind: [] for kind in servers}
    upload = dict.fromkeys(servers, 0.0)
    total = dict.fromkeys(servers, 0.0)
    try:
        for k in range(args.rounds):
            pair = list(servers.items())
            for kind, server in (pair if k % 2 == 0 else pair[::-1]):
                pid = server.proc.pid
                before, uploading = cpu_s(pid, False), threads_cpu_s(pid, UPLOAD_THREADS)
                seconds, latencies, errors = asyncio.run(load(
                    server.port, requests, args.concurrency, args.round_s, 10**9))
                if errors:
                    raise RuntimeError(f"{kind}: {errors[:3]}")
                rates[kind].append(len(latencies) / seconds)
                used = cpu_s(pid, False) - before
                cpu[kind].append(used / len(latencies) * 1e6)
                total[kind] += used
                upload[kind] += threads_cpu_s(pid, UPLOAD_THREADS) - uploading
            print(f"round {k + 1}/{args.rounds}: " + ", ".join(
                f"{kind} {v[-1]:.0f} req/s ({cpu[kind][-1]:.0f} us CPU each)"
                for kind, v in rates.items()), flush=True)
    finally:
        for server in servers.values():
            server.stop()
        os.sched_setaffinity(0, everything)
        for pid in beside:
            pin(pid, everything)
    base = statistics.median(next(iter(rates.values())))
    base_cpu = statistics.median(next(iter(cpu.values())))
    return {kind: {"req_s": round(statistics.median(v), 1),
                   "ratio": round(statistics.median(v) / base, 3),
                   "cpu_us_per_request": round(statistics.median(cpu[kind]), 1),
                   "cpu_ratio": round(statistics.median(cpu[kind]) / base_cpu, 3),
                   "upload_cpu_share": round(upload[kind] / total[kind], 4)}
            for kind, v in rates.items()}


def table(results: dict) -> None:
    print(f"\nmodels: {', '.join(results['models'])}")
    print("| measure | value | ratio to the folder |")
    print("| --- | --- | --- |")
    for kind, seconds in results["start_to_ready_s"].items():
        print(f"| start to ready, {kind} | {seconds:.2f} s | {results['start_ratio'][kind]} |")
    if "swap_delay_s" in results:
        swap = results["swap_delay_s"]
        print(f"| swap delay (poll 2 s), median / max | {swap['median']:.2f} / "
              f"{swap['max']:.2f} s | |")
    for kind, row in results.get("throughput", {}).items():
        print(f"| CPU a second while idle, {kind} | {row['idle_cpu_ms_per_s']:.1f} ms | |")
        print(f"| /predict throughput, {kind} | {row['req_s']:.0f} req/s | {row['ratio']} |")
        print(f"| server CPU per request, {kind} | {row['cpu_us_per_request']:.0f} us | "
              f"{row['cpu_ratio']} |")
    capture = dict(results.get("capture_throughput", {}))
    uploaded = capture.pop("segments_uploaded", None)
    for kind, row in capture.items():
        print(f"| /predict throughput, {kind} | {row['req_s']:.0f} req/s | {row['ratio']} "
              f"(to capture to a folder) |")
        print(f"| server CPU per request, {kind} | {row['cpu_us_per_request']:.0f} us | "
              f"{row['cpu_ratio']} (to capture to a folder) |")
        print(f"| the upload's threads' share of the server's CPU, {kind} | "
              f"{100 * row['upload_cpu_share']:.2f}% | |")
    if uploaded is not None:
        print(f"| capture segments uploaded meanwhile | {uploaded} | |")
    if "node_loss" in results:
        loss = results["node_loss"]
        print(f"| a node lost with its disk (segment age {loss['segment_age_s']:g} s): "
              f"answered requests not in the bucket | {loss['lost']} of {loss['answered']}, "
              f"the oldest answered {loss['oldest_lost_s']:.2f} s before | |")


if __name__ == "__main__":
    sys.exit(main())
