"""Execution providers of the service (service/registry/devices.py): the CUDA provider is asked
for only where it can load (onnxruntime lists every provider compiled in), the CPU path
is quiet, and --device auto|cpu|cuda with its settings, errors and exit codes."""

import logging
import os
import subprocess
import sys

import onnxruntime as ort
import pytest
from fastapi.testclient import TestClient
from orthornn.export.artifacts.package import session_from_bytes
from orthornn.service.http.app import create_app
from orthornn.service.registry import devices
from orthornn.service.registry.devices import CPU, CUDA, cuda_unavailable, select_providers
from orthornn.service.settings import Settings
from pydantic import ValidationError

from orthornn.cli import main

from ...service_helpers import make_repo

ORT_HAS_CUDA = CUDA in ort.get_available_providers()


@pytest.fixture(autouse=True)
def _fresh_check():
    """cuda_unavailable answers once per process; each test checks afresh."""
    cuda_unavailable.cache_clear()
    yield
    cuda_unavailable.cache_clear()


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("providers-repo"),
                     {"digits": [1]})


@pytest.fixture
def cuda_listed_not_loadable(monkeypatch, tmp_path):
    """onnxruntime-gpu on a machine without CUDA: the CUDA provider is listed, and its
    library is there but cannot be loaded."""
    library = tmp_path / "libonnxruntime_providers_cuda.so"
    library.write_bytes(b"not a shared library")
    monkeypatch.setattr(devices, "available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(devices, "cuda_provider_library", lambda: library)
    return library


@pytest.mark.skipif(ORT_HAS_CUDA, reason="onnxruntime-gpu is installed")
def test_auto_selects_the_cpu_with_the_cpu_onnxruntime():
    choice = select_providers()
    assert choice.providers == [CPU]
    assert f"has no {CUDA}" in choice.why and choice.why.startswith("device auto")


def test_listed_cuda_whose_library_is_missing_is_not_asked_for(monkeypatch, tmp_path):
    monkeypatch.setattr(devices, "available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(devices, "cuda_provider_library", lambda: tmp_path / "nope.so")
    choice = select_providers(None, "auto")
    assert choice.providers == [CPU]
    assert "nope.so" in choice.why and "is missing" in choice.why


def test_listed_cuda_that_cannot_load_serves_on_the_cpu_quietly(
        cuda_listed_not_loadable, repo, caplog, capfd, recwarn):
    """The regression: onnxruntime-gpu without CUDA. The service logs one INFO line naming
    the provider and why, and neither it nor onnxruntime warns or errs while a model
    loads (asked for CUDA, onnxruntime would warn and print errors, then use the CPU)."""
    caplog.set_level(logging.INFO)
    capfd.readouterr()
    app = create_app(Settings(repo=repo, poll_interval_s=0))
    with TestClient(app) as client:
        app.state.registry.scanned.wait(60)
        assert app.state.registry.ready()
        x = [[0.5]] * 8
        assert client.post("/predict", json={"model": "digits", "inputs": [x]}).status_code \
            == 200
        runtime = app.state.registry.get("digits").runtime
        assert runtime.inference_sessions["model"].get_providers() == [CPU]
    assert not [str(w.message) for w in recwarn.list]
    err = capfd.readouterr().err
    assert "onnxruntime" not in err.lower() and "[E:" not in err and "[W:" not in err, err
    loud = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records
            if r.levelno >= logging.WARNING]
    assert not loud, loud
    named = [r.getMessage() for r in caplog.records
             if r.levelno == logging.INFO and CPU in r.getMessage()]
    assert len(named) == 1, named
    assert "device auto, no CUDA here: cannot load libonnxruntime_providers_cuda.so" \
        in named[0]


def test_device_cuda_without_cuda_raises_saying_why(cuda_listed_not_loadable):
    with pytest.raises(ValueError, match=r"device cuda, but CUDA cannot be used here: "
                                         r"cannot load libonnxruntime_providers_cuda\.so"):
        select_providers(None, "cuda")


def test_device_cpu_never_looks_for_cuda(monkeypatch):
    def looked():
        raise AssertionError("device cpu looked for CUDA")

    monkeypatch.setattr(devices, "available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(devices, "cuda_unavailable", looked)
    assert select_providers(None, "cpu").providers == [CPU]
    assert select_providers([CPU], "cpu").providers == [CPU]


def test_explicit_providers_are_used_as_given(monkeypatch):
    """As before --device: a providers list is used as given under device auto (no
    check whether CUDA loads), and each must be available."""
    monkeypatch.setattr(devices, "available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(devices, "cuda_unavailable", lambda: "no CUDA in this test")
    choice = select_providers([CUDA, CPU], "auto")
    assert choice.providers == [CUDA, CPU] and choice.why == "providers as set"
    with pytest.raises(ValueError, match="device cuda, but CUDA cannot be used here: no CUDA "
                                         "in this test"):
        select_providers([CUDA, CPU], "cuda")
    with pytest.raises(ValueError, match="not available in this onnxruntime"):
        select_providers(["TensorrtExecutionProvider", CPU], "auto")


def test_no_cuda_runtime_is_a_reason(monkeypatch):
    monkeypatch.setattr(devices, "_cuda_major", lambda: ["99"])
    reason = devices._no_device()
    assert reason is not None and "cannot load the CUDA runtime" in reason \
        and "cudart" in reason


def test_device_setting_values_and_contradictions(monkeypatch, tmp_path):
    assert Settings(repo=tmp_path).device == "auto"
    monkeypatch.setenv("ORTHORNN_DEVICE", "cpu")
    assert Settings(repo=tmp_path).device == "cpu"
    monkeypatch.setenv("ORTHORNN_DEVICE", "gpu")
    with pytest.raises(ValidationError) as bad:
        Settings(repo=tmp_path)
    assert bad.value.errors()[0]["loc"] == ("device",)
    assert "'auto', 'cpu' or 'cuda'" in str(bad.value)
    monkeypatch.delenv("ORTHORNN_DEVICE")
    with pytest.raises(ValidationError, match="device cpu contradicts providers"):
        Settings(repo=tmp_path, device="cpu", providers=[CUDA, CPU])
    with pytest.raises(ValidationError, match=f"device cuda contradicts providers.*{CUDA}"):
        Settings(repo=tmp_path, device="cuda", providers="TensorrtExecutionProvider,"
                                                         "CPUExecutionProvider")
    assert Settings(repo=tmp_path, device="cpu", providers=[CPU]).providers == [CPU]
    assert Settings(repo=tmp_path, device="cuda", providers=[CUDA, CPU]).device == "cuda"


def test_serve_device_flag_errors_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--repo", str(tmp_path), "--device", "gpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "argument --device: invalid choice: 'gpu'" in err
    assert all(device in err.split("choose from")[1] for device in ("auto", "cpu", "cuda"))
    assert main(["serve", "--repo", str(tmp_path), "--device", "cpu",
                 "--providers", f"{CUDA},{CPU}"]) == 2
    assert "orthornn serve: error: device: " in capsys.readouterr().err


def test_serve_device_cuda_without_cuda_exits_2_with_one_line(tmp_path):
    """A GPU pod never serves on the CPU silently: --device cuda where CUDA cannot be
    had ends at once, one line on stderr naming the reason, no traceback."""
    if cuda_unavailable() is None:
        pytest.skip("CUDA can be used here")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTHORNN_")}
    result = subprocess.run([sys.executable, "-m", "orthornn", "serve", "--device", "cuda",
                             "--repo", str(tmp_path), "--port", "0"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("orthornn serve: error: device cuda, but CUDA cannot be used "
                               "here: ")
    assert "Traceback" not in result.stderr


@pytest.mark.gpu
def test_auto_runs_models_on_cuda_where_it_loads(repo):
    if not ORT_HAS_CUDA:
        pytest.skip("onnxruntime without its CUDA provider (onnxruntime-gpu not installed)")
    choice = select_providers()
    assert choice.providers == [CUDA, CPU], choice.why
    session = session_from_bytes(str(repo / "digits" / "1" / "model.onnx"), choice.providers)
    assert session.get_providers()[0] == CUDA
