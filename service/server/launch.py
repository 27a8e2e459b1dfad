"""Running the app on uvicorn, with a graceful SIGTERM: readiness turns 503 at once,
requests keep being accepted for ``shutdown_delay_s`` (load balancers see the 503 and
stop sending), then the listener closes, in-flight requests finish (at most
``drain_timeout_s``), the models are released and the process exits 0."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import math
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI
from orthornn.export.artifacts.records import atomic_write

from ..http.app import create_app
from ..registry.devices import select_providers
from ..settings import Settings
from .lean import lean_protocol
from .listener import listen_eagerly
from .protocol import Deadlines, head_bounded, with_deadlines

log = logging.getLogger("orthornn.service")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, delay: float,
                 eager: bool = True):
        super().__init__(config)
        self.service_app = app
        self.delay = delay
        self.eager = eager
        self._draining = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup; on the given sockets, with the eager listener in place of
        uvicorn's own server (``service.server.listener``) unless ``eager`` is off (or on
        Windows, whose Proactor loop has no add_reader). Either listener bounds the time a
        request takes to arrive (``deadlines``). Then, in the background, the one log line
        that says the service is ready and where."""
        deadlines = self.deadlines()
        settings = getattr(self.service_app.state, "settings", None)
        max_head = getattr(settings, "max_header_bytes", 0)
        if max_head:  # h11's own bound of a head (a 400 past it); httptools': head_bounded
            self.config.h11_max_incomplete_event_size = max_head
        # the hot routes off the ASGI stack (service.server.lean), whichever listener
        self.config.http_protocol_class = lean_protocol(self.config.http_protocol_class,
                                                        self.service_app)
        if sockets is not None and self.eager and sys.platform != "win32":
            await super().startup(sockets=[])  # lifespan and state, no server of its own
            # an EagerListener has what uvicorn's shutdown calls of a server (close,
            # wait_closed), though uvicorn types the list as asyncio.Server; a connection
            # refused for overload is held until its Retry-After unless hold_refused is off
            self.servers = listen_eagerly(self, sockets,
                                          hold=getattr(settings, "hold_refused", True),
                                          deadlines=deadlines, max_head=max_head)
        else:
            if max_head:  # innermost: the deadlines wrap it
                self.config.http_protocol_class = head_bounded(
                    self.config.http_protocol_class, max_head)
            if deadlines is not None:  # uvicorn's startup builds protocols from the config
                with_deadlines(self, deadlines)
            await super().startup(sockets)
            if sockets is None:  # uvicorn bound host and port itself
                sockets = [s for server in getattr(self, "servers", ())
                           for s in getattr(server, "sockets", None) or ()]
        if not self.should_exit:
            urls = ", ".join(address(sock) for sock in sockets)
            self._announcer = asyncio.get_running_loop().create_task(self.announce(urls))

    def deadlines(self) -> Deadlines | None:
        """The settings' deadlines for receiving a request's head and body, each closed
        connection counted in orthornn_slow_client_closes_total{phase}; None when both
        are off (or the app has no settings)."""
        state = self.service_app.state
        settings, metrics = getattr(state, "settings", None), getattr(state, "metrics", None)
        if settings is None or metrics is None:
            return None
        head_s, body_s = settings.header_timeout_s, settings.body_timeout()
        if not head_s and not body_s:
            return None
        # both phases at 0 from the start, so that a rate over them is defined
        counters = {phase: metrics.slow_client_closes.labels(phase) for phase in ("head", "body")}
        return Deadlines(head_s, body_s, lambda phase: counters[phase].inc())

    async def announce(self, urls: str) -> None:
        """Log at INFO, once, when every configured model is loaded: the address and the
        models served. A first repository scan that ends short of it logs a WARNING."""
        registry = self.service_app.state.registry
        warned = False
        while not registry.ready():
            if self.should_exit:
                return
            missing = registry.waiting_for() if registry.scanned.is_set() else []
            if missing and not warned:
                warned = True
                log.warning("listening on %s but not ready: not loaded: %s (refused, see "
                            "above, or not in the repository)", urls, ", ".join(missing))
            await asyncio.sleep(0.05)
        serving = registry.serving()
        models = ", ".join(f"{name} v" + ",".join(map(str, versions))
                           for name, versions in sorted(serving.items()))
        count = f"{len(serving)} model{'' if len(serving) == 1 else 's'}: {models}" \
            if serving else "no models yet"
        log.info("ready on %s (%s)", urls, count)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or sig not in (signal.SIGTERM, signal.SIGINT):
            return super().handle_exit(sig, frame)  # a second signal: uvicorn's own way
        self._draining = True
        self.service_app.state.draining = True
        log.info("%s: readiness now 503; draining after %.1f s", signal.Signals(sig).name,
                 self.delay)
        if self.delay > 0:
            threading.Timer(self.delay, lambda: setattr(self, "should_exit", True)).start()
        else:
            self.should_exit = True


def address(sock: socket.socket) -> str:
    """The URL of a listening socket (its bound port: --port 0 binds a free one)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def write_address(path: Path, sock: socket.socket) -> None:
    """Write the URL of SOCK as reached from this machine (a wildcard address becomes
    loopback) to PATH, atomically (a reader sees the old file or the new one): what
    the image's HEALTHCHECK probes, whatever --port, ORTHORNN_PORT or the default chose.
    A file that cannot be written is a warning (the check then falls back to
    ORTHORNN_PORT)."""
    host, port = sock.getsockname()[:2]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    try:
        atomic_write(path, lambda tmp: tmp.write_text(url + "\n"))
    except OSError as error:
        log.warning("address_file %s could not be written: %s", path, error)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to HOST:PORT (before any model is loaded); ValueError, one line,
    when the address is taken or cannot be used."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn chooses
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except (OSError, OverflowError) as error:
        sock.close()
        if isinstance(error, socket.gaierror):
            raise ValueError(f"host {host!r} cannot be resolved: {error.strerror}") from None
        taken = getattr(error, "errno", None) == errno.EADDRINUSE
        raise ValueError(f"port {port} on {host} is " + (
            "already in use (another server listens there; choose another --port)"
            if taken else f"not available: {getattr(error, 'strerror', None) or error}")) \
            from None
    sock.set_inheritable(True)
    return sock


#: the cyclic collector's first threshold in a server: the net count of new container
#: objects that starts a collection (Python's 700 is crossed by every batch in flight)
GEN0_THRESHOLD = 5_000


def tune_collector() -> None:
    """The server's heap as it starts (the imports, the app: some 60,000 objects that live
    as long as the process) moved out of the cyclic collector's sight, and its young
    generation collected less often. With Python's defaults a loaded server spent about 8%
    of its CPU collecting, over half of it in full collections (~35 ms each, twice a
    second, that found nothing to free). docs/design.md, "The collector"."""
    gc.collect()  # what the start left behind is freed, not frozen
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])


def batch_scheduling() -> None:
    """The server's threads scheduled as batch work (Linux's SCHED_BATCH, which any
    process may choose for its own threads; the threads started later inherit it): a thread that
    wakes (the event loop, as a request arrives) no longer preempts the one running (the
    inference thread, inside onnxruntime), so a batch runs to its end and the requests
    that arrived meanwhile are read in one turn and form the next batch. Elsewhere, or
    where it is refused, the default scheduling stays. docs/design.md, "Scheduling"."""
    try:
        # the threads already there too (the imports' pools: OpenBLAS's), so that no
        # thread of the server preempts another
        threads = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir(
            "/proc/self/task") else [0]
        for thread in threads:
            os.sched_setscheduler(thread, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as error:  # not Linux, or a sandbox that refuses it
        log.info("default scheduling (SCHED_BATCH unavailable: %s)", error)


def serve(settings: Settings) -> int:
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from orthornn.export.artifacts.storage import open_store

    if settings.repository_uri is not None:  # a bucket: mirrored into its cache folder
        open_store(settings.repository_uri, "repo").check()  # one line at start
        settings.repo.mkdir(parents=True, exist_ok=True)
    if settings.capture_uri is not None:  # a bucket: written to its spool, uploaded
        open_store(settings.capture_uri, "capture").check()
    if not settings.repo.is_dir():
        raise ValueError(f"repo {str(settings.repo)!r} is not a directory")
    refusal = settings.repository_api_exposure()
    if refusal is not None:
        raise ValueError(refusal)
    # device cuda without CUDA ends here, one line and exit 2, before the port is bound
    providers = select_providers(settings.providers, settings.device)
    sock = listen(settings.host, settings.port)  # a busy port fails before any model loads
    if settings.address_file is not None:
        write_address(settings.address_file, sock)
    # The event loop thread is busy with HTTP most of the time; an inference thread whose
    # batch has finished needs the GIL for a moment to hand the answers over. CPython's
    # default switch interval (5 ms) would keep it waiting that long, idling the model.
    sys.setswitchinterval(0.0002)
    batch_scheduling()  # before create_app: its inference threads inherit it
    app = create_app(settings, providers)
    tune_collector()
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level, access_log=False,
                            # uvicorn takes whole seconds here
                            timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s) or None,
                            limit_concurrency=None, timeout_keep_alive=30,
                            # X-Forwarded-For/-Proto would set the client address (read
                            # only by access logs, off) and the scheme (read by no route);
                            # the wrapper costs every request a layer
                            proxy_headers=False)
    server = DrainingServer(config, app, settings.shutdown_delay_s,
                            eager=settings.listener == "eager")
    server.run(sockets=[sock])
    return 0
