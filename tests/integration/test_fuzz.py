"""The fuzz targets of tests/fuzz/fuzz.py, briefly (make fuzz runs them for minutes): each
replays its committed corpus, the defects found included, then mutates for a bounded
number of runs; any crash or 5xx fails. And the defects found, replayed against the app."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FUZZ = ROOT / "tests" / "fuzz"
RUNS = {"predict_json": 3000, "oip_json": 3000, "oip_binary": 3000, "sessions": 40,
        "oip_fields": 2000, "trailers": 300}

pytest.importorskip("atheris")


@pytest.mark.parametrize("target", sorted(RUNS))
def test_fuzz_target_smoke(target, tmp_path):
    result = subprocess.run([sys.executable, str(FUZZ / "fuzz.py"), target,
                             f"-runs={RUNS[target]}", f"-artifact_prefix={tmp_path}/",
                             str(tmp_path), str(FUZZ / "corpus" / target)],
                            capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    done = re.search(r"Done (\d+) runs", result.stderr)
    assert done and int(done.group(1)) >= RUNS[target], result.stderr[-2000:]
    assert not list(tmp_path.glob("crash-*"))


@pytest.fixture(scope="module")
def client(service_packages, tmp_path_factory):
    """The app on a repository of the adding model, for replaying what the fuzzers found."""
    from fastapi.testclient import TestClient
    from orthornn.service.http.app import create_app
    from orthornn.service.settings import Settings

    from ..service_helpers import make_repo

    repo = make_repo(service_packages, tmp_path_factory.mktemp("fuzz-found"), {"adding": [1]})
    with TestClient(create_app(Settings(repo=repo))) as c:
        yield c


def test_a_non_ascii_digit_header_length_is_a_400(client):
    """Found by the oip_binary target: Inference-Header-Content-Length '²' (byte 0xb2)
    passed str.isdigit() and int() raised: a 500."""
    for value in (b"\xb2", b"9" * 5000, b"-1", b""):
        answer = client.post("/v2/models/adding/infer", content=b"{}",
                             headers={"Inference-Header-Content-Length": value})
        assert answer.status_code == 400, (value, answer.text)
        assert "Inference-Header-Content-Length" in answer.json()["error"]


def test_a_datatype_that_is_not_a_string_is_a_400(client):
    """Found by the oip_json and oip_binary targets: "datatype": [2, 0] beside "data" made
    the fast path look a list up in a dict (TypeError: a 500)."""
    for datatype in ([2, 0], {"a": 1}, 3, None):
        body = {"inputs": [{"name": "x", "shape": [1, 1, 2], "datatype": datatype,
                            "data": [0.5, 1.0]}]}
        answer = client.post("/v2/models/adding/infer", json=body)
        assert answer.status_code == 400, (datatype, answer.text)
        assert "datatype" in answer.json()["error"], answer.text
