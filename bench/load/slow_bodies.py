"""Slow request bodies against admission: other clients' throughput with and without
``--slow`` connections (default 64, the default ``max_inflight_requests``) that each send
a request's head with ``Content-Length: 100000`` and then a byte of its body every
``--interval`` seconds (a slow-body attack: each would hold an in-flight slot for the
whole body deadline if a slot were taken when the head arrives).

One ``orthornn serve`` process (a small classifier built for the run, or ``--repo``);
``--clients`` keep-alive connections POST /predict in a closed loop (each sends its next
request when its answer has come), in this process, beside the slow connections (asyncio
too, nearly idle). Alone and beside the attack are measured in turns, ``--rounds`` pairs of
``--seconds`` each, so that a change of the machine's load cancels; the median of the
pairs' ratios (beside / alone) is the result (target: at least 0.9). ``--attack budget``
runs the budget-holding variant instead (issue 59, finding 1): 17 connections that each
send all of a 16 MiB body but its last KiB, then trickle, holding the default 256 MiB of
bodies being received. Also counted: the normal requests that were not answered 200
(beside the attack: refused for overload, were slots or the budget taken by the slow
bodies) and readiness (/v2/health/ready) polled during the attack. Prints a table and
writes JSON (bench/results/slow_bodies.json).

    python bench/load/slow_bodies.py [--attack slots|budget] [--slow 64] [--clients 8]
                                     [--seconds 2] [--rounds 3]
                                     [--max-inflight-requests N] [--out FILE]
                                     [--repo REPO --model NAME --body FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from bench.load.client import Server, request  # noqa: E402

DECLARED = 100_000  # each slow connection's Content-Length


def build_repo(work: Path, steps: int = 16, features: int = 2) -> Path:
    """A model repository with a small svdrnn classifier named "stream" (one training step
    on random data: throughput does not depend on accuracy)."""
    import numpy as np
    from orthornn.export.builder.exporter import export_run
    from orthornn.training.config import TrainConfig
    from orthornn.training.trainer import train

    rng = np.random.default_rng(0)
    data = work / "data.npz"
    np.savez(data, x=rng.normal(size=(10, steps, features)).astype(np.float32),
             y=rng.integers(0, 5, size=10))
    train(TrainConfig(arch="svdrnn", task="classify", data=str(data), hidden_size=8,
                      steps=1, batch_size=2, log_every=1, out=str(work / "run")),
          progress=False)
    return Path(export_run(work / "run", work / "repo", "stream")).parents[1]


async def _status(reader: asyncio.StreamReader) -> str:
    """The status of the next answer on READER, its body read and dropped."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    await reader.readexactly(length)
    return head[9:12].decode()


async def _client(port: int, request: bytes, stop: asyncio.Event, counts: dict) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while not stop.is_set():
            writer.write(request)
            counts["ok" if await _status(reader) == "200" else "refused"] += 1
    finally:
        writer.close()


#: --attack budget: each connection declares the default body limit's ceiling (16 MiB, set
#: on the server: a small model's default is 4 MiB, which takes 65 connections) and
#: sends all of it but a KiB at once, then trickles: 17 of them hold the default 256 MiB of
#: bodies being received (issue 59, finding 1)
HOLD_DECLARED = 16 << 20
HOLD_PREFIX = b"{" + b" " * (HOLD_DECLARED - 1024)


async def _slow_loop(port: int, interval: float, stop: asyncio.Event, state: dict,
                     hold: bool = False) -> None:
    """One slow-body connection: the head, then a byte every INTERVAL (never the whole
    body); HOLD: all of a 16 MiB body but a KiB first. Another when the server closes it
    (at its body deadline, or evicted)."""
    declared = HOLD_DECLARED if hold else DECLARED
    head = (f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\nContent-Length: {declared}\r\n\r\n").encode()
    first = head + (HOLD_PREFIX if hold else b"{")
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        state["open"] += 1
        try:
            writer.write(first)
            while not stop.is_set() and not reader.at_eof():
                try:
                    await asyncio.wait_for(stop.wait(), interval)
                except TimeoutError:
                    writer.write(b" ")  # JSON whitespace: the body goes on, slowly
                    await writer.drain()
        except OSError:
            state["cut"] += 1
        finally:
            state["open"] -= 1
            writer.close()


async def _readiness(port: int, stop: asyncio.Event, seen: dict) -> None:
    request = b"GET /v2/health/ready HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while not stop.is_set():
            writer.write(request)
            status = await _status(reader)
            seen[status] = seen.get(status, 0) + 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
    finally:
        writer.close()


async def _phase(port: int, request: bytes, clients: int, seconds: float, slow: int,
                 interval: float, hold: bool = False) -> dict:
    """One measurement: CLIENTS closed-loop clients for SECONDS, beside SLOW slow-body
    connections (opened first) when SLOW > 0."""
    stop_slow = asyncio.Event()
    state = {"open": 0, "cut": 0}
    ready: dict[str, int] = {}
    attackers = [asyncio.create_task(_slow_loop(port, interval, stop_slow, state, hold))
                 for _ in range(slow)]
    if slow:
        deadline = time.perf_counter() + 5
        while state["open"] < slow and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # their heads have been read
    stop = asyncio.Event()
    counts = {"ok": 0, "refused": 0}
    start = time.perf_counter()
    tasks = [asyncio.create_task(_client(port, request, stop, counts)) for _ in range(clients)]
    probe = asyncio.create_task(_readiness(port, stop, ready)) if slow else None
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    if probe is not None:
        await probe
    open_at_end = state["open"]
    stop_slow.set()
    await asyncio.gather(*attackers)
    return {"ok_per_s": counts["ok"] / elapsed, "ok": counts["ok"],
            "not_200": counts["refused"], "slow_open": open_at_end, "ready": ready}


async def measure(port: int, request: bytes, clients: int, seconds: float, rounds: int,
                  slow: int, interval: float, hold: bool = False) -> dict:
    await _phase(port, request, clients, min(seconds, 0.3), 0, interval)  # warm-up
    pairs = []
    for _ in range(rounds):
        alone = await _phase(port, request, clients, seconds, 0, interval)
        beside = await _phase(port, request, clients, seconds, slow, interval, hold)
        pairs.append({"alone": alone, "beside": beside,
                      "ratio": beside["ok_per_s"] / max(alone["ok_per_s"], 1e-9)})
    return {"pairs": pairs, "ratio": statistics.median(p["ratio"] for p in pairs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attack", choices=("slots", "budget"), default="slots",
                    help="slots: heads with a byte of body (each would hold a slot); "
                         "budget: 16 MiB bodies sent but for their last KiB (together they "
                         "hold the bodies-being-received budget)")
    ap.add_argument("--slow", type=int, help="slow-body connections (default: 64 for "
                                             "slots, 17 for budget)")
    ap.add_argument("--clients", type=int, default=8, help="normal keep-alive clients")
    ap.add_argument("--seconds", type=float, default=2.0, help="each measurement")
    ap.add_argument("--rounds", type=int, default=3, help="pairs (alone, beside)")
    ap.add_argument("--interval", type=float, default=1.0,
                    help="seconds between a slow connection's bytes")
    ap.add_argument("--repo", help="a model repository (default: a small model built here)")
    ap.add_argument("--model", default="stream", help="the model the clients ask")
    ap.add_argument("--body", help="a /predict body (default: one sequence of 16 steps)")
    ap.add_argument("--max-inflight-requests", type=int,
                    help="the server's (default: its own, 64)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "slow_bodies.json"))
    args = ap.parse_args(argv)
    hold = args.attack == "budget"
    if args.slow is None:
        args.slow = 17 if hold else 64
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(args.repo) if args.repo else build_repo(Path(tmp))
        body = Path(args.body).read_bytes() if args.body else json.dumps(
            {"model": args.model, "inputs": [[[0.1, -0.2]] * 16]}).encode()
        extra = [] if args.max_inflight_requests is None else [
            "--max-inflight-requests", str(args.max_inflight_requests)]
        if hold:  # the largest body limit the defaults allow (a model taking 16 MiB bodies)
            extra += ["--max-body-bytes", str(HOLD_DECLARED)]
        server = Server(repo, True, extra)
        try:
            server.wait_ready()
            result = asyncio.run(measure(server.port, request("POST", "/predict", body),
                                         args.clients, args.seconds, args.rounds,
                                         args.slow, args.interval, hold))
        finally:
            server.stop()
    result.update({"attack": args.attack, "slow": args.slow, "clients": args.clients,
                   "seconds": args.seconds,
                   "max_inflight_requests": args.max_inflight_requests or 64,
                   "rounds": args.rounds,
                   "declared_body_bytes": HOLD_DECLARED if hold else DECLARED,
                   "machine": platform.machine(), "python": platform.python_version()})
    print(f"{'round':>5} {'alone/s':>9} {'beside/s':>9} {'ratio':>6} {'not 200':>8} "
          f"{'slow open':>9} {'ready':>12}")
    for i, p in enumerate(result["pairs"]):
        b = p["beside"]
        print(f"{i:>5} {p['alone']['ok_per_s']:>9.0f} {b['ok_per_s']:>9.0f} "
              f"{p['ratio']:>6.2f} {b['not_200']:>8} {b['slow_open']:>9} "
              f"{json.dumps(b['ready']):>12}")
    print(f"median ratio beside / alone: {result['ratio']:.2f} (target >= 0.9)")
    write_result(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
