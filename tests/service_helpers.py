"""Helpers for the service tests: repositories built from the staged packages, a live
uvicorn server on 127.0.0.1, and independent references (onnxruntime run directly on a
package, the torch outputs in golden.npz), and waiting on a condition with a deadline
(wait_until) where a test would otherwise sleep."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import uvicorn
from orthornn.service.http.app import create_app
from orthornn.service.server.launch import DrainingServer, listen
from orthornn.service.settings import Settings


def make_repo(stage: Path, root: Path, models: dict[str, list[int]]) -> Path:
    """REPO with the given staged versions of each model."""
    for name, versions in models.items():
        for v in versions:
            publish_copy(stage / name / str(v), root / name, v)
    return root


def gated(model_dir: Path, version: int) -> None:
    """Record a passed gate in VERSION's manifest (what export --gate writes)."""
    path = model_dir / str(version) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["evaluation"] = {**(manifest["evaluation"] or {}), "gate": {"passed": True}}
    path.write_text(json.dumps(manifest))


def publish_copy(package: Path, model_dir: Path, version: int) -> Path:
    """Publish a staged package as MODEL_DIR/<version> the way export does: build in a
    hidden directory, then one atomic rename. The manifest keeps its own version, so a
    package is copied to the version number it was exported as."""
    model_dir.mkdir(parents=True, exist_ok=True)
    tmp = model_dir / f".tmp-{uuid.uuid4().hex[:8]}"
    shutil.copytree(package, tmp)
    os.rename(tmp, model_dir / str(version))
    return model_dir / str(version)


def wait_ready(proc, url: str, timeout: float = 120.0) -> None:
    """Poll URL/v2/health/ready until 200; fail with the server's output if the
    process ends or the time runs out."""
    import httpx

    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"server not ready: {proc.stdout.read()[-3000:]}")
        time.sleep(0.1)


def _poll(predicate, deadline: float, timeout: float, what: str | Callable[[], str]):
    """PREDICATE's value; AssertionError naming WHAT when it is false past DEADLINE."""
    value = predicate()
    if not value and time.monotonic() > deadline:
        raise AssertionError(f"not within {timeout:g} s: {what() if callable(what) else what}")
    return value


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05,
               what: str | Callable[[], str] = "the condition"):
    """Poll PREDICATE every INTERVAL seconds until it returns something true, and return
    that. Past TIMEOUT seconds: AssertionError naming WHAT (a string, or a callable that
    describes the state at the deadline). Tests wait on the condition itself, never on a
    fixed sleep: a busy 2-core CI machine can outlast any sleep."""
    deadline = time.monotonic() + timeout
    while not (value := _poll(predicate, deadline, timeout, what)):
        time.sleep(interval)
    return value


async def wait_until_async(predicate, timeout: float = 30.0, interval: float = 0.001,
                           what: str | Callable[[], str] = "the condition"):
    """wait_until on an event loop: the loop runs (asyncio.sleep) between the polls."""
    deadline = time.monotonic() + timeout
    while not (value := _poll(predicate, deadline, timeout, what)):
        await asyncio.sleep(interval)
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """The app on uvicorn in a thread, on a free loopback port."""

    def __init__(self, uvicorn_options: dict | None = None, **settings):
        settings.setdefault("poll_interval_s", 0.1)
        self.settings = Settings(host="127.0.0.1", port=free_port(), **settings)
        self.app = create_app(self.settings)
        # the product's server and listener (service/server/launch.py), without its signals
        options = uvicorn_options or {}
        self.server = DrainingServer(uvicorn.Config(self.app, host="127.0.0.1",
                                                    port=self.settings.port,
                                                    log_level="warning", **options),
                                     self.app, 0.0, eager=self.settings.listener == "eager")
        scheme = "https" if "ssl_certfile" in options else "http"
        self.url = f"{scheme}://127.0.0.1:{self.settings.port}"
        sock = listen("127.0.0.1", self.settings.port)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        self.wait(lambda: self.app.state.registry.ready())
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @staticmethod
    def wait(condition, timeout: float = 30.0) -> None:
        deadline = time.time() + timeout
        while not condition():
            if time.time() > deadline:
                raise TimeoutError("condition not met in time")
            time.sleep(0.02)


def reference(package: Path, sequences: list[np.ndarray]) -> list[dict]:
    """Each sequence run alone through onnxruntime on the package's model.onnx."""
    sess = ort.InferenceSession(str(package / "model.onnx"),
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    tokens = sess.get_inputs()[0].name == "tokens"
    out = []
    for s in sequences:
        x = np.asarray(s, dtype=np.int64 if tokens else np.float32)[None]
        feeds = {"tokens" if tokens else "x": x, "lengths": np.array([len(s)], np.int64)}
        out.append({k: v[0] for k, v in zip(names, sess.run(names, feeds), strict=True)})
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def golden(package: Path) -> dict[str, np.ndarray]:
    with np.load(package / "golden.npz") as f:
        return {k: f[k] for k in f.files}


class RawConnection:
    """One raw keep-alive HTTP/1.1 connection: what is sent on it and when, exactly (for
    admission and read-deadline tests, where an HTTP client would hide both)."""

    def __init__(self, port: int, timeout: float = 30.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def trickle(self, data: bytes, pieces: int, seconds: float) -> None:
        """DATA in PIECES writes over SECONDS."""
        size = -(-len(data) // pieces)
        for i in range(0, len(data), size):
            if i:
                time.sleep(seconds / (pieces - 1))
            self.send(data[i:i + size])

    def answer(self, timeout: float = 30.0) -> tuple[int, dict, bytes]:
        """The next response (status, headers, body: Content-Length or chunked);
        socket.timeout (TimeoutError) when none has come within TIMEOUT seconds."""
        self.sock.settimeout(timeout)
        while b"\r\n\r\n" not in self.buffer:
            self._recv()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in
                   (line.split(":", 1) for line in lines[1:])}
        status = int(lines[0].split()[1])
        if "content-length" in headers or headers.get("transfer-encoding") != "chunked":
            length = int(headers.get("content-length", 0))
            while len(self.buffer) < length:
                self._recv()
            body, self.buffer = self.buffer[:length], self.buffer[length:]
            return status, headers, body
        body = b""
        while True:
            while b"\r\n" not in self.buffer:
                self._recv()
            size_line, rest = self.buffer.split(b"\r\n", 1)
            size = int(size_line, 16)
            while len(rest) < size + 2:
                self._recv()
                rest = self.buffer.split(b"\r\n", 1)[1]
            body, self.buffer = body + rest[:size], rest[size + 2:]
            if size == 0:
                return status, headers, body

    def silent(self, seconds: float) -> bool:
        """Whether nothing at all arrives within SECONDS."""
        try:
            self.answer(seconds)
        except TimeoutError:
            return True
        return False

    def closed(self, timeout: float) -> bool:
        """Whether the server closes the connection within TIMEOUT seconds."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def cut(self, timeout: float) -> tuple[float, bytes]:
        """Wait for the server to close the connection: (when, what it sent first)."""
        self.sock.settimeout(timeout)
        data = self.buffer
        try:
            while chunk := self.sock.recv(4096):
                data += chunk
        except ConnectionResetError:
            pass
        return time.monotonic(), data

    def _recv(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed by the server")
        self.buffer += chunk

    def close(self) -> None:
        self.sock.close()


#: a session secret a test client chose (sent with every request of a client that starts
#: sessions: its starts are then its own, and its later chunks present it)
SECRET = "test-client-secret-0123456789abcdef"
#: the session owner's header; tritonclient adds its own headers to the dict it is given
#: (an int among them, which broke every later test that used this one): pass it a copy
OWNER = {"Orthornn-Session-Secret": SECRET}
