"""The container images, built by scripts/images.sh (`make images`) and run the way the Helm
chart runs them (tests/containers.py turns the rendered pod spec into run flags):

- the serving image runs as UID 10001 on a read-only root with the chart's args and env,
  its probes and HEALTHCHECK answer, /predict equals the checkout's service, a version
  published into the mounted repository is swapped in under load without a failed
  request, and SIGTERM drains (exit 0, in-flight requests answered);
- the training image runs the retraining CronJob's command on mounted volumes: it trains,
  exports through the gate, and the serving container swaps the new version in.

The images are built in the background from the start of the session (conftest.py), so
these tests run last; they skip with the reason where no container engine can run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from orthornn.export.artifacts import remote, repository
from orthornn.export.artifacts.storage import open_store

from .. import containers as c
from .. import objectstore
from ..service_helpers import LiveServer, free_port, make_repo, publish_copy

seaweedfs = objectstore.seaweedfs

# the image build (minutes, cold) runs beside the other tests, and the training container
# trains: longer than the suite's default timeout
pytestmark = [pytest.mark.containers, pytest.mark.timeout(1800)]
CHART = c.ROOT / "helm" / "orthornn"
# 400 until the object-store client (obstore, 16 MiB installed) joined the base
# dependencies, so that serving pods can read a repository on S3 (docs/deployment.md)
MAX_SERVE_MIB = 420


def helm_template(*sets: str) -> c.Rendered:
    from .test_deploy import SECRETS, tool

    args = [tool("helm"), "template", "rel", str(CHART)]
    for item in (*SECRETS, *sets):
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return c.Rendered([d for d in yaml.safe_load_all(out.stdout) if d])


# ------------------------------------------------------------ the translation, no engine

def test_run_flags_follow_the_rendered_pod(tmp_path):
    rendered = helm_template("containerPort=18123")
    (tmp_path / "repo").mkdir()
    deployment = rendered.one("Deployment", "server")
    flags = c.run_flags(deployment, rendered, {"models": tmp_path / "repo"}, tmp_path)
    container = c.pod_spec(deployment)["containers"][0]
    image_at = flags.index(container["image"])
    assert flags[image_at + 1:] == ["serve", "--repo", "/models", "--host", "0.0.0.0",
                                    "--port", "18123"]
    options = flags[:image_at]
    pairs = {(options[i], options[i + 1]) for i in range(len(options) - 1)}
    assert ("--user", "10001:10001") in pairs and "--read-only" in options
    assert ("--cap-drop", "ALL") in pairs
    assert ("--security-opt", "no-new-privileges") in pairs
    assert ("--volume", f"{tmp_path / 'repo'}:/models:ro") in pairs
    assert ("--volume", f"{tmp_path / 'emptyDir' / 'tmp'}:/tmp:rw") in pairs
    assert ("--group-add", "10001") in pairs
    # the kubelet's fsGroup: the group owns the volumes and may write them
    if os.geteuid() == 0:  # only root may give files to another group
        for volume in (tmp_path / "repo", tmp_path / "emptyDir" / "tmp"):
            assert volume.stat().st_gid == 10001 and volume.stat().st_mode & 0o2070 == 0o2070
    env = dict(v.split("=", 1) for k, v in pairs if k == "--env")
    assert env["ORTHORNN_PORT"] == "18123" and env["ORTHORNN_REPO"] == "/models"
    assert env["HOME"] == "/tmp" and len(env["ORTHORNN_ADMIN_TOKEN"]) >= 16
    assert c.probes(deployment) == {"startupProbe": ("/v2/health/live", 18123),
                                    "readinessProbe": ("/v2/health/ready", 18123),
                                    "livenessProbe": ("/v2/health/live", 18123)}
    training = rendered_training(tmp_path, 18123)
    flags = c.run_flags(training.one("CronJob", "retraining"), training,
                        {"models": tmp_path / "repo"}, tmp_path)
    entry = flags.index("--entrypoint")
    assert flags[entry + 1] == "/bin/sh" and flags[entry + 3] == "-ec"  # image, then -ec
    assert (tmp_path / "train-config" / "train.yaml").is_file()
    assert f"{tmp_path / 'repo'}:/models:rw" in flags


def rendered_training(tmp_path: Path, port: int) -> c.Rendered:
    """The chart with retraining on: a small digits run whose gate always passes (its
    tolerance spans the whole accuracy range: this checks the wiring, not the model)."""
    return helm_template(f"containerPort={port}", "retraining.enabled=true",
                         "retraining.trainConfig.hidden_size=16",
                         "retraining.trainConfig.steps=20",
                         "retraining.trainConfig.batch_size=32",
                         "retraining.trainConfig.device=cpu",
                         "retraining.gate.tolerance=1",
                         "lifecycle.shutdownDelaySeconds=1")


# ------------------------------------------------------------ the images themselves

@pytest.fixture(scope="module")
def engine():
    return c.images()


def test_image_sizes_users_and_contents(engine):
    for image, user in ((c.SERVE_IMAGE, "10001:10001"), (c.TRAIN_IMAGE, "10001:10001")):
        info = json.loads(c.sh(engine, "image", "inspect", image).stdout)[0]
        assert info["Config"]["User"] == user
    size = int(c.sh(engine, "image", "inspect", "--format", "{{.Size}}", c.SERVE_IMAGE)
               .stdout.strip())
    assert size <= MAX_SERVE_MIB * 2**20, f"serving image {size / 2**20:.0f} MiB"
    # no torch and no pip in the serving image; the training image has torch
    probe = ("import importlib.util as u; print(u.find_spec('torch') is not None, "
             "u.find_spec('pip') is not None)")
    out = c.sh(engine, "run", "--rm", "--network", "none", "--entrypoint", "python",
               c.SERVE_IMAGE, "-c", probe).stdout.split()
    assert out == ["False", "False"]
    out = c.sh(engine, "run", "--rm", "--network", "none", "--entrypoint", "python",
               c.TRAIN_IMAGE, "-c", probe).stdout.split()
    assert out == ["True", "False"]


def test_gpu_image_on_a_cpu_host_serves_quietly_or_refuses_cuda(engine, service_packages,
                                                                tmp_path):
    """onnxruntime-gpu with NVIDIA's CUDA and cuDNN wheels, no driver: --device auto serves
    on the CPU with one info line and no onnxruntime error or warning; --device cuda exits 2
    with one line. `make images VARIANT=gpu` builds the image (4.7 GB of wheels: not part
    of make test)."""
    image = f"orthornn:{c.VERSION}-gpu"
    if c.sh(engine, "image", "inspect", image, check=False).returncode != 0:
        pytest.skip(f"no {image} here: `make images VARIANT=gpu` builds it")
    repo = make_repo(service_packages, tmp_path / "repo", {"adding": [1]})
    run = [engine, "run", "--rm", "--network", "host", "--read-only", "--user", "10001:10001",
           "--tmpfs", "/tmp", "--volume", f"{repo}:/models:ro", image, "serve", "--repo",
           "/models", "--host", "127.0.0.1", "--port", str(free_port())]
    refused = c.sh(*run, "--device", "cuda", check=False, timeout=60)
    assert refused.returncode == 2
    lines = [line for line in refused.stderr.splitlines() if "orthornn" in line]
    assert len(lines) == 1 and "CUDA cannot be used here" in lines[0], refused.stderr
    assert "Traceback" not in refused.stderr
    name = c.container_name("gpu-auto")
    port = int(run[-1])
    c.sh(engine, "run", "--detach", "--name", name, *run[3:])  # run[:3]: engine run --rm
    try:
        c.wait_status(f"http://127.0.0.1:{port}/v2/health/ready", 200, 60, name)
        logs = c.sh(engine, "logs", name).stderr
    finally:
        c.sh(engine, "rm", "--force", name, check=False)
    assert "serving /models with CPUExecutionProvider" in logs, logs
    assert ":onnxruntime:" not in logs, logs  # no [E:onnxruntime ...] nor [W:onnxruntime ...]


class Server:
    """The serving image run as the chart's Deployment runs it."""

    def __init__(self, engine: str, rendered: c.Rendered, repo: Path, scratch: Path,
                 port: int):
        self.engine, self.port = engine, port
        self.url = f"http://127.0.0.1:{port}"
        self.name = c.container_name("serve")
        self.deployment = rendered.one("Deployment", "server")
        self.flags = c.run_flags(self.deployment, rendered, {"models": repo}, scratch)

    def start(self) -> float:
        started = time.monotonic()
        c.sh(self.engine, "run", "--detach", "--name", self.name, *self.flags)
        c.wait_status(self.url + "/v2/health/ready", 200, 60, self.name)
        return time.monotonic() - started

    def logs(self) -> str:
        out = c.sh(self.engine, "logs", self.name, check=False)
        return out.stdout + out.stderr

    def remove(self) -> None:
        c.sh(self.engine, "rm", "--force", self.name, check=False)


@pytest.fixture(scope="module")
def served(engine, service_packages, tmp_path_factory):
    """The serving container on a repository with adding v1 and digits v1 (exported by
    the checkout), readable by UID 10001 and mounted read-only."""
    root = tmp_path_factory.mktemp("container")
    repo = make_repo(service_packages, root / "repo", {"adding": [1], "digits": [1]})
    port = free_port()
    rendered = rendered_training(root, port)
    server = Server(engine, rendered, repo, root / "scratch", port)
    try:
        server.ready_s = server.start()
        server.repo, server.rendered, server.root = repo, rendered, root
        yield server
    finally:
        server.remove()


def test_container_ready_as_uid_10001_on_a_read_only_root(served):
    # ready at all, not a timing (bench/load/images.py measures it: 0.7 s; the target is 5 s)
    assert served.ready_s < 60, f"start to ready {served.ready_s:.1f} s\n{served.logs()}"
    out = c.sh(served.engine, "exec", served.name, "sh", "-c",
               "id -u; id -g; touch /opt/x 2>&1; touch /models/x 2>&1; touch /tmp/x && "
               "echo tmp-writable", check=False).stdout.splitlines()
    assert out[:2] == ["10001", "10001"]
    assert "Read-only file system" in out[2] and "Read-only file system" in out[3]
    assert out[4] == "tmp-writable"
    logs = served.logs()
    assert "CPUExecutionProvider" in logs
    assert ":onnxruntime:" not in logs and "Traceback" not in logs


def test_chart_probes_and_image_healthcheck_pass(served):
    for kind, (path, port) in c.probes(served.deployment).items():
        # the kubelet's httpGet: any status from 200 to 399 passes
        answer = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=3)
        assert 200 <= answer.status_code < 400, (kind, path, answer.status_code)
    if served.engine == "podman":
        check = c.sh(served.engine, "healthcheck", "run", served.name, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
    else:  # docker runs it on its own schedule (every 30 s): its command, run here
        health = json.loads(c.sh(served.engine, "inspect", "--format",
                                 "{{json .Config.Healthcheck.Test}}", served.name).stdout)
        assert health[0] == "CMD"
        check = c.sh(served.engine, "exec", served.name, *health[1:], check=False)
        assert check.returncode == 0, check.stdout + check.stderr


def predict_body(count: int, length: int, width: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"model": "adding", "inputs": [
        rng.uniform(0, 1, (length - i % 3, width)).round(4).tolist() for i in range(count)]}


def test_predict_equals_the_checkout(served, service_packages, tmp_path):
    body = predict_body(5, 6, 2, seed=1)
    got = httpx.post(served.url + "/predict", json=body, timeout=10)
    assert got.status_code == 200, got.text
    repo = make_repo(service_packages, tmp_path / "repo", {"adding": [1]})
    with LiveServer(repo=repo) as checkout:
        want = httpx.post(checkout.url + "/predict", json=body, timeout=10).json()
    got_outputs, want_outputs = got.json()["outputs"], want["outputs"]
    assert len(got_outputs) == len(want_outputs) == 5
    for g, w in zip(got_outputs, want_outputs, strict=True):
        assert g.keys() == w.keys()
        np.testing.assert_allclose(np.asarray(g["value"], float),
                                   np.asarray(w["value"], float), atol=1e-6, rtol=0)
    assert got.json()["version"] == want["version"] == 1


def test_hot_swap_under_load_fails_no_request(served, service_packages):
    versions, failures, stop = [], [], threading.Event()

    def load(seed: int) -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                try:
                    r = client.post(served.url + "/predict", json=predict_body(2, 6, 2, seed))
                    if r.status_code != 200:
                        failures.append(r.status_code)
                    else:
                        versions.append(r.json()["version"])
                except httpx.HTTPError as error:
                    failures.append(repr(error))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        publish_copy(service_packages / "adding" / "2", served.repo / "adding", 2)
        deadline = time.monotonic() + 30
        while 2 not in versions[-20:] and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not failures, failures[:5]
    assert 1 in versions and versions[-1] == 2, versions[-5:]


def test_the_serving_pod_on_a_bucket_serves_it_and_follows_it(engine, seaweedfs,
                                                            service_packages, tmp_path,
                                                            monkeypatch):
    """The chart's Deployment with modelRepository.uri (a bucket of a SeaweedFS on
    loopback, its keys in an existingSecret) run by the engine: ready with the bucket's
    model mirrored into its cache volume, and a version published there swapped in."""
    for key, value in seaweedfs.env.items():
        monkeypatch.setenv(key, value)
    repo = f"{seaweedfs.location()}/repo"
    stage = make_repo(service_packages, tmp_path / "stage", {"adding": [1]})
    repository.promote(stage / "adding", 1, "publish", "first")
    objectstore.upload_model(stage / "adding", f"{repo}/adding")
    port = free_port()
    rendered = helm_template(f"containerPort={port}", f"modelRepository.uri={repo}",
                             f"modelRepository.endpoint={seaweedfs.endpoint}",
                             "modelRepository.existingSecret=s3-keys",
                             "config.pollIntervalSeconds=1")
    keys = {k: v for k, v in seaweedfs.env.items() if k.startswith("AWS_ACCESS_KEY_ID")
            or k.startswith("AWS_SECRET")}
    deployment = rendered.one("Deployment", "server")
    flags = c.run_flags(deployment, rendered, {}, tmp_path / "scratch",
                        secrets={"s3-keys": keys})
    name = c.container_name("bucket")
    url = f"http://127.0.0.1:{port}"
    c.sh(engine, "run", "--detach", "--name", name, *flags)
    try:
        c.wait_status(url + "/v2/health/ready", 200, 60, name)
        body = predict_body(2, 6, 2, seed=3)
        assert httpx.post(url + "/predict", json=body, timeout=10).json()["version"] == 1
        cache = tmp_path / "scratch" / "emptyDir" / "models"  # the chart's cache emptyDir
        assert (cache / "adding" / "1" / "manifest.json").is_file()
        remote.upload(open_store(f"{repo}/adding"), "2", service_packages / "adding" / "2",
                      last="manifest.json")
        repository.promote(f"{repo}/adding", 2, "promote", "second")
        deadline = time.monotonic() + 60
        while httpx.post(url + "/predict", json=body, timeout=10).json()["version"] != 2:
            assert time.monotonic() < deadline, c.sh(engine, "logs", name).stderr[-3000:]
            time.sleep(0.2)
        logs = c.sh(engine, "logs", name, check=False)
        assert "Traceback" not in logs.stdout + logs.stderr
    finally:
        c.sh(engine, "rm", "--force", name, check=False)


def test_training_image_runs_the_cronjob_and_the_server_swaps_it_in(served):
    cronjob = served.rendered.one("CronJob", "retraining")
    name = c.container_name("retrain")
    flags = c.run_flags(cronjob, served.rendered, {"models": served.repo},
                        served.root / "train-scratch")
    before = httpx.get(served.url + "/v2/models/digits", timeout=5).json()
    assert before["versions"] == ["1"], before
    try:
        job = c.sh(served.engine, "run", "--name", name, *flags, timeout=600, check=False)
    finally:
        c.sh(served.engine, "rm", "--force", name, check=False)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert (served.repo / "digits" / "2" / "manifest.json").is_file(), job.stderr[-3000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        meta = httpx.get(served.url + "/v2/models/digits", timeout=5).json()
        if "2" in meta["versions"]:
            break
        time.sleep(0.2)
    body = {"model": "digits", "inputs": [np.zeros((64, 1)).tolist()]}
    answer = httpx.post(served.url + "/predict", json=body, timeout=10)
    assert answer.status_code == 200 and answer.json()["version"] == 2, answer.text


def half_sent(port: int, body: bytes) -> socket.socket:
    """A /predict request whose head and first half of the body are sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:len(body) // 2])
    return sock


def finish(sock: socket.socket, body: bytes) -> int:
    """Send the rest of the body; the answer's status."""
    sock.sendall(body[len(body) // 2:])
    head = b""
    while b"\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            return 0
        head += chunk
    sock.close()
    return int(head.split(b" ", 2)[1])


def test_sigterm_drains_in_flight_requests_and_exits_0(served):
    """As in a cluster: on SIGTERM readiness turns 503 while requests are still served
    (the load balancer stops sending when it sees it), then the listener closes and what
    is in flight is answered: a request half-sent before SIGTERM and finished after the
    listener closed gets its 200, and the container exits 0."""
    answers, stop = [], threading.Event()

    def load(seed: int) -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                try:
                    answers.append(client.post(served.url + "/predict",
                                               json=predict_body(8, 6, 2, seed)).status_code)
                except httpx.HTTPError as error:
                    answers.append(repr(error))

    body = json.dumps(predict_body(3, 6, 2, seed=9)).encode()
    in_flight = half_sent(served.port, body)
    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    stopping = threading.Thread(target=lambda: served.stopped.append(
        c.sh(served.engine, "stop", "--time", "60", served.name, timeout=90)))
    served.stopped = []
    stopping.start()
    try:
        c.wait_status(served.url + "/v2/health/ready", 503, timeout=10)
    finally:
        stop.set()  # the load balancer has seen the 503: no new requests
        for t in threads:
            t.join()
    with pytest.raises(httpx.TransportError):  # the listener closes after the delay
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            httpx.get(served.url + "/v2/health/live", timeout=1)
            time.sleep(0.1)
    assert finish(in_flight, body) == 200
    stopping.join(timeout=90)
    code = c.sh(served.engine, "inspect", "--format", "{{.State.ExitCode}}", served.name)
    assert served.stopped[0].returncode == 0 and code.stdout.strip() == "0", \
        served.logs()[-3000:]
    assert answers and all(a == 200 for a in answers), [a for a in answers if a != 200][:5]
