"""The session chunk logic, fuzzed through the app (in process): each input is a short
script of /predict chunks over a few session ids (start, continue, end, positions, the
owner's secret, another's, none) against a small streaming model; no answer may be a 5xx.
Used by fuzz.py's ``sessions`` target."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parents[2]
IDS = ("sensor-17", "1", "s" * 128)
SECRETS = ("owner-secret-0123456789abcdef", "other-secret-0123456789abcdef")


def build_repo() -> Path:
    """A repository with a small regression model (svdRNN on adding: 2 features), trained
    and exported by the commands, out of this process (no torch here)."""
    root = Path(tempfile.mkdtemp(prefix="fuzz-sessions-"))
    orthornn = [sys.executable, "-m", "orthornn"]
    subprocess.run([*orthornn, "train", "--arch", "svdrnn", "--task", "adding", "--seq-len", "6",
                    "--hidden", "8", "--steps", "2", "--batch-size", "8", "--no-progress",
                    "--out", str(root / "run")], check=True, cwd=ROOT, capture_output=True)
    subprocess.run([*orthornn, "export", str(root / "run"), "--repo", str(root / "repo"),
                    "--name", "adding"], check=True, cwd=ROOT, capture_output=True)
    return root / "repo"


def setup():
    """The target: a function of the fuzzer's bytes, with the app started once."""
    from fastapi.testclient import TestClient
    from orthornn.service.http.app import create_app
    from orthornn.service.settings import Settings

    client = TestClient(create_app(Settings(repo=build_repo())), raise_server_exceptions=False)
    client.__enter__()  # the lifespan: the model loads once, for every input

    def target(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        for _ in range(fdp.ConsumeIntInRange(1, 6)):
            body: dict = {"model": "adding", "session": fdp.PickValueInList(list(IDS))}
            for flag in ("start", "end", "return_state", "per_step"):
                if fdp.ConsumeBool():
                    body[flag] = fdp.ConsumeBool()
            if fdp.ConsumeBool():
                body["position"] = fdp.ConsumeIntInRange(-2, 12)
            steps = fdp.ConsumeIntInRange(0, 4)
            body["inputs"] = [[[fdp.ConsumeFloatInRange(-2, 2), fdp.ConsumeIntInRange(0, 1)]
                               for _ in range(steps)]]
            headers = {}
            secret = fdp.ConsumeIntInRange(0, 3)
            if secret < 2:
                headers["Orthornn-Session-Secret"] = SECRETS[secret]
            elif secret == 2:
                body["session_secret"] = fdp.ConsumeUnicodeNoSurrogates(40)
            answer = client.post("/predict", json=body, headers=headers)
            if answer.status_code >= 500:
                raise AssertionError(f"{answer.status_code} for {body} {headers}: {answer.text}")

    return target
