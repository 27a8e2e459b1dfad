"""Data-parallel training speed: steps/s and examples/s at 1 and 2 processes, one thread
each, for the quickstart's two models (digits: scoRNN n=64, batch 64; words: the svdRNN
n=128 language model, batch 32 windows of 35 tokens).

Each cell trains S and then 2S steps, each a fresh `orthornn train --threads 1` run (with
`--nproc-per-node P` for P > 1), and takes the rate of the S extra steps from the two runs'
training seconds (summary.json): start-up, the data loading and the final validation,
the same in both runs, cancel. Before each run it waits (up to --wait-idle-s) for the
cores to be idle, since the machine may be shared, and records the idle cores it saw. Rounds
alternate the process counts (1, 2, 1, 2, ...) so that a change of load on the machine
meets every count; the median round is reported, with
the speed-up over 1 process in the same rounds and the efficiency (speed-up / P). The
batch is the global one at every P (each of P workers trains batch / P sequences).

    python bench/perf/distributed.py [--models digits words] [--processes 1 2] [--rounds 5]
        [--steps-digits 200 --steps-words 30] [--device cpu|cuda] [--wait-idle-s 30]
        [--out bench/results/distributed.json]

On a machine with several GPUs, --device cuda --processes 1 2 4 ... measures the scaling
on NCCL (one GPU per process). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from orthornn.training.reproducibility import idle_cores, usable_cores

from bench.common import write_result
from orthornn.quickstart import DEFAULT_MODELS

ROOT = Path(__file__).resolve().parents[2]


def wait_idle(limit_s: float) -> float | None:
    """Wait until nearly every core is idle (at most ``limit_s``); the idle cores seen last."""
    deadline = time.monotonic() + limit_s
    while True:
        idle = idle_cores(0.5)
        if idle is None or idle >= usable_cores() - 0.25 or time.monotonic() >= deadline:
            return idle


def train_seconds(name: str, steps: int, processes: int, device: str, out: Path) -> float:
    """The training seconds (summary.json) of a fresh run of ``steps`` steps."""
    options = {k: v for k, v in DEFAULT_MODELS[name].items() if k != "epochs"}
    options.update(steps=steps, log_every=steps, threads=1, device=device)
    config = out / f"{name}-{processes}-{steps}.json"
    config.write_text(json.dumps(options))
    run = out / f"run-{name}-{processes}-{steps}"
    launch = ["--nproc-per-node", str(processes)] if processes > 1 else []
    result = subprocess.run([sys.executable, "-m", "orthornn", "train", "--config", str(config),
                             "--out", str(run), "--no-progress", *launch], cwd=ROOT,
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{name} at {processes} process(es) failed:\n{result.stderr[-2000:]}")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["processes"] == processes, summary
    return summary["seconds"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(DEFAULT_MODELS),
                        default=list(DEFAULT_MODELS))
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-digits", type=int, default=200)
    parser.add_argument("--steps-words", type=int, default=30)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--wait-idle-s", type=float, default=30.0,
                        help="longest wait for idle cores before each run (0: none)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "distributed.json"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or min(args.processes) < 1 or 1 not in args.processes:
        parser.error("--rounds must be at least 1 and --processes must include 1 (the "
                     "baseline), all at least 1")
    steps = {"digits": args.steps_digits, "words": args.steps_words}
    rates: dict[tuple[str, int], list[float]] = {}
    idle: list[float | None] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in args.models:
                for processes in args.processes:
                    cell = Path(tmp) / f"round{r}"
                    cell.mkdir(exist_ok=True)
                    idle.append(wait_idle(args.wait_idle_s))
                    short = train_seconds(name, steps[name], processes, args.device, cell)
                    idle.append(wait_idle(args.wait_idle_s))
                    long = train_seconds(name, 2 * steps[name], processes, args.device, cell)
                    # the longer run not slower: noise at toy sizes, no rate
                    rate = steps[name] / (long - short) if long > short else float("nan")
                    rates.setdefault((name, processes), []).append(rate)
    rows = []
    for (name, processes), values in rates.items():
        measured = [v for v in values if v == v]
        per_s = statistics.median(measured) if measured else None
        options: dict = DEFAULT_MODELS[name]
        batch, bptt = options["batch_size"], options.get("bptt")
        row: dict = {"model": name, "processes": processes, "threads_each": 1,
                     "batch": batch, "per_rank_batch": batch // processes,
                     "steps_per_s": per_s,
                     "examples_per_s": None if per_s is None else per_s * batch,
                     "rounds": values}
        if name == "words" and per_s is not None:
            row["tokens_per_s"] = row["examples_per_s"] * bptt
        rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["model"] == row["model"] and r["processes"] == 1)
        ok = row["steps_per_s"] is not None and base["steps_per_s"] is not None
        row["speedup"] = row["steps_per_s"] / base["steps_per_s"] if ok else None
        row["efficiency"] = row["speedup"] / row["processes"] if ok else None

    def num(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"
    seen = [v for v in idle if v is not None]
    print(f"\n{os.cpu_count()} cores, device {args.device}; median of {args.rounds} round(s), "
          f"one thread per process; idle cores before the runs: "
          f"{min(seen, default=float('nan')):.2f}-{max(seen, default=float('nan')):.2f}\n")
    print(f"{'model':7} {'procs':>5} {'batch/rank':>10} {'steps/s':>8} {'examples/s':>11} "
          f"{'speed-up':>8} {'efficiency':>10}")
    for row in rows:
        print(f"{row['model']:7} {row['processes']:>5} {row['per_rank_batch']:>10} "
              f"{num(row['steps_per_s']):>8} {num(row['examples_per_s'], 0):>11} "
              f"{num(row['speedup'], 2):>8} {num(row['efficiency'], 2):>10}")
    write_result(Path(args.out), {"cores": os.cpu_count(), "device": args.device,
                                  "rounds": args.rounds, "steps": steps,
                                  "idle_cores_before_runs": idle, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
