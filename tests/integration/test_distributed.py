"""Data-parallel training with real processes (gloo, 2 ranks on this machine): the ranks
reach the one-process weights, every rank keeps its constraint, a killed worker ends the
run or is restarted from the last checkpoint, and bad launcher input is one line, exit 2.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from orthornn.models import build_model
from orthornn.training import checkpoint
from orthornn.training.config import TrainConfig
from orthornn.training.data import EpochSampler, Split, TokenStream
from orthornn.training.reproducibility import usable_cores
from orthornn.training.trainer import train

from orthornn.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parents[1] / "distributed_worker.py"
STEPS = 20
#: relative weight difference allowed after STEPS steps (the issue's bound, every family);
#: the measured ones are in docs/training.md
TOLERANCE = 1e-5
#: ||W^T W - I||_2 of a float32 orthogonal W (products of rotations, a Cayley solve)
ORTHOGONALITY = 1e-5


#: tests/faults/sitecustomize.py: "RANK:STEP" kills that worker as it starts STEP
FAULT_ENV = "ORTHORNN_TEST_KILL_RANK_AT_STEP"
FAULTS = Path(__file__).parents[1] / "faults"


def _fault(spec: str) -> dict:
    """The environment that makes worker RANK die as it starts STEP (SPEC "RANK:STEP")."""
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH")) if p)
    return {FAULT_ENV: spec, "PYTHONPATH": path}


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "ORTHORNN_PROGRESS_INTERVAL_S": "0",
            **extra}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A ragged .npz classification set (40 training sequences: 5 batches of 8, so 20 steps
    cross 4 epoch reshuffles) and a small corpus (its stream crosses epochs too)."""
    root = tmp_path_factory.mktemp("distributed-data")
    rng = np.random.default_rng(0)
    n = 50
    npz = root / "ragged.npz"
    np.savez(npz, x=rng.normal(size=(n, 6, 3)).astype(np.float32), y=np.arange(n) % 3,
             lengths=rng.integers(2, 7, size=n))
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(f"the cat sat on the mat {i} and the dog ran to the cat's "
                                  f"house" for i in range(30)))
    return {"npz": str(npz), "corpus": str(corpus)}


def _cases(data, out: Path) -> dict[str, dict]:
    """One case per family, across the samplers: a fixed split (rows shared out per epoch),
    generated batches, and the language model's stream (contiguous columns per rank)."""
    common = dict(hidden_size=8, steps=STEPS, batch_size=8, log_every=10, seed=3, threads=1,
                  optimizer="adam", lr=0.01)
    cases = {
        "svdrnn": dict(arch="svdrnn", task="classify", data=data["npz"]),
        # scoRNN's optimizer and learning rates (its presets); at RMSprop lr 0.01 the
        # trajectory amplifies rounding more: 1.2e-5 after 20 steps (docs/training.md)
        "scornn": dict(arch="scornn", task="adding", seq_len=8, optimizer="rmsprop", lr=1e-3,
                       orthogonal_lr=1e-4),
        "dizzyrnn": dict(arch="dizzyrnn", task="copy", seq_len=4),
        "sgornn": dict(arch="sgornn", task="lm", corpus=data["corpus"], vocab_size=24,
                       bptt=6, batch_size=4),
        "lstm": dict(arch="lstm", task="classify", data=data["npz"]),
    }
    return {name: {**common, **case, "out": str(out / name)} for name, case in cases.items()}


def _effective(state: dict, w: torch.Tensor | None) -> torch.Tensor:
    """What the model computes with: W and every parameter outside the parametrization of W
    (its own parameters are compared through W: svdrnn's last 1x1 reflector is -1 for any
    nonzero vector, so its gradient is zero up to rounding, and Adam turns rounding into
    full-size steps of a parameter that changes nothing)."""
    kept = [v.flatten() for k, v in sorted(state.items())
            if w is None or ".transition." not in f".{k}"]
    return torch.cat([*(t.double() for t in kept), *([] if w is None else [w.double().flatten()])])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def ranks(data, tmp_path_factory):
    """Every case trained on 2 gloo ranks in one torchrun launch (what each rank holds),
    and on one process (the reference)."""
    root = tmp_path_factory.mktemp("distributed")
    cases = _cases(data, root / "ddp")
    (root / "cases.json").write_text(json.dumps(cases))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(WORKER), str(root / "cases.json"), str(root)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    one = {}
    for name, options in _cases(data, root / "one").items():
        train(TrainConfig(**options), progress=False)
        model, _ = checkpoint.load_model(options["out"], "last.safetensors")
        one[name] = (model.state_dict(), model.recurrent_weight())
    held = {name: [torch.load(root / f"{name}-rank{r}.pt") for r in range(2)] for name in cases}
    return cases, held, one


@pytest.mark.parametrize("family", ["svdrnn", "scornn", "dizzyrnn", "sgornn", "lstm"])
def test_two_ranks_reach_the_one_process_weights(ranks, family):
    cases, held, one = ranks
    run = Path(cases[family]["out"])
    saved = checkpoint.load_weights(run / "last.safetensors")
    for rank in held[family]:
        # every rank holds rank 0's weights (DDP's averaged gradients, one optimizer step)
        for key, value in held[family][0]["state"].items():
            assert torch.equal(rank["state"][key], value), key
    assert all(torch.equal(saved[k], v) for k, v in held[family][0]["state"].items())
    difference = _relative(_effective(saved, held[family][0]["w"]), _effective(*one[family]))
    assert difference < TOLERANCE, f"{family}: {difference:.2e} after {STEPS} steps"
    # the constraint holds on every rank, measured on the W each rank's forward pass uses
    for rank in held[family]:
        w = rank["w"]
        if family == "lstm":
            assert w is None
            continue
        w = w.double()
        if family == "svdrnn":  # s = 2r (sigmoid(p) - 0.5) + s*: within [s* - r, s* + r]
            options = build_model("svdrnn", "classify", input_size=3, hidden_size=8,
                                  num_outputs=3).layer.transition.singular
            s = torch.linalg.svdvals(w)
            low, high = options.sigma_star - options.r, options.sigma_star + options.r
            assert low - 1e-6 <= s.min().item() and s.max().item() <= high + 1e-6, s
        else:
            error = torch.linalg.matrix_norm(w.T @ w - torch.eye(8, dtype=w.dtype), ord=2)
            assert error.item() < ORTHOGONALITY, (family, error.item())
    config = json.loads((run / "config.json").read_text())
    assert config["distributed"] == {"world_size": 2,
                                     "per_rank_batch": cases[family]["batch_size"] // 2,
                                     "backend": "gloo"}
    assert json.loads((run / "summary.json").read_text())["processes"] == 2


# -- failures: a killed worker, torchrun's restarts ---------------------------------------

def _lm_run(data, out: Path) -> list[str]:
    """A 12-step language model run with a checkpoint every 4 steps (its stream state is
    carried per rank, gathered into each checkpoint and shared out again on resume)."""
    return ["train", "--arch", "sgornn", "--task", "lm", "--corpus", data["corpus"],
            "--vocab-size", "24", "--bptt", "6", "--hidden", "8", "--steps", "12",
            "--batch-size", "4", "--log-every", "4", "--optimizer", "adam", "--lr", "0.01",
            "--threads", "1", "--no-progress", "--out", str(out)]


def _orthornn(args: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orthornn", *args], cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def lm_one_process(data, tmp_path_factory):
    """The same run in one process, uninterrupted: the reference of the failure tests."""
    run = tmp_path_factory.mktemp("lm-one") / "run"
    assert cli(_lm_run(data, run)) == 0
    return checkpoint.load_weights(run / "last.safetensors")


def _close_to(weights: dict, reference: dict) -> float:
    keys = sorted(reference)
    a = torch.cat([weights[k].double().flatten() for k in keys])
    b = torch.cat([reference[k].double().flatten() for k in keys])
    return _relative(a, b)


def test_a_killed_worker_ends_the_run_then_resume_finishes_it(data, tmp_path, lm_one_process):
    run = tmp_path / "run"
    start = time.monotonic()
    killed = _orthornn([*_lm_run(data, run), "--nproc-per-node", "2"], **_fault("1:7"))
    assert killed.returncode == 1 and time.monotonic() - start < 60
    last = killed.stderr.strip().splitlines()[-1]
    assert last.startswith("orthornn train: error: worker rank 1 (pid "), killed.stderr[-2000:]
    assert "was killed by SIGKILL" in last and "--max-restarts" in last
    assert f"{run} holds the checkpoint of step 4: continue with --resume" in last
    assert not (run / "summary.json").exists()
    # the same number of processes continues it to the uninterrupted run's weights
    resumed = _orthornn(["train", "--resume", "--out", str(run), "--nproc-per-node", "2",
                         "--no-progress"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["resumed_at"] == 4
    weights = checkpoint.load_weights(run / "last.safetensors")
    assert _close_to(weights, lm_one_process) < TOLERANCE


def test_max_restarts_resumes_the_group_from_the_last_checkpoint(data, tmp_path,
                                                                 lm_one_process):
    run = tmp_path / "run"
    result = _orthornn([*_lm_run(data, run), "--nproc-per-node", "2", "--max-restarts", "1"],
                       **_fault("1:7"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "failed (exitcode: -9) local_rank: 1" in result.stderr  # it did die, once
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8, 12]  # steps 5-6 redone, logged once
    assert json.loads((run / "summary.json").read_text())["resumed_at"] == 4
    weights = checkpoint.load_weights(run / "last.safetensors")
    assert _close_to(weights, lm_one_process) < TOLERANCE


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
def test_workers_end_with_a_killed_launcher(data, tmp_path):
    """SIGKILLed, the launcher cannot stop its workers: they end with it (parent-death
    signal) instead of waiting in a collective for --dist-timeout-s."""
    args = _lm_run(data, tmp_path / "run")
    args[args.index("--steps") + 1] = "100000"
    launcher = subprocess.Popen([sys.executable, "-m", "orthornn", *args, "--nproc-per-node",
                                 "2"], cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "run" / "metrics.jsonl").exists():  # the workers are training
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.2)
        workers = _children(launcher.pid)
        assert len(workers) == 2
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in workers):
        assert time.monotonic() < deadline, "the workers outlived their launcher"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_resume_with_another_number_of_processes_is_refused(data, tmp_path, capsys):
    """(the run is made by torchrun itself, as on several machines: torchrun -m orthornn)"""
    run = tmp_path / "run"
    args = _lm_run(data, run)
    args[args.index("--steps") + 1] = "4"
    del args[args.index("--threads"):args.index("--threads") + 2]  # the default: a share
    torchrun = Path(sys.executable).with_name("torchrun")
    made = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2",
                           "-m", "orthornn", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]
    assert json.loads((run / "config.json").read_text())["distributed"]["world_size"] == 2
    # each of the 2 workers took its share of the cores
    threads = json.loads((run / "summary.json").read_text())["numerics"]["threads"]
    assert threads == max(1, usable_cores() // 2)
    for extra in ([], ["--nproc-per-node", "1"]):
        code = cli(["train", "--resume", "--out", str(run), "--steps", "8", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert "the run was trained by 2 process(es) and this resume has 1" in err[0]


# -- bad input: one line naming the flag, exit 2, nothing started -------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launcher_bad_input_is_one_line_naming_the_flag(tmp_path, capsys):
    base = ["train", "--arch", "lstm", "--task", "adding", "--seq-len", "4", "--hidden", "4",
            "--steps", "2", "--batch-size", "4", "--device", "cpu"]
    cases = [
        (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1, got 0"),
        (["--nproc-per-node", str(usable_cores() + 1)],
         f"--nproc-per-node {usable_cores() + 1} is more than the {usable_cores()} cores"),
        (["--nproc-per-node", "2", "--backend", "nccl"], "--backend nccl needs CUDA devices"),
        (["--max-restarts", "1"], "--max-restarts needs --nproc-per-node N"),
        (["--nproc-per-node", "1", "--max-restarts", "-1"], "--max-restarts must be at least 0"),
        (["--nproc-per-node", "1", "--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
        (["--nproc-per-node", "1", "--rdzv-endpoint", "nohost"], "--rdzv-endpoint must be"),
        (["--nproc-per-node", "1", "--dist-timeout-s", "0"], "--dist-timeout-s must be"),
        (["--nproc-per-node", "2", "--batch-size", "3"],
         "--batch-size (3) is the global batch: it must be a multiple of the number of "
         "processes (2)"),
        (["--backend", "nccl"], "--backend nccl needs CUDA devices"),  # one process too
        # (--device cpu above: the CPU run on a CUDA machine is refused nccl the same way)
    ]
    for extra, message in cases:
        out = tmp_path / "run"
        code = cli([*base, *extra, "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err == [f"orthornn train: error: {err[0].split(': error: ')[1]}"]
        assert message in err[0], (extra, err)
        assert not out.exists(), extra


def test_an_unreachable_rendezvous_ends_in_a_bounded_time(tmp_path):
    """Nothing answers at the endpoint's port (another machine's launcher would serve it),
    and a plain env:// worker (no torchrun) whose MASTER_ADDR:MASTER_PORT is closed: each
    ends after --dist-timeout-s with one line naming it, exit 2, never a hang."""
    port = _free_port()
    args = ["train", "--arch", "lstm", "--task", "adding", "--seq-len", "4", "--hidden", "4",
            "--steps", "2", "--batch-size", "4", "--device", "cpu", "--dist-timeout-s", "2",
            "--out", str(tmp_path / "run")]
    for extra, env, named in [
        (["--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", f"nohost.invalid:{port}"],
         {}, f"cannot reach --rdzv-endpoint nohost.invalid:{port} within 2 s (--dist-timeout-s)"),
        (["--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"],
         {}, f"the rendezvous at --rdzv-endpoint 127.0.0.1:{port} did not gather --nnodes 2"),
        ([], {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port)},
         f"rank 1: cannot reach the process group's rendezvous at 127.0.0.1:{port}"),
    ]:
        start = time.monotonic()
        result = _orthornn([*args, *extra], **env)
        assert result.returncode == 2 and time.monotonic() - start < 30, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"orthornn train: error: {result.stderr.split(': error: ', 1)[1].strip()}"]
        assert named in result.stderr, result.stderr
        assert not (tmp_path / "run").exists()


# -- the pieces: each rank's share of the data and of the cores ----------------------------

def test_each_worker_takes_its_share_of_the_cores(tmp_path, monkeypatch):
    from orthornn.training import reproducibility

    cores = reproducibility.usable_cores()
    assert reproducibility.pick_threads(None, local_world=2) == max(1, cores // 2)
    assert reproducibility.pick_threads(3, local_world=2) == 3  # --threads wins
    # a container's CPU limit (cgroup v2), which the affinity mask does not show
    limit = tmp_path / "cpu.max"
    monkeypatch.setattr(reproducibility, "CGROUP_CPU_MAX", str(limit))
    limit.write_text("150000 100000\n")  # 1.5 CPUs
    assert reproducibility.usable_cores() == min(len(os.sched_getaffinity(0)), 2)
    limit.write_text("max 100000\n")
    assert reproducibility.usable_cores() == len(os.sched_getaffinity(0))


def test_ranks_share_each_epoch_once_and_each_step_is_the_global_batch():
    split = Split(torch.arange(40.0).reshape(40, 1, 1), torch.arange(40))
    one = EpochSampler(split, 8, seed=5)
    ranks = [EpochSampler(split, 8, seed=5, rank=r, world=2) for r in range(2)]
    for epoch in range(2):
        seen = []
        for step in range(epoch * one.per_epoch, (epoch + 1) * one.per_epoch):
            parts = [r.batch(step).y for r in ranks]
            assert [len(p) for p in parts] == [4, 4]
            assert sorted(torch.cat(parts).tolist()) == sorted(one.batch(step).y.tolist())
            seen += torch.cat(parts).tolist()
        assert sorted(seen) == list(range(40))  # every example once per epoch
    # the language model's ranks: contiguous columns, which together are one process's
    tokens = torch.arange(101)
    whole = TokenStream(tokens, 4, 5)
    halves = [TokenStream(tokens, 4, 5, rank=r, world=2) for r in range(2)]
    x, _, _ = whole.window(3)
    assert torch.equal(torch.cat([h.window(3)[0] for h in halves]), x)
    assert halves[1].inputs[0, 0].item() == 2 * whole.inputs.shape[1]  # a contiguous part
