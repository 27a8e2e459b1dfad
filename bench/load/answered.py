"""Latency by status under load: what wrk cannot tell apart.

wrk's histogram mixes every answer, so under overload it is mostly the fast 503s. This
probe keeps ``--connections`` keep-alive connections of its own beside the load (each
sends its next request when the previous answer arrived) and reports the latency of the
answered (200) and the refused (503) requests separately (failed exchanges as "error" or
"timeout"). Its connections stay open, so it does not see the wait of new connections in
the listen queue; with few answered samples its p99 is close to its maximum.
``--health URL`` adds one connection that GETs URL every ``--health-interval-ms`` (paced,
not closed-loop, so that it adds little load) and reports its latency as "health";
``--connections 0`` runs that alone. bench/load/peers.sh runs the probe beside wrk at
concurrency 1,024, and then ``--goodput OUT``: served (200) requests a second at
c=1,024 against c=32, from the JSON files the run wrote into OUT. Prints a table and
writes JSON.

    python bench/load/answered.py URL --body FILE [--seconds 8] [--connections 32]
        [--health URL [--health-interval-ms 10]] [--json OUT]
    python bench/load/answered.py --connections 0 --health URL [--seconds 8] [--json OUT]
    python bench/load/answered.py --goodput OUT [--json OUT/goodput.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.common import write_result

TIMEOUT_S = 10.0  # as the harness's wrk


async def _exchange(reader, writer, request: bytes) -> int:
    writer.write(request)
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)
    return status


def _request(method: str, url: str, body: bytes = b"") -> bytes:
    parts = urlsplit(url)
    head = f"{method} {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


async def _paced(host: str, port: int, request: bytes, until: float, interval: float,
                 latencies: dict) -> None:
    """One connection sending REQUEST every INTERVAL seconds (or as soon as the previous
    answer arrived, when that was later); statuses as in _connection."""
    writer, due = None, time.monotonic()
    while due < until:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        due += interval
        start = time.perf_counter()
        try:
            if writer is None:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), TIMEOUT_S)
            status = await asyncio.wait_for(_exchange(reader, writer, request), TIMEOUT_S)
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as error:
            status = "timeout" if isinstance(error, TimeoutError) else "error"
            if writer is not None:
                writer.close()
            writer = None
        latencies.setdefault(status, []).append((time.perf_counter() - start) * 1e3)
    if writer is not None:
        writer.close()


async def _connection(host: str, port: int, request: bytes, until: float,
                      latencies: dict) -> None:
    """One closed-loop connection; a failed exchange is counted as "error" (or
    "timeout") and the connection opened again."""
    writer = None
    while time.monotonic() < until:
        start = time.perf_counter()
        try:
            if writer is None:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), TIMEOUT_S)
            status = await asyncio.wait_for(_exchange(reader, writer, request), TIMEOUT_S)
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as error:
            # wait_for's TimeoutError is an OSError
            status = "timeout" if isinstance(error, TimeoutError) else "error"
            if writer is not None:
                writer.close()
            writer = None
        latencies.setdefault(status, []).append((time.perf_counter() - start) * 1e3)
    if writer is not None:
        writer.close()


def _summary(latencies: dict) -> dict:
    return {str(status): {"requests": len(v), "p50_ms": float(np.percentile(v, 50)),
                          "p90_ms": float(np.percentile(v, 90)),
                          "p99_ms": float(np.percentile(v, 99)), "max_ms": float(max(v))}
            for status, v in sorted(latencies.items(), key=lambda kv: str(kv[0]))}


def probe(url: str, body: bytes, seconds: float, connections: int,
          health: str | None = None, health_interval_s: float = 0.01) -> dict:
    """Latencies by status of URL's POSTs ("by_status") and, with HEALTH, of its paced
    GETs ("health"), each {status: {requests, p50_ms, p90_ms, p99_ms, max_ms}}."""
    parts = urlsplit(url)
    request = _request("POST", url, body)
    latencies: dict = {}
    health_latencies: dict = {}

    async def run():
        until = time.monotonic() + seconds
        tasks = [_connection(parts.hostname, parts.port or 80, request, until, latencies)
                 for _ in range(connections)]
        if health is not None:
            h = urlsplit(health)
            tasks.append(_paced(h.hostname, h.port or 80, _request("GET", health), until,
                                health_interval_s, health_latencies))
        await asyncio.gather(*tasks)

    asyncio.run(run())
    result = {"by_status": _summary(latencies)}
    if health is not None:
        result["health"] = _summary(health_latencies)
    return result


def _served(level: dict) -> dict:
    """A load.py level (wrk): its requests a second split into served (not an HTTP error
    status) and refused (wrk's "status" errors: 503 here), and its connection errors."""
    seconds = level["duration_s"]
    refused = level["errors"]["status"]
    return {"concurrency": level["concurrency"], "rps": level["rps"],
            "served_rps": (level["requests"] - refused) / seconds,
            "refused_rps": refused / seconds, "p99_ms_all": level["p99_ms"],
            "connection_errors": level["error_total"] - refused}


def goodput(out: Path) -> dict:
    """Served requests a second at c=1,024 against c=32 (/predict), from the JSON files
    bench/load/peers.sh writes into OUT: orthornn.json (c=32), orthornn-overload.json (wrk
    alone) and orthornn-overload-probed.json with answered.json and health.json (wrk with
    this probe beside it: the tail of served requests and of health GETs)."""
    def load(name):
        path = out / name
        return json.loads(path.read_text()) if path.is_file() else None

    def level(result, c):
        return next((lv for lv in (result or {}).get("levels", []) if lv["concurrency"] == c),
                    None)

    base = level(load("orthornn.json"), 32)
    if base is None:
        raise ValueError(f"{out / 'orthornn.json'}: no level at concurrency 32")
    c32 = base["rps"]
    result: dict = {"c32_rps": c32, "goals": {"served_ratio_min": 0.75,
                                               "health_p99_ms_max": 100.0}}
    for key, name in (("overload", "orthornn-overload.json"),
                      ("probed", "orthornn-overload-probed.json")):
        lv = level(load(name), 1024)
        if lv is not None:
            row = result[key] = _served(lv)
            row["served_ratio"] = row["served_rps"] / c32
    answered, health = load("answered.json"), load("health.json")
    if answered is not None and "probed" in result:  # the server's goodput: probe's 200s too
        row = result["probed"]
        row["wrk_served_rps"] = row["served_rps"]
        row["probe_served_rps"] = answered["by_status"].get("200", {}).get(
            "requests", 0) / answered["seconds"]
        row["served_rps"] += row["probe_served_rps"]
        row["served_ratio"] = row["served_rps"] / c32
    if answered is not None:
        result["served_latency"] = answered["by_status"].get("200")
        result["refused_latency"] = answered["by_status"].get("503")
        result["probe_errors"] = sum(v["requests"] for k, v in answered["by_status"].items()
                                     if not k.isdigit())
    if health is not None:
        result["health"] = health.get("health", {})
    for name in ("orthornn-oip-json.json", "orthornn-oip-binary.json"):
        lv = level(load(name), 32)
        if lv is not None:
            result[name.removesuffix(".json").removeprefix("orthornn-") + "_c32_rps"] = lv["rps"]
    return result


def goodput_lines(g: dict) -> list[str]:
    lines = []
    for key, what in (("overload", "wrk alone"), ("probed", "wrk beside the probes")):
        row = g.get(key)
        if row is not None:
            split = f" (wrk {row['wrk_served_rps']:.0f} + probe {row['probe_served_rps']:.0f})" \
                if "probe_served_rps" in row else ""
            lines.append(
                f"served/s at c=1024 ({what}): {row['served_rps']:.0f}{split}, "
                f"{100 * row['served_ratio']:.0f}% of c=32's {g['c32_rps']:.0f} (goal >= 75%); "
                f"wrk's answers {row['rps']:.0f}/s, refused {row['refused_rps']:.0f}/s; "
                f"connection errors {row['connection_errors']}")
    served = g.get("served_latency")
    if served:
        lines.append(f"served (200) latency, probe: p50 {served['p50_ms']:.0f} ms, p99 "
                     f"{served['p99_ms']:.0f} ms, max {served['max_ms']:.0f} ms "
                     f"({served['requests']} requests)")
    ok = (g.get("health") or {}).get("200")
    if g.get("health") is not None:
        failed = sum(v["requests"] for k, v in g["health"].items() if k != "200")
        lines.append("health GET p99 " + (f"{ok['p99_ms']:.1f} ms, max {ok['max_ms']:.1f} ms "
                                          f"({ok['requests']} answered 200" if ok else "- (none "
                                          "answered 200") + f", {failed} not) (goal < 100 ms)")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", nargs="?")
    p.add_argument("--body", type=Path, help="JSON request body file")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--health", default=None, metavar="URL",
                   help="also GET URL on a connection of its own, paced")
    p.add_argument("--health-interval-ms", type=float, default=10.0)
    p.add_argument("--goodput", type=Path, default=None, metavar="OUT",
                   help="only summarize bench/load/peers.sh's JSON files in OUT")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.goodput is not None:
        g = goodput(a.goodput)
        print("\n".join(goodput_lines(g)))
        if a.json is not None:
            write_result(a.json, g)
        return 0
    if a.seconds <= 0 or a.connections < 0 or (a.connections == 0 and a.health is None) \
            or a.health_interval_ms <= 0:
        p.error("--seconds and --health-interval-ms must be positive, and --connections at "
                "least 1 (0 with --health)")
    if a.connections and (a.url is None or a.body is None):
        p.error("URL and --body are needed (or --connections 0 --health URL, or --goodput OUT)")
    result = probe(a.url or a.health, a.body.read_bytes() if a.body else b"", a.seconds,
                   a.connections, a.health, a.health_interval_ms / 1e3)
    print("        status  requests  p50 ms  p90 ms  p99 ms  max ms")
    for what, rows in (("POST", result["by_status"]), ("health", result.get("health", {}))):
        for status, r in rows.items():
            print(f"{what:>6} {status:>7}  {r['requests']:8d}  {r['p50_ms']:6.1f}  "
                  f"{r['p90_ms']:6.1f}  {r['p99_ms']:6.1f}  {r['max_ms']:6.1f}")
    if a.json is not None:
        write_result(a.json, {"url": a.url, "connections": a.connections,
                              "seconds": a.seconds, "health_url": a.health,
                              "health_interval_ms": a.health_interval_ms, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
