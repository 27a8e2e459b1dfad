"""The server's scheduling (service.server.launch.batch_scheduling), in a process of its
own: the threads there when it is called and every thread started after (the inference
threads) run as SCHED_BATCH; a served process's every thread is SCHED_BATCH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from ...service_helpers import make_repo, wait_ready

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling")

PROBE = """
import json, os, threading
from orthornn.service.server.launch import batch_scheduling
policy = lambda: os.sched_getscheduler(0)
seen = {"main_before": policy()}
def calls_it():
    batch_scheduling()
    seen["caller"] = policy()
    child = threading.Thread(target=lambda: seen.setdefault("started_after", policy()))
    child.start(); child.join()
t = threading.Thread(target=calls_it); t.start(); t.join()
seen["main_after"] = policy()
print(json.dumps({**seen, "batch": os.SCHED_BATCH, "other": os.SCHED_OTHER}))
"""


def test_the_caller_and_the_threads_it_starts_run_as_batch_work():
    out = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True,
                                    text=True, check=True).stdout)
    assert out["caller"] == out["started_after"] == out["batch"]
    assert out["main_before"] == out["other"]  # Linux's default before
    assert out["main_after"] == out["batch"]  # a thread that was there already


def test_a_served_process_runs_every_thread_as_batch_work(service_packages, tmp_path):
    repo = make_repo(service_packages, tmp_path / "repo", {"digits": [1]})
    port_file = tmp_path / "address"
    proc = subprocess.Popen([sys.executable, "-m", "orthornn", "serve", "--repo", str(repo),
                             "--port", "0", "--address-file", str(port_file),
                             "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, "no address"
            time.sleep(0.05)
        url = port_file.read_text().strip()
        wait_ready(proc, url)
        assert httpx.post(url + "/predict", json={"model": "digits", "inputs": [[0.1]]},
                          timeout=30).status_code == 200  # the inference thread started
        tasks = os.listdir(f"/proc/{proc.pid}/task")
        assert len(tasks) >= 2
        assert {os.sched_getscheduler(int(t)) for t in tasks} == {os.SCHED_BATCH}
    finally:
        proc.terminate()
        proc.wait(30)
