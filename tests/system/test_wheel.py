"""What users install is what CI runs (docs/design.md, Public contracts). The rest of the suite runs
from the editable checkout, which cannot see a packaging bug (a module left out of the
wheel, a dependency missing from an extra); here the wheel built from this checkout
(the `wheel` fixture, tests/artifacts.py):

- holds exactly the modules of the stage folders, under their installed names;
- installed with only the serve extra into a fresh virtual environment (no torch there),
  serves what the checkout exports, with the checkout's answers;
- installed with the train extra (torch==2.13.0 first, as the Makefile does), trains and
  exports a model whose package onnxruntime reproduces.

The two environments are installed at once, in the background, while the checkout
trains the models to serve.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import time
import zipfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from orthornn.export.artifacts.package import read_manifest, session, verify_package
from orthornn.service.http.app import create_app
from orthornn.service.settings import Settings

from ..artifacts import (
    TORCH_VERSION,
    Unavailable,
    clean_env,
    make_venv,
    skip_or_fail,
    source_files,
)
from ..service_helpers import free_port, make_repo

# installed package -> its folder in the repository (setup.py, docs/design.md)
STAGES = {"orthornn": "orthornn", "orthornn.models": "models",
          "orthornn.training": "training", "orthornn.export": "export",
          "orthornn.service": "service"}
# the packages of the train extra and torch's own: none is in the serving install
TRAIN_ONLY = ["torch", "safetensors", "tqdm", "yaml", "matplotlib", "sklearn", "sktime",
              "mnist1d", "gensim", "triton"]


def wheel_modules(wheel: Path) -> set[str]:
    """The wheel's Python files, e.g. `orthornn/service/http/codecs/predict_json.py`."""
    with zipfile.ZipFile(wheel) as zf:
        return {name for name in zf.namelist() if name.endswith(".py")}


def source_modules() -> set[str]:
    """Every `.py` of the stage folders in a clone, under its installed path."""
    found = set()
    for path in source_files():
        if path.suffix != ".py":
            continue
        for package, folder in STAGES.items():
            if path.parts[0] == folder:
                found.add("/".join((*package.split("."), *path.parts[1:])))
    return found


def test_wheel_holds_every_module_of_the_stage_folders(wheel):
    in_wheel, in_source = wheel_modules(wheel), source_modules()
    assert "orthornn/service/http/codecs/predict_json.py" in in_source  # the mapping is right
    missing, extra = sorted(in_source - in_wheel), sorted(in_wheel - in_source)
    assert not missing and not extra, (f"{wheel.name}: missing from the wheel: {missing}; "
                                       f"in the wheel but not in the checkout: {extra}")
    with zipfile.ZipFile(wheel) as zf:
        dist_info = {n.split("/", 1)[0] for n in zf.namelist() if ".dist-info/" in n}
        entry_points = zf.read(f"{dist_info.pop()}/entry_points.txt").decode()
    assert "orthornn = orthornn.cli:main" in entry_points


# -- fresh virtual environments with the wheel -------------------------------------------

# each environment: its extra, and whether torch==2.13.0 is installed first
VENVS = {"serve": dict(extras="serve"), "train": dict(extras="train", torch=True)}


class Venvs:
    """The serve and train environments, installed at once in the background from the
    fixture's start; `get(name)` waits for one (skips when pip has no index)."""

    def __init__(self, root: Path, wheel: Path):
        self.root = root
        self.pool = ThreadPoolExecutor(len(VENVS), thread_name_prefix="venv")
        self.futures = {name: self.pool.submit(make_venv, root / name, wheel, **options)
                        for name, options in VENVS.items()}

    def get(self, name: str) -> Path:
        try:
            seconds = self.futures[name].result()
        except Unavailable as error:
            skip_or_fail(str(error))
        print(f"{name} venv installed in {seconds:.1f} s")  # shown with -s / -rP
        return self.root / name

    def close(self) -> None:
        """Wait for the installs; remove the environments (about 2 GB, 10 s of disk
        writes) in a process of their own that the next tests do not wait for."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        subprocess.Popen(["rm", "-rf", "--", str(self.root)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)


@pytest.fixture(scope="module")
def venvs(wheel, tmp_path_factory):
    envs = Venvs(tmp_path_factory.mktemp("venvs"), wheel)
    yield envs
    envs.close()


def venv_env() -> dict[str, str]:
    """The environment of a program of a fresh venv: pointing at neither the checkout nor
    this test's venv; bytecode is written (the venv has none, make_venv's --no-compile),
    so the modules the first program imports load faster in the next."""
    env = clean_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run_in(venv: Path, program: str, *args, cwd: Path, timeout: float = 300
           ) -> subprocess.CompletedProcess:
    """VENV/bin/PROGRAM ARGS from CWD (away from the checkout), in venv_env()."""
    return subprocess.run([str(venv / "bin" / program), *map(str, args)], cwd=cwd,
                          env=venv_env(), capture_output=True, text=True, timeout=timeout)


IMPORT_ALL = """
import fnmatch, importlib, json, sys, traceback, zipfile
wheel, include, exclude = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
failed, imported = {}, []
for name in sorted(zipfile.ZipFile(wheel).namelist()):
    if not name.endswith('.py') or name.endswith('__main__.py'):
        continue
    module = name[:-3].replace('/', '.').removesuffix('.__init__')
    match = lambda patterns: any(fnmatch.fnmatchcase(module, p) for p in patterns)
    if not match(include) or match(exclude):
        continue
    imported.append(module)
    try:
        importlib.import_module(module)
    except BaseException:
        failed[module] = traceback.format_exc(limit=-2)
import orthornn
torch = getattr(sys.modules.get('torch'), '__version__', None)
print(json.dumps({"failed": failed, "imported": imported, "orthornn": orthornn.__file__,
                  "torch": torch}))
"""


def import_all(venv: Path, wheel: Path, tmp: Path, include: Sequence[str],
               exclude: Sequence[str] = ()) -> dict:
    """Import in VENV every module of WHEEL that matches an INCLUDE pattern and no
    EXCLUDE one (fnmatch); {"imported": modules, "torch": its version if loaded}.
    orthornn must come from the venv."""
    result = run_in(venv, "python", "-c", IMPORT_ALL, wheel, json.dumps(list(include)),
                    json.dumps(list(exclude)), cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert not found["failed"], "modules of the wheel that do not import:\n" + "\n".join(
        f"{name}: {error}" for name, error in found["failed"].items())
    assert Path(found["orthornn"]).is_relative_to(venv), found["orthornn"]
    return found


# -- serving from the wheel: the serve extra only --------------------------------------------

def assert_same(got, expected, where="answer"):
    """Equal JSON, numbers within 1e-6."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), (where, got, expected)
        for key in expected:
            assert_same(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), (where, got, expected)
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_same(g, e, f"{where}[{i}]")
    elif isinstance(expected, float) and not isinstance(got, str):
        assert math.isclose(got, expected, rel_tol=0, abs_tol=1e-6), (where, got, expected)
    else:
        assert got == expected, (where, got, expected)


def requests_to_send() -> list[tuple[str, dict]]:
    """A few sequences for each kind of model: classify (digits), regress (adding, two
    features) and a language model (words, text), and one Open Inference Protocol call."""
    rng = np.random.default_rng(7)
    digits = [rng.uniform(0, 1, size=n).round(4).tolist() for n in (64, 10, 1)]
    adding = [np.c_[rng.uniform(size=n), rng.integers(0, 2, size=n)].round(4).tolist()
              for n in (6, 3)]
    x = rng.uniform(0, 1, size=(2, 64)).astype(np.float32)
    return [
        ("/predict", {"model": "digits", "inputs": digits, "top_k": 3}),
        ("/predict", {"model": "adding", "inputs": adding}),
        ("/predict", {"model": "words", "text": ["the cat sat on the", "the dog"],
                      "top_k": 3}),
        ("/v2/models/digits/infer", {"inputs": [
            {"name": "x", "shape": [2, 64, 1], "datatype": "FP32",
             "data": x.ravel().tolist()}]}),
    ]


def checkout_answers(repo: Path, requests: list[tuple[str, dict]]) -> list[dict]:
    """The same requests through the checkout's service, in this process."""
    app = create_app(Settings(repo=repo, poll_interval_s=0))
    answers = []
    with TestClient(app) as client:
        app.state.registry.scanned.wait(60)
        assert app.state.registry.ready()
        for path, body in requests:
            r = client.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            answers.append(r.json())
    return answers


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    """Send SIG to the process by its PID, wait; SIGKILL if it has not ended in time."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)
    return proc.returncode


@pytest.mark.timeout(900)
def test_serve_from_the_wheel_in_a_clean_venv(venvs, wheel, service_packages, tmp_path):
    """`orthornn serve` of a venv with only WHEEL[serve]: no torch (nor anything of the
    train extra) is importable, orthornn is the installed one, every module of the
    service imports, and the answers equal the checkout's."""
    venv = venvs.get("serve")
    probe = run_in(venv, "python", "-c",
                   "import importlib.util, json; print(json.dumps([m for m in "
                   f"{TRAIN_ONLY!r} if importlib.util.find_spec(m)]))", cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout) == [], "the serving install carries train packages"
    assert not list(venv.glob("lib/python*/site-packages/__editable__*"))
    # the command package, the service and the torch-free modules of export/ it reads
    # (tests/unit/test_layout.py) import; the rest needs torch
    found = import_all(venv, wheel, tmp_path, include=[
        "orthornn", "orthornn.cli", "orthornn.service", "orthornn.service.*",
        "orthornn.export.artifacts.package", "orthornn.export.artifacts.repository",
        "orthornn.export.artifacts.vocabulary"])
    assert "orthornn.service.http.codecs.predict_json" in found["imported"]

    repo = make_repo(service_packages, tmp_path / "repo",
                     {"adding": [1], "digits": [1], "words": [1]})
    requests = requests_to_send()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(venv / "bin" / "orthornn"), "serve", "--repo", str(repo), "--host",
             "127.0.0.1", "--port", str(port), "--log-level", "warning"],
            cwd=tmp_path, env=venv_env(), stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"orthornn serve from the wheel not ready (exit {proc.poll()}):\n"
                + log.read_text()[-3000:])
            time.sleep(0.1)
        answers = []
        with httpx.Client(base_url=url, timeout=30) as http:
            for path, body in requests:
                r = http.post(path, json=body)
                assert r.status_code == 200, (path, r.text)
                answers.append(r.json())
        assert stop(proc) == 0, log.read_text()[-3000:]  # SIGTERM: drains, exits 0
    finally:
        stop(proc, signal.SIGKILL, timeout=10)
    for got, expected in zip(answers, checkout_answers(repo, requests), strict=True):
        assert_same(got, expected)


# -- training and exporting from the wheel: the train extra ---------------------------------

@pytest.mark.timeout(900)
def test_train_and_export_from_the_wheel_in_a_clean_venv(venvs, wheel, tmp_path):
    """`orthornn train` (the digits task, a few steps) and `orthornn export` of a venv with
    torch==2.13.0 and WHEEL[train]: the version directory is complete, its files match the
    manifest's hashes, and onnxruntime reproduces its golden outputs."""
    venv = venvs.get("train")
    # every module imports but the service's (the serve extra is not installed) and the
    # Triton kernels' (the gpu extra; models.ops loads them at a kernel's first launch)
    found = import_all(venv, wheel, tmp_path, include=["orthornn*"], exclude=[
        "orthornn.service", "orthornn.service.*", "orthornn.models.ops.triton_*"])
    assert "orthornn.training.trainer" in found["imported"]
    # the torch installed first, as the Makefile does: the train extra kept it
    assert found["torch"].split("+")[0] == TORCH_VERSION, found["torch"]

    run, repo = tmp_path / "run", tmp_path / "repo"
    trained = run_in(venv, "orthornn", "train", "--arch", "scornn", "--task", "digits",
                     "--hidden", 8, "--steps", 4, "--batch-size", 8, "--no-progress",
                     "--out", run, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    exported = run_in(venv, "orthornn", "export", run, "--repo", repo, "--name", "digits",
                      cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]

    package = repo / "digits" / "1"
    manifest = read_manifest(package)
    assert (manifest.name, manifest.version, manifest.arch, manifest.task) == \
        ("digits", 1, "scornn", "classify")
    names = {p.name for p in package.iterdir()}
    assert {"manifest.json", "model.onnx", "golden.npz"} <= names
    assert names == {"manifest.json", "golden.npz", *manifest.files}, names
    # one version, published by its rename: no build directory left beside it
    assert sorted(p.name for p in (repo / "digits").iterdir() if p.is_dir()) == ["1"]
    # scikit-learn's digits were read in that venv: the test split was scored
    assert manifest.evaluation["metric"] == "accuracy", manifest.evaluation
    assert manifest.evaluation["examples"] > 0
    verify_package(package)  # hashes, and every graph's golden cases
    # and directly: the model graph on its golden inputs
    with np.load(package / "golden.npz") as f:
        golden = {k: f[k] for k in f.files}
    sess = session(package / "model.onnx")
    feeds = {i.name: golden[f"model/{i.name}"] for i in sess.get_inputs()}
    outputs = [o.name for o in sess.get_outputs()]
    for name, got in zip(outputs, sess.run(outputs, feeds), strict=True):
        np.testing.assert_allclose(got, golden[f"model/{name}"], rtol=1e-4, atol=1e-5)
