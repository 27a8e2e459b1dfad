"""DizzyRNN on the copy problem (DizzyRNN sec. 6): what decides whether it learns it.

The paper's task: 10 symbols from an alphabet of 10, a lag of 90, the loss and the
accuracy on the copied portion only (chance accuracy 10%); n = 128, 10 packed rotations,
batches of 100; "near perfect accuracy in under 100 epochs" of 10 batches = 1,000 steps.
The paper names no optimizer or learning rate (TensorFlow).

Each row is the DizzyRNN copy preset (``--arch dizzyrnn --task copy``) with one thing
changed: the optimizer or its learning rate, the angles' own learning rate, the angles'
initialisation, the nonlinearity, the input map's bias, or the task variant (Arjovsky's:
every step scored, 8 symbols). Columns: test copy accuracy and cross-entropy (mean over
seeds), steps and seconds per seed. Prints a table and writes
bench/results/dizzyrnn_copy.json.

    python bench/experiments/dizzyrnn_copy.py [--seeds 1] [--steps 1000] [--rows a,b,...] [--jobs 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.common import chosen_rows, write_result

ARJOVSKY = {"copy_loss": "all", "copy_symbols": 8}

# name -> (label, overrides of the preset, cell change). Cell changes: "identity" (angles
# 0: W = I at the start), "small" (angles U(-0.1, 0.1)), "linear" (no nonlinearity),
# "nobias" (no bias b in |W h + W_x x + b|).
ROWS = {
    "preset": ("preset", {}, None),
    "rms1e-2": ("RMSprop 1e-2", {"optimizer": "rmsprop", "lr": 1e-2}, None),
    "rms3e-3": ("RMSprop 3e-3", {"optimizer": "rmsprop", "lr": 3e-3}, None),
    "rms1e-4": ("RMSprop 1e-4", {"optimizer": "rmsprop", "lr": 1e-4}, None),
    "rms5e-4": ("RMSprop 5e-4", {"optimizer": "rmsprop", "lr": 5e-4}, None),
    "noclip": ("no gradient clipping (the preset clips at norm 1)", {"clip": 0.0}, None),
    "adam1e-3": ("Adam 1e-3", {"optimizer": "adam", "lr": 1e-3}, None),
    "adam1e-2": ("Adam 1e-2", {"optimizer": "adam", "lr": 1e-2}, None),
    "angles1e-2": ("angles at lr 1e-2 (rest at the preset's)", {"orthogonal_lr": 1e-2}, None),
    "angles0": ("angles frozen (lr ~0)", {"orthogonal_lr": 1e-12}, None),
    "identity": ("angles started at 0 (W = I)", {}, "identity"),
    "small": ("angles started in U(-0.1, 0.1)", {}, "small"),
    "linear": ("no nonlinearity (abs removed)", {}, "linear"),
    "nobias": ("abs without the bias b", {}, "nobias"),
    "arjovsky": ("Arjovsky's variant (every step scored, 8 symbols, T=90)", ARJOVSKY, None),
    "arjovsky100": ("Arjovsky's variant, T=100", {**ARJOVSKY, "seq_len": 100}, None),
}


@contextlib.contextmanager
def _cell(change: str | None):
    """While open (this process only), dizzyrnn's cell with ``change`` applied."""
    if change is None:
        yield
        return
    import torch
    from orthornn.models import registry
    from orthornn.models.activations import Activation

    spec = registry.ARCHITECTURES["dizzyrnn"]

    def build(d, n, **options):
        layer = spec.build(d, n, **options)
        with torch.no_grad():
            angles = layer.transition.angles
            if change == "identity":
                angles.zero_()
            elif change == "small":
                angles.uniform_(-0.1, 0.1)
        if change == "linear":
            layer.activation = Activation("leaky_relu", n, negative_slope=1.0)
        if change == "nobias":
            layer.input = torch.nn.Linear(d, n, bias=False)
        return layer
    registry.ARCHITECTURES._entries["dizzyrnn"] = registry.Architecture(
        "dizzyrnn", spec.summary, spec.options, build)
    try:
        yield
    finally:
        registry.ARCHITECTURES._entries["dizzyrnn"] = spec


def run(args: tuple) -> dict:
    name, seed, steps, out = args
    import torch

    torch.set_num_threads(1)
    from orthornn.training.presets import resolve
    from orthornn.training.trainer import train

    _, overrides, change = ROWS[name]
    # one thread a job: train() would otherwise take the cores idle at its start, every
    # job all of them at once (the same numbers at any thread count, only slower)
    given = {"arch": "dizzyrnn", "task": "copy", "seed": seed, "out": out, "threads": 1,
             "log_every": 100, "eval_batch_size": 500, **overrides}
    if steps is not None:
        given["steps"] = steps
    config, _ = resolve(given)
    with _cell(change):
        summary = train(config, progress=False)
    curve = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {"row": name, "seed": seed, "copy_accuracy": summary["test"]["copy_accuracy"],
            "cross_entropy": summary["test"]["cross_entropy"], "baseline": summary["baseline"],
            "steps": summary["steps"], "seconds": summary["seconds"],
            "curve": [(r["step"], r["val_copy_accuracy"]) for r in curve]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=1, help="seeds per row (default 1)")
    p.add_argument("--steps", type=int, default=None, help="default: the preset's (1,000)")
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma-separated, of: {', '.join(ROWS)} (default all)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results"
                   / "dizzyrnn_copy.json")
    a = p.parse_args(argv)
    rows = chosen_rows(p, a.rows, ROWS)
    if a.seeds < 1 or a.jobs < 1 or (a.steps is not None and a.steps < 1):
        p.error("--seeds, --jobs and --steps must be at least 1")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(r, seed, a.steps, f"{tmp}/{r}-{seed}") for r in rows for seed in range(a.seeds)]
        with ProcessPoolExecutor(a.jobs) if a.jobs > 1 else contextlib.nullcontext() as pool:
            runs = []
            for done in (pool.map(run, jobs) if pool else map(run, jobs)):
                runs.append(done)
                print(f"  {done['row']} seed {done['seed']}: copy accuracy "
                      f"{done['copy_accuracy']:.3f}, CE {done['cross_entropy']:.4f} "
                      f"({done['seconds']:.0f} s)", flush=True)
    results = []
    for r in rows:
        mine = [x for x in runs if x["row"] == r]
        acc = [x["copy_accuracy"] for x in mine]
        results.append({"row": r, "label": ROWS[r][0], "copy_accuracy": statistics.fmean(acc),
                        "sd": statistics.stdev(acc) if len(acc) > 1 else 0.0, "values": acc,
                        "cross_entropy": statistics.fmean(x["cross_entropy"] for x in mine),
                        "baseline": mine[0]["baseline"], "steps": mine[0]["steps"],
                        "seconds": round(statistics.fmean(x["seconds"] for x in mine), 1),
                        "curves": {x["seed"]: x["curve"] for x in mine}})
    print("\n| row | copy accuracy | cross-entropy (baseline) | steps | s / seed |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in results:
        sd = f" +- {r['sd']:.3f}" if a.seeds > 1 else ""
        print(f"| {r['label']} | {r['copy_accuracy']:.3f}{sd} | {r['cross_entropy']:.4f} "
              f"({r['baseline']:.4f}) | {r['steps']} | {r['seconds']:.0f} |")
    write_result(a.out, {"task": "copy", "seeds": a.seeds, "rows": results,
                         "seconds": round(time.perf_counter() - start, 1),
                         "machine": platform.machine(), "python": platform.python_version()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
