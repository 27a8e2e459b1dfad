"""Latency by status under load: what wrk cannot tell apart.

wrk's histogram mixes every answer, so under overload it is mostly the fast 503s. This
probe keeps ``--connections`` keep-alive connections of its own beside the load (each
sends its next request when the previous answer arrived) and reports the latency of the
answered (200) and the refused (503) requests separately (failed exchanges as "error" or
"timeout"). Its connections stay open, so it does not see the wait of new connections in
the listen queue; with few answered samples its p99 is close to its maximum.
bench/peers.sh runs it beside wrk at concurrency 1,024. Prints a table and writes JSON.

    python bench/answered.py URL --body FILE [--seconds 8] [--connections 32] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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


def probe(url: str, body: bytes, seconds: float, connections: int) -> dict:
    parts = urlsplit(url)
    request = (f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
    latencies: dict[int, list[float]] = {}

    async def run():
        until = time.monotonic() + seconds
        await asyncio.gather(*(_connection(parts.hostname, parts.port or 80, request, until,
                                           latencies) for _ in range(connections)))

    asyncio.run(run())
    return {str(status): {"requests": len(v), "p50_ms": float(np.percentile(v, 50)),
                          "p90_ms": float(np.percentile(v, 90)),
                          "p99_ms": float(np.percentile(v, 99)), "max_ms": float(max(v))}
            for status, v in sorted(latencies.items(), key=lambda kv: str(kv[0]))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url")
    p.add_argument("--body", type=Path, required=True, help="JSON request body file")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.seconds <= 0 or a.connections < 1:
        p.error("--seconds must be positive and --connections at least 1")
    result = probe(a.url, a.body.read_bytes(), a.seconds, a.connections)
    print("status  requests  p50 ms  p90 ms  p99 ms  max ms")
    for status, r in result.items():
        print(f"{status:>6}  {r['requests']:8d}  {r['p50_ms']:6.1f}  {r['p90_ms']:6.1f}  "
              f"{r['p99_ms']:6.1f}  {r['max_ms']:6.1f}")
    if a.json is not None:
        write_result(a.json, {"url": a.url, "connections": a.connections,
                              "seconds": a.seconds, "by_status": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
