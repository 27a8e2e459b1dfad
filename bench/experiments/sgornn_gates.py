"""Why sgornn stays far below vprnn on permuted-digits: a sweep of its scalar gates.

SGORNN (eq. 1) is h_t = a relu(U h_{t-1} + W x_t + b) + b2 h_{t-1} with vprnn's
orthogonal U, and eq. 3 keeps b2 <= 1 - 2a. Its step Jacobian a D U + b2 I (D the relu
mask) then has norm at most a + b2 <= 1 - a < 1: every step contracts, and the
eigenvalues of a U + b2 I lie on a circle of radius a around b2, so the state turns by at
most about a radians a step. Small a gives a slow leaky average of the pixels (little
sense of where a pixel came from); large a forgets within a few steps. Permuted digits
needs both the order of 64 pixels and memory of all of them.

Rows, each on the permuted-digits preset (the same steps, optimizer and lr as the
reproduce row), one process per run:

* sgornn at several initial a (b2 starts at 0.95 (1 - 2a), inside eq. 3);
* the same cell with FastRNN's unconstrained gates (a = sigmoid(alpha), b2 =
  sigmoid(beta): eq. 3 dropped), at FastRNN's initial values and towards vprnn;
* vprnn: the same U without gates (a = 1, b2 = 0).

Columns: test accuracy (mean over seeds), the gates after training, and the bound on how
much of a gradient survives 64 steps, (a + b2)^64 (none when a + b2 >= 1). Prints a table and
writes bench/results/sgornn_gates.json.

    python bench/experiments/sgornn_gates.py [--seeds 1] [--epochs N]
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
from bench.common import write_result

T = 64  # permuted-digits: 8 x 8 pixels, one per step

# (label, arch, gates): gates None = the architecture's own; ("sgornn", a) = eq. 3 with
# initial a; ("free", a, b2) = FastRNN's unconstrained map on vprnn's U.
ROWS = [
    ("sgornn a=0.005", "sgornn", ("sgornn", 0.005)),
    ("sgornn a=0.02", "sgornn", ("sgornn", 0.02)),
    ("sgornn a=0.05 (default)", "sgornn", None),
    ("sgornn a=0.1", "sgornn", ("sgornn", 0.1)),
    ("sgornn a=0.25", "sgornn", ("sgornn", 0.25)),
    ("sgornn a=0.45", "sgornn", ("sgornn", 0.45)),
    ("no eq. 3: a=0.047, b2=0.953 (FastRNN's)", "sgornn", ("free", 0.047, 0.953)),
    ("no eq. 3: a=0.3, b2=0.9", "sgornn", ("free", 0.3, 0.9)),
    ("no eq. 3: a=0.9, b2=0.5", "sgornn", ("free", 0.9, 0.5)),
    ("vprnn (a=1, b2=0)", "vprnn", None),
]


@contextlib.contextmanager
def _free_gates(a: float, b2: float):
    """While open, "sgornn" builds its cell with FastRNN's gate map (this process only)."""
    from orthornn.models import registry
    from orthornn.models.activations import Activation
    from orthornn.models.cells import Recurrence, ScalarGates
    from orthornn.models.parametrizations import RotationPermutation

    def build(d, n, rotations=None, seed=0, a_init=None, b2_init=None):
        return Recurrence(d, RotationPermutation(n, rotations, seed=seed),
                          Activation("relu", n), ScalarGates(clip=False, a_init=a, b2_init=b2))

    spec = registry.ARCHITECTURES["sgornn"]
    registry.ARCHITECTURES._entries["sgornn"] = registry.Architecture(
        "sgornn", spec.summary, spec.options, build)
    try:
        yield
    finally:
        registry.ARCHITECTURES._entries["sgornn"] = spec


def run(args: tuple) -> dict:
    label, arch, gates, seed, epochs, out = args
    import torch

    torch.set_num_threads(1)
    from orthornn.training.presets import resolve
    from orthornn.training.trainer import train

    given = {"arch": arch, "task": "permuted-digits", "seed": seed, "out": out}
    if epochs is not None:
        given["epochs"] = epochs
    if gates and gates[0] == "sgornn":
        given["arch_options"] = {"a_init": gates[1]}
    config, _ = resolve(given)
    with _free_gates(*gates[1:]) if gates and gates[0] == "free" else contextlib.nullcontext():
        summary = train(config, progress=False)
    last = json.loads((Path(out) / "metrics.jsonl").read_text().splitlines()[-1])
    a, b2 = (last.get("gate_a"), last.get("gate_b2")) if arch == "sgornn" else (1.0, 0.0)
    return {"label": label, "seed": seed, "accuracy": summary["test"]["accuracy"],
            "a": a, "b2": b2, "steps": summary["steps"], "seconds": summary["seconds"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=1, help="seeds per row (default 1)")
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs per run (default: the preset's)")
    p.add_argument("--jobs", type=int, default=2,
                   help="runs at once, each in its own process (default 2; 1: in this one)")
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parents[1] / "results" / "sgornn_gates.json")
    a = p.parse_args(argv)
    if a.seeds < 1 or a.jobs < 1 or (a.epochs is not None and a.epochs < 1):
        p.error("--seeds, --jobs and --epochs must be at least 1")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(label, arch, gates, seed, a.epochs, f"{tmp}/{i}-{seed}")
                for i, (label, arch, gates) in enumerate(ROWS) for seed in range(a.seeds)]
        with ProcessPoolExecutor(a.jobs) if a.jobs > 1 else contextlib.nullcontext() as pool:
            runs = []
            for done in (pool.map(run, jobs) if pool else map(run, jobs)):
                runs.append(done)
                print(f"  {done['label']} seed {done['seed']}: {done['accuracy']:.3f}",
                      flush=True)
    rows = []
    for label, _, _ in ROWS:
        mine = [r for r in runs if r["label"] == label]
        acc = [r["accuracy"] for r in mine]
        ga = statistics.mean(r["a"] for r in mine)
        gb = statistics.mean(r["b2"] for r in mine)
        rows.append({"row": label, "accuracy": statistics.mean(acc),
                     "sd": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                     "a": ga, "b2": gb,  # no bound once a + b2 >= 1 (eq. 3 dropped, or no gates)
                     "survives_64": (ga + gb) ** T if ga + gb < 1 else None,
                     "steps": mine[0]["steps"],
                     "seconds": round(statistics.mean(r["seconds"] for r in mine), 1)})
    print(f"\n| row | test accuracy | a, b2 after training | (a + b2)^{T} | steps |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        sd = f" +- {r['sd']:.3f}" if a.seeds > 1 else ""
        bound = "none" if r["survives_64"] is None else f"{r['survives_64']:.2g}"
        print(f"| {r['row']} | {r['accuracy']:.3f}{sd} | {r['a']:.3f}, {r['b2']:.3f} "
              f"| {bound} | {r['steps']} |")
    write_result(a.out, {"task": "permuted-digits", "seeds": a.seeds, "rows": rows,
                         "seconds": round(time.perf_counter() - start, 1),
                         "machine": platform.machine(), "python": platform.python_version()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
