"""Real components for the tests of sessions shared across replicas: a ``redis-server``, an
``haproxy`` load balancer and ``orthornn serve`` replicas, each a process of its own on a
free loopback port, started and stopped by its PID (SIGKILL too). Nothing else on the
machine is touched: each program runs with a configuration written into the test's
temporary folder, without persistence, and is killed when its fixture ends.

redis-server and haproxy come from the Debian packages (`make test` installs them with
scripts/ci-debian.sh); where a program is missing, the tests that need it skip with the
reason. A test module takes a fixture by name: ``redis_server = cluster.redis_server``.
"""

from __future__ import annotations

import contextlib
import csv
import http.server
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL_HINT = "run `make test` (scripts/ci-debian.sh installs it from Debian's packages)"


def program(name: str) -> str | None:
    """The path of a program on PATH or in /usr/sbin (haproxy's place), or None."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")


def require(name: str) -> str:
    path = program(name)
    if path is None:
        pytest.skip(f"{name} not found on PATH or in /usr/sbin; {INSTALL_HINT}")
    return path


def free_port() -> int:
    """A free loopback port. (tests/service_helpers.py has the same three lines, but
    importing it imports the whole app: the Redis and haproxy fixtures stay independent of
    it, so the store's tests run while the app is broken or mid-edit.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 10.0,
              what: str = "process") -> None:
    """Until 127.0.0.1:PORT accepts a connection; AssertionError with the process's exit
    status if it ends first or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            status = proc.poll()
            stop_pid(proc)
            raise AssertionError(f"{what} did not listen on port {port} "
                                 f"(exit status {status})")
        time.sleep(0.02)


def stop_pid(proc: subprocess.Popen, sig: int = signal.SIGKILL, timeout: float = 10.0
             ) -> int | None:
    """Send SIG to the process (by its PID) unless it has ended; its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)
    return proc.returncode


# -- Redis --------------------------------------------------------------------------------

class RedisServer:
    """A redis-server on 127.0.0.1:PORT (a free one unless given) without persistence
    (``--save '' --appendonly no``); ``stop()`` kills it, ``start()`` starts it again on
    the same port (empty: nothing was saved)."""

    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None):
        self.binary = require("redis-server")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--daemonize", "no", "--logfile", str(self.workdir / "redis.log")]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, self.proc, what="redis-server")
        return self

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            stop_pid(self.proc, sig)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        path = self.workdir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test (skips where redis-server is not installed)."""
    with RedisServer(tmp_path / "redis") as server:
        yield server


# -- haproxy ------------------------------------------------------------------------------

HAPROXY_CONFIG = """\
global
    maxconn 1024

defaults
    mode http
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    timeout check 1s
    # a connection refused by a replica (killed, restarting) is tried once on another
    retries 1
    option redispatch

frontend orthornn
    bind 127.0.0.1:{port}
    default_backend replicas

frontend stats
    bind 127.0.0.1:{stats_port}
    stats enable
    stats uri /stats
    stats refresh 1s

backend replicas
    balance roundrobin
    option httpchk
    http-check send meth GET uri {health_path}
    http-check expect status 200
    default-server inter {check_ms}ms fastinter {check_ms}ms downinter {check_ms}ms fall 2 rise 1
{servers}
"""


class HAProxy:
    """haproxy in HTTP mode on 127.0.0.1:PORT, round-robin over 127.0.0.1:BACKENDS, each
    health-checked with GET /v2/health/ready every ``check_ms``; its stats page on another
    port tells each backend's state (``states()``)."""

    def __init__(self, workdir: Path, backends: Sequence[int], *, check_ms: int = 200,
                 health_path: str = "/v2/health/ready"):
        self.binary = require("haproxy")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.backends = list(backends)
        self.port, self.stats_port = free_port(), free_port()
        self.config = self.workdir / "haproxy.cfg"
        servers = "\n".join(f"    server r{i} 127.0.0.1:{p} check"
                            for i, p in enumerate(self.backends))
        self.config.write_text(HAPROXY_CONFIG.format(
            port=self.port, stats_port=self.stats_port, health_path=health_path,
            check_ms=check_ms, servers=servers))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HAProxy:
        check = subprocess.run([self.binary, "-c", "-q", "-f", str(self.config)],
                               capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        # -db: in the foreground, not a daemon, so the PID is haproxy's own
        self.proc = subprocess.Popen([self.binary, "-db", "-f", str(self.config)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(self.workdir / "haproxy.log", "wb"))  # noqa: SIM115
        wait_port(self.port, self.proc, what="haproxy")
        return self

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            stop_pid(self.proc, sig)
            if self.proc.stderr is not None:
                self.proc.stderr.close()

    def states(self) -> dict[str, str]:
        """Backend server name (r0, r1, ...) -> haproxy's status (UP, DOWN, ...)."""
        import httpx

        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {r["svname"]: r["status"].split(" ")[0] for r in rows
                if r["pxname"] == "replicas" and r["svname"] not in ("BACKEND", "FRONTEND")}

    def wait_states(self, expected: dict[str, str], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while (states := self.states()) != expected:
            if time.monotonic() > deadline:
                raise AssertionError(f"haproxy backends {states}, expected {expected}")
            time.sleep(0.05)

    def __enter__(self) -> HAProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class TinyBackend:
    """A minimal HTTP backend in a thread: 200 with its name at every path (and at
    /v2/health/ready while ``ready``), 503 on the health path when not ready."""

    def __init__(self, name: str):
        self.name, self.ready, self.hits = name, True, 0
        backend = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                health = self.path == "/v2/health/ready"
                status = 503 if health and not backend.ready else 200
                if not health:
                    backend.hits += 1
                body = backend.name.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> TinyBackend:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- orthornn serve -----------------------------------------------------------------------

class Replica:
    """``orthornn serve --repo REPO`` in a process of its own on a free loopback port, with
    the ``ORTHORNN_*`` variables of ENV only (the caller's are dropped) and more flags in
    ARGS. ``start()`` waits for readiness (tests/service_helpers.wait_ready); ``stop()``
    sends SIGTERM (the service drains), ``kill()`` SIGKILL; ``output()`` is what it logged."""

    def __init__(self, repo: Path | str, *, env: dict[str, str] | None = None,
                 args: Sequence[str] = (), port: int | None = None,
                 log_level: str = "warning"):
        # a bucket's URI stays a string (a Path would fold its "//")
        self.repo = repo if isinstance(repo, str) and "://" in repo else Path(repo)
        self.args, self.log_level = list(args), log_level
        self.port = port or free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ORTHORNN_")}
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None
        self._lines: list[bytes] = []
        self._reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> Replica:
        from .service_helpers import wait_ready

        self._lines = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orthornn", "serve", "--repo", str(self.repo),
             "--host", "127.0.0.1", "--port", str(self.port), "--log-level", self.log_level,
             *self.args],
            cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        wait_ready(self.proc, self.url, timeout=timeout)
        # from now on a thread drains the output, so a chatty replica never blocks on a
        # full pipe
        proc = self.proc

        def drain():
            assert proc.stdout is not None
            for line in proc.stdout:
                self._lines.append(line)
        self._reader = threading.Thread(target=drain, daemon=True)
        self._reader.start()
        return self

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then wait for the drain (SIGKILL past TIMEOUT); the exit status."""
        if self.proc is None:
            return None
        status = stop_pid(self.proc, signal.SIGTERM, timeout)
        if self._reader is not None:
            self._reader.join(timeout=10)
        return status

    def kill(self) -> int | None:
        if self.proc is None:
            return None
        status = stop_pid(self.proc, signal.SIGKILL)
        if self._reader is not None:
            self._reader.join(timeout=10)
        return status

    def output(self) -> str:
        return b"".join(self._lines).decode(errors="replace")

    def __enter__(self) -> Replica:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


@contextlib.contextmanager
def replicas(repo: Path, count: int, **options) -> Iterator[list[Replica]]:
    """COUNT replicas of REPO (OPTIONS as Replica's), started one after the other and
    killed at the end."""
    started: list[Replica] = []
    try:
        for _ in range(count):
            started.append(Replica(repo, **options).start())
        yield started
    finally:
        for replica in started:
            if replica.proc is not None and replica.proc.poll() is None:
                replica.kill()


class CuttingProxy:
    """A TCP proxy to 127.0.0.1:TARGET_PORT that, once ``arm(marker)``-ed, cuts the
    connection whose client bytes hold MARKER (``cuts`` counts them):

    - ``where="reply"`` (the default): the bytes pass on to the server, and the reply is
      cut after its first KEEP bytes: with KEEP 0 the command applied and its reply lost
      (what a broken connection does to a client that then retries), with more a download
      cut in the middle;
    - ``where="request"``: only the first half of those bytes reach the server (an upload
      cut in the middle: the server never gets the whole request).

    TIMES: how many connections are cut (None: every matching one until ``disarm()``,
    so that a client's retries are cut too)."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.marker: bytes | None = None
        self.where, self.keep, self.times = "reply", 0, 1
        self.cuts = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, marker: bytes, where: str = "reply", keep: int = 0,
            times: int | None = 1) -> None:
        assert where in ("reply", "request")
        with self.lock:
            self.marker, self.where, self.keep, self.times = marker, where, keep, times

    def disarm(self) -> None:
        with self.lock:
            self.marker = None

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            cut: list[int] = []  # [KEEP]: the next reply is cut after KEEP bytes
            threading.Thread(target=self._to_server, args=(client, upstream, cut),
                             daemon=True).start()
            threading.Thread(target=self._to_client, args=(upstream, client, cut),
                             daemon=True).start()

    def _matches(self, data: bytes) -> str | None:
        """Where to cut the connection that sent DATA (None: nowhere); counts it down."""
        with self.lock:
            if self.marker is None or self.marker not in data:
                return None
            if self.times is not None:
                self.times -= 1
                if self.times == 0:
                    self.marker = None
            return self.where

    def _to_server(self, client: socket.socket, upstream: socket.socket,
                   cut: list[int]) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                where = self._matches(data)
                if where == "request":  # half of it, then the connection is gone
                    upstream.sendall(data[:len(data) // 2])
                    with self.lock:
                        self.cuts += 1
                    for sock in (client, upstream):
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                    return
                if where == "reply":
                    cut.append(self.keep)
                upstream.sendall(data)
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_WR)

    def _to_client(self, upstream: socket.socket, client: socket.socket,
                   cut: list[int]) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if cut:  # the marked command's reply: cut after its first KEEP bytes
                    if cut[0] > 0:
                        client.sendall(data[:cut[0]])
                        cut[0] -= len(data[:cut[0]])
                        if cut[0] > 0:
                            continue
                    with self.lock:
                        self.cuts += 1
                    break
                client.sendall(data)
        for sock in (client, upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.listener.close()

    def __enter__(self) -> CuttingProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
