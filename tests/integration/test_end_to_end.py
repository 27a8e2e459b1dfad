"""End to end, with the real commands as separate processes: the quickstart and every
README example with the answer it shows, and retraining hot-swapped into a running
service."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests import background
from tests.background import OTHER_NUMERICS
from tests.pace import Pace
from tests.readme_examples import check, examples
from tests.service_helpers import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]


def orthornn(*args, timeout=600, check=True):
    result = subprocess.run([sys.executable, "-m", "orthornn", *map(str, args)], cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def start(*args):
    return subprocess.Popen([sys.executable, "-m", "orthornn", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def docs_examples_answered(url: str, words_only: bool = False) -> list[str]:
    """What is wrong in the answers URL gives to the docs' examples (all of them, or the
    words model's), as the docs show them (tests/readme_examples.check)."""
    wrong = []
    port = url.rsplit(":", 1)[1]
    for example in examples():
        if words_only and '"model": "words"' not in example.command:
            continue
        command = example.command.replace("localhost:8000", f"127.0.0.1:{port}")
        command = command.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        result = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                                timeout=60)
        problem = check(example, result.stdout)
        if problem:
            wrong.append(f"{example.command[:100]}: {problem}")
    return wrong


#: float64 training (orthornn.quickstart): the word model trained under OTHER_NUMERICS
#: differs from the quickstart's by at most 2.2e-9 over the 12 settings of
#: bench/experiments/numerics.py; float32 trainings are 1e-2 apart after three steps
#: (tests/integration/test_precision.py): this bound is orders of magnitude from both
WEIGHTS_AGREE = 1e-5


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
@pytest.mark.timeout(1500)  # training both models: 2.5 min on 2 busy cores, 10 under heavy load
def test_quickstart_serves_every_readme_example(tmp_path):
    # the quickstart, trained in the background since the session started
    # (tests/background.py)
    job = background.quickstart()
    root = job.root
    built = job.wait(timeout=1100)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (root / "models" / "digits" / "1" / "manifest.json").is_file()
    assert (root / "models" / "words" / "1" / "step.onnx").is_file()
    # progress in the log: lines with step, rate and ETA (5 s apart), and the exports
    progress = re.findall(r"^train (scornn digits|svdrnn lm): step \d+/\d+ .*$",
                          built.stderr, flags=re.M)
    assert {"scornn digits", "svdrnn lm"} <= set(progress), built.stderr[-3000:]
    assert re.search(r"step/s, elapsed \S+, ETA ", built.stderr), built.stderr[-3000:]
    assert "export words: stage 4/4 (100%)" in built.stderr
    # --no-serve says what it did, not "once the server says it is ready"
    assert "once the server says it is ready" not in built.stderr
    assert f"digits: trained ({root / 'runs' / 'digits'}) and published " \
           f"{root / 'models' / 'digits' / '1'}" in built.stderr
    assert f"orthornn serve --repo {root / 'models'}" in built.stderr
    again = orthornn("quickstart", "--dir", root, "--no-serve", timeout=120)
    assert "using" in again.stderr and "training" not in again.stderr  # reused
    assert f"words: reused {root / 'models' / 'words' / '1'}" in again.stderr

    port = free_port()
    proc = start("quickstart", "--dir", root, "--port", port)  # execs orthornn serve
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        assert len(examples()) >= 6
        # every answer the docs show is what these models give
        wrong = docs_examples_answered(url)
        assert not wrong, "\n".join(wrong)
        digits = httpx.post(url + "/predict", json={"model": "digits",
                                                    "inputs": [[0.0] * 20 + [0.5] * 44]})
        assert digits.status_code == 200 and digits.json()["outputs"][0]["label"] in "0123456789"
        retrain_as_the_docs_show(root, url)
    finally:
        stop(proc)


@pytest.mark.slow  # another training of the quickstart's word model: 4 min of a core
@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
@pytest.mark.timeout(1500)
def test_the_word_models_docs_answers_hold_under_other_cpu_kernels(tmp_path):
    """The quickstart's word model trained again under OTHER_NUMERICS (ATen's scalar
    kernels, which no CI machine's default path runs): other bytes, weights within
    WEIGHTS_AGREE, and every word example of the docs answered as shown. ``make test``
    leaves it out (``--runslow``, ``make test-numerics``): by construction the docs hold
    without it (docs/training.md, "Across CPUs": float64 runs agree to 2e-7 in their
    answers, and every shown number is at least 1e-4 of its value inside its rounding
    interval; tests/integration/test_precision.py checks the first on every run), and
    every CI run checks the docs against a quickstart trained on its own machine."""
    job = background.quickstart()
    root = job.root
    other = background.other_numerics_job(tmp_path / "other-run")
    built = job.wait(timeout=1100)
    assert built.returncode == 0, built.stderr[-3000:]
    assert other.wait(timeout=1200) == 0, other.log.read_text()[-3000:]
    other_run = tmp_path / "other-run" / "words"
    # the other setting really ran other kernels (other bytes), whose differences float64
    # kept far below what the docs show, and the docs' answers hold for it too
    from safetensors.numpy import load_file

    ours, theirs = (load_file(run / "model.safetensors") for run in (root / "runs" / "words",
                                                                     other_run))
    assert any(ours[k].tobytes() != theirs[k].tobytes() for k in ours), \
        f"{OTHER_NUMERICS} trained the quickstart's bytes"
    apart = max(float(abs(ours[k] - theirs[k]).max()) for k in ours)
    assert apart < WEIGHTS_AGREE, f"{OTHER_NUMERICS}: weights {apart:.2e} apart"
    other_repo = tmp_path / "other" / "models"
    orthornn("export", other_run, "--repo", other_repo, "--name", "words")
    port = free_port()
    proc = start("serve", "--repo", other_repo, "--port", port)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}")
        wrong = docs_examples_answered(f"http://127.0.0.1:{port}", words_only=True)
        assert not wrong, f"trained under {OTHER_NUMERICS}:\n" + "\n".join(wrong)
    finally:
        stop(proc)


def retrain_as_the_docs_show(root: Path, url: str) -> None:
    """docs/retraining.md's recipe, its commands as written (in ROOT's .quickstart ->
    root): continue the digits run, export it, and the running service swaps it in."""
    text = (ROOT / "docs" / "retraining.md").read_text()
    recipe = re.search(r"```sh\n(.*?)```", text, flags=re.S).group(1)
    commands = [line for line in recipe.splitlines() if line.startswith("orthornn ")]
    assert [c.split()[1] for c in commands] == ["train", "export"]
    for command in commands:
        args = command.replace(".quickstart", str(root)).split()[1:]
        result = orthornn(*args)
        if args[0] == "export":
            assert result.stdout.strip() == str(root / "models" / "digits" / "2")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the service scans the repository every 2 s
        answer = httpx.post(url + "/predict", json={"model": "digits",
                                                    "inputs": [[0.0] * 20 + [0.5] * 44]})
        assert answer.status_code == 200, answer.text
        if answer.json()["version"] == 2:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the retrained version 2 was never served")
    assert httpx.get(url + "/v2/models/digits").json()["versions"][-1] == "2"
    # exporting the same run again publishes nothing, and says which version holds it
    again = orthornn("export", root / "runs" / "digits", "--repo", root / "models",
                     "--name", "digits")
    assert again.stdout.strip() == str(root / "models" / "digits" / "2")
    assert "already holds this checkpoint" in again.stderr


def test_retrained_versions_swap_in_without_a_failed_request(tmp_path):
    runs, repo = tmp_path / "runs", tmp_path / "repo"
    common = ["--arch", "svdrnn", "--task", "adding", "--seq-len", "6", "--hidden", "8",
              "--steps", "10", "--batch-size", "8", "--log-every", "5", "--no-progress"]
    orthornn("train", *common, "--out", runs / "v1")
    first = orthornn("export", runs / "v1", "--repo", repo, "--name", "adder").stdout.strip()
    assert first == str(repo / "adder" / "1")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start("serve", "--repo", repo, "--port", port, "--poll-interval-s", "0.2",
                 "--log-level", "warning")
    seen, failures, done = [], [], threading.Event()

    def client():
        body = {"model": "adder", "inputs": [[[0.5, 1], [0.2, 0], [0.3, 1]]]}
        pace = Pace()  # paced: the retraining beside it gets the cores
        with httpx.Client(timeout=30) as http:
            while not done.is_set():
                pace.wait()
                try:
                    r = http.post(url + "/predict", json=body)
                    (seen if r.status_code == 200 else failures).append(
                        r.json().get("version") if r.status_code == 200 else r.text)
                except httpx.HTTPError as error:
                    failures.append(repr(error))

    sessions: list[list[int]] = []  # per session, the version of each of its answers

    def session_client():  # sessions open across the swap stay on their version
        chunk = [[0.5, 1], [0.2, 0]]
        with httpx.Client(timeout=30) as http:
            k = 0
            while not done.is_set():
                k += 1
                versions = []
                for i in range(4):
                    body = {"model": "adder", "inputs": [chunk], "session": f"s{k}",
                            "start": i == 0, "end": i == 3,
                            "session_secret": "e2e-client-secret-0123456789"}
                    try:
                        r = http.post(url + "/predict", json=body)
                    except httpx.HTTPError as error:
                        failures.append(repr(error))
                        break
                    if r.status_code != 200:
                        failures.append(r.text)
                        break
                    versions.append(r.json()["version"])
                    time.sleep(0.02)
                sessions.append(versions)

    try:
        wait_ready(proc, url)
        thread = threading.Thread(target=client)
        thread.start()
        session_thread = threading.Thread(target=session_client)
        session_thread.start()
        orthornn("train", *common, "--seed", "1", "--out", runs / "v2")  # retraining
        second = orthornn("export", runs / "v2", "--repo", repo, "--name", "adder").stdout
        assert second.strip() == str(repo / "adder" / "2")
        deadline = time.time() + 60
        while 2 not in seen[-5:] and time.time() < deadline:
            time.sleep(0.1)
        assert 2 in seen, "the service never switched to version 2"

        # a broken version 3 (model.onnx altered after its hash was taken) is refused
        tmp = repo / "adder" / f".tmp-{uuid.uuid4().hex[:6]}"
        shutil.copytree(repo / "adder" / "2", tmp)
        manifest = json.loads((tmp / "manifest.json").read_text())
        manifest["version"] = 3
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        data = bytearray((tmp / "model.onnx").read_bytes())
        data[-3] ^= 0xFF
        (tmp / "model.onnx").write_bytes(bytes(data))
        os.rename(tmp, repo / "adder" / "3")
        # ... and promoted, as an export would (an unpromoted version 3 is not tried at all)
        from orthornn.export.artifacts.repository import promote

        promote(repo / "adder", 3, "publish", "a damaged package")
        deadline = time.time() + 60
        failed = 0.0
        while time.time() < deadline:
            metrics = httpx.get(url + "/metrics").text
            match = re.search(r'^orthornn_model_load_failures_total\{model="adder"\} (\S+)$',
                              metrics, flags=re.M)
            failed = float(match.group(1)) if match else 0.0
            if failed >= 1:
                break
            time.sleep(0.2)
        assert failed >= 1, "the broken version was not counted as a load failure"
        time.sleep(0.5)
        count = len(seen)
        deadline = time.time() + 30
        while len(seen) < count + 5 and time.time() < deadline:
            time.sleep(0.05)
        assert set(seen[count:]) == {2}  # version 2 keeps serving
    finally:
        done.set()
        thread.join(timeout=30)
        session_thread.join(timeout=30)  # its last session ends before the server stops
        stop(proc)
    assert failures == []
    assert sessions and all(len(set(v)) == 1 for v in sessions if v)  # never switched
    assert {v[0] for v in sessions if v} == {1, 2}  # sessions on both sides of the swap
    assert seen and set(seen) <= {1, 2} and seen[0] == 1
    assert seen.index(2) == len(seen) - seen[::-1].index(1)  # 1 ... 1 2 ... 2: one switch
