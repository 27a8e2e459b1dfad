"""Training speed by thread count, idle and beside one CPU-bound process.

Trains the quickstart's two models (digits: scoRNN n=64; words: svdRNN n=128 language
model) for a few steps in a fresh process per cell, with --threads 1, 2 and the default
(the idle cores at the start), once on an idle machine and once beside one busy-looping
process, and reports steps per second and the ratio to 1 thread idle measured in the
same run. Also checks the reproducibility claim on the way: every cell of a model must
train the same bytes.

    python bench/perf/threads.py [--steps-digits 150 --steps-words 30 --models digits words]
                                 [--out bench/results/threads.json]

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.common import write_result
from orthornn.quickstart import DEFAULT_MODELS

ROOT = Path(__file__).resolve().parents[2]

THREADS = ("1", "2", "default")


def busy() -> None:
    while True:
        pass


def train_once(name: str, steps: int, threads: str, out: Path) -> dict:
    options = {k: v for k, v in DEFAULT_MODELS[name].items() if k != "epochs"}
    options.update(steps=steps, log_every=steps)
    if threads != "default":
        options["threads"] = int(threads)
    config = out / "config.json"
    config.write_text(json.dumps(options))
    run = out / "run"
    subprocess.run([sys.executable, "-m", "orthornn", "train", "--config", str(config),
                    "--out", str(run), "--no-progress"], check=True, cwd=ROOT,
                   capture_output=True, text=True)
    summary = json.loads((run / "summary.json").read_text())
    digest = hashlib.sha256((run / "last.safetensors").read_bytes()).hexdigest()
    return {"steps_per_s": steps / summary["seconds"],
            "threads_used": summary["numerics"]["threads"], "sha256": digest[:16]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps-digits", type=int, default=150)
    parser.add_argument("--steps-words", type=int, default=30)
    parser.add_argument("--models", nargs="+", choices=list(DEFAULT_MODELS),
                        default=list(DEFAULT_MODELS))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "threads.json"))
    args = parser.parse_args(argv)
    steps = {name: {"digits": args.steps_digits, "words": args.steps_words}[name]
             for name in args.models}
    rows = []
    for load in ("idle", "beside one busy process"):
        hog = None
        if load != "idle":
            hog = multiprocessing.Process(target=busy, daemon=True)
            hog.start()
        try:
            for name in steps:
                for threads in THREADS:
                    with tempfile.TemporaryDirectory() as tmp:
                        cell = train_once(name, steps[name], threads, Path(tmp))
                    rows.append({"model": name, "load": load, "threads": threads, **cell})
        finally:
            if hog is not None:
                hog.terminate()
                hog.join()
    print(f"\n{os.cpu_count()} cores; ratio = steps/s over 1 thread idle, same run\n")
    print(f"{'model':8} {'load':24} {'threads':>8} {'used':>5} {'step/s':>8} {'ratio':>6}")
    for row in rows:
        base = next(r for r in rows if r["model"] == row["model"] and r["load"] == "idle"
                    and r["threads"] == "1")
        row["ratio"] = row["steps_per_s"] / base["steps_per_s"]
        print(f"{row['model']:8} {row['load']:24} {row['threads']:>8} {row['threads_used']:>5} "
              f"{row['steps_per_s']:8.1f} {row['ratio']:6.2f}")
    same = {name: len({r["sha256"] for r in rows if r["model"] == name}) == 1 for name in steps}
    print(f"\nthe same bytes in every cell: {same}")
    write_result(Path(args.out), {"cores": os.cpu_count(), "rows": rows, "same_bytes": same})
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
