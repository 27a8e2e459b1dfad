"""SGORNN's long adding problem (SGORNN sec. 3.1, Figs. 2-3): learning curves at T = 1000.

The paper's recipe for every model: n = 128, k = 14 rotation sublayers, RMSprop 1e-2
decayed linearly to 0 over 20,000 steps, batch 64, validation MSE every 100 steps. On a
CPU the runs stop after ``--steps`` steps (the budget) while the learning rate follows the
paper's 20,000-step schedule (``--horizon``): the curve is the first part of the paper's
run, not a shorter run decayed to 0 early.

Rows (``--rows``, default all):

* ``map``: sgornn as orthornn builds it, eq. 3 in the map a = sigmoid(alpha) / 2,
  b2 = (1 - 2a) sigmoid(beta), started at a = 0.047, b2 = 0.95 (1 - 2a) = 0.860;
* ``map-edge``: the same map started near the boundary, a = 0.01, b2 = 0.979 (1 - 2a = 0.98);
* ``map-boundary``: the same map started where the clip starts, b2 = 0.999 (1 - 2a) =
  0.904 (a + b2 = 0.951), with a gradient for beta (under RMSprop a small gradient still
  moves a parameter by about the learning rate);
* ``clip``: the paper's own wording, a = sigmoid(alpha), b2 = min(sigmoid(beta), 1 - 2a)
  (the clip after the sigmoid), FastRNN's alpha = -3, beta = 3: b2 sits on the boundary
  1 - 2a from step 0 (a + b2 = 1 - a = 0.953) and beta gets no gradient while clipped;
* ``vprnn``: the same U without gates.

Columns: the first validation step after which the MSE stays below 0.05 (none within the
budget), the last and best validation MSE, the gates, steps and seconds. ``--runs DIR``
keeps the run directories; a row whose run was stopped (killed) is tabulated from its
metrics.jsonl with ``--collect``.

    python bench/experiments/sgornn_adding.py [--seq-len 1000] [--steps 3000]
        [--rows map,clip,vprnn] [--jobs 3] [--runs DIR] [--collect]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.common import chosen_rows, write_result

THRESHOLD = 0.05  # "converged": validation MSE below this and staying there
HORIZON = 20000  # SGORNN sec. 3.1: at most 20,000 steps, lr decayed linearly to 0

ROWS = {
    "map": ("sgornn", "eq. 3 map, a=0.047, b2=0.860 (orthornn default)", {}),
    "map-edge": ("sgornn", "eq. 3 map, a=0.01, b2=0.979 (near the boundary 0.98)",
                 {"a_init": 0.01, "b2_init": 0.979}),
    "map-boundary": ("sgornn", "eq. 3 map, a=0.047, b2=0.999 (1 - 2a) = 0.904 (the clip's start)",
                     {"b2_init": 0.999 * (1 - 2 / (1 + 2.718281828459045 ** 3))}),
    "clip": ("sgornn", "paper's clip b2 = min(sigmoid(beta), 1 - 2a), alpha=-3, beta=3", {}),
    "vprnn": ("vprnn", "vprnn (no gates)", {}),
}


def _paper_clip_gates():
    """ScalarGates with the paper's clip after the sigmoid (SGORNN sec. 2, eq. 3)."""
    import torch
    from orthornn.models.cells import ScalarGates

    class PaperClipGates(ScalarGates):
        def __init__(self):
            super().__init__(clip=False)  # alpha = -3, beta = 3: FastRNN's initial gates

        def forward(self):
            a = torch.sigmoid(self.alpha)
            return a, torch.minimum(torch.sigmoid(self.beta), 1 - 2 * a)
    return PaperClipGates()


@contextlib.contextmanager
def _patched(row: str, horizon: int):
    """While open (this process only): the ``clip`` row's sgornn cell, and the linear
    schedule over ``horizon`` steps whatever the run's own budget."""
    from orthornn.models import registry
    from orthornn.models.activations import Activation
    from orthornn.models.cells import Recurrence
    from orthornn.models.parametrizations import RotationPermutation
    from orthornn.training import trainer

    schedule = trainer._schedule
    trainer._schedule = lambda name, total: schedule(name, horizon)
    spec = registry.ARCHITECTURES["sgornn"]
    if row == "clip":
        def build(d, n, rotations=None, seed=0, a_init=None, b2_init=None):
            return Recurrence(d, RotationPermutation(n, rotations, seed=seed),
                              Activation("relu", n), _paper_clip_gates())
        registry.ARCHITECTURES._entries["sgornn"] = registry.Architecture(
            "sgornn", spec.summary, spec.options, build)
    try:
        yield
    finally:
        trainer._schedule = schedule
        registry.ARCHITECTURES._entries["sgornn"] = spec


def run(args: tuple) -> None:
    row, seq_len, steps, horizon, seed, out = args
    import torch

    torch.set_num_threads(1)
    # With eq. 3's map at its default start (a + b2 = 0.907) the backward pass through
    # T = 1000 steps carries factors like 0.907^1000 = 1e-43: subnormal floats, which the
    # CPU computes many times slower (measured: 3x on a step's backward, far more in a
    # run). Flushing them to zero changes nothing above 1e-38.
    torch.set_flush_denormal(True)
    from orthornn.training.presets import resolve
    from orthornn.training.trainer import train

    arch, _, options = ROWS[row]
    given = {"arch": arch, "task": "adding", "seq_len": seq_len, "steps": steps,
             "seed": seed, "out": out, "log_every": 100, "eval_batch_size": 500}
    if options:
        given["arch_options"] = dict(options)
    config, _ = resolve(given)
    with _patched(row, horizon):
        train(config, progress=False)


def converged_at(curve: list[tuple[int, float]], threshold: float = THRESHOLD) -> int | None:
    """The first validation step from which every later validation MSE is below
    ``threshold`` (None if the last one is not)."""
    step = None
    for s, mse in curve:
        if mse < threshold:
            step = s if step is None else step
        else:
            step = None
    return step


def collect(row: str, run_dir: Path) -> dict | None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        return None
    curve = [(r["step"], r["val_mse"]) for r in lines]
    last = lines[-1]
    return {"row": row, "label": ROWS[row][1], "curve": curve,
            "converged_at": converged_at(curve), "steps": last["step"],
            "last_mse": last["val_mse"], "best_mse": min(m for _, m in curve),
            "gate_a": last.get("gate_a"), "gate_b2": last.get("gate_b2"),
            "seconds": last["seconds"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=1000)
    p.add_argument("--steps", type=int, default=3000, help="budget: steps run (default 3000)")
    p.add_argument("--horizon", type=int, default=HORIZON,
                   help="steps of the linear schedule (default the paper's 20,000)")
    p.add_argument("--rows", default="map,clip,vprnn",
                   help=f"comma-separated, of: {', '.join(ROWS)} (default map,clip,vprnn)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--runs", type=Path, help="keep the run directories here")
    p.add_argument("--collect", action="store_true", help="only tabulate --runs")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results"
                   / "sgornn_adding.json")
    a = p.parse_args(argv)
    rows = chosen_rows(p, a.rows, ROWS)
    if min(a.steps, a.horizon, a.jobs, a.seq_len) < 1:
        p.error("--steps, --horizon, --jobs and --seq-len must be at least 1")
    if a.collect and a.runs is None:
        p.error("--collect needs --runs DIR")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = a.runs or Path(tmp)
        dirs = {r: root / f"{r}-T{a.seq_len}-s{a.seed}" for r in rows}
        if not a.collect:
            todo = [(r, a.seq_len, a.steps, a.horizon, a.seed, str(dirs[r])) for r in rows
                    if not (dirs[r] / "summary.json").is_file()]
            with (ProcessPoolExecutor(min(a.jobs, len(todo))) if a.jobs > 1 and todo
                  else contextlib.nullcontext()) as pool:
                list(pool.map(run, todo) if pool else map(run, todo))
        results = [c for r in rows if (c := collect(r, dirs[r])) is not None]
    print(f"\nadding T={a.seq_len}, seed {a.seed}, lr schedule over {a.horizon} steps")
    print(f"| row | steps run | first step with val MSE < {THRESHOLD} to the end "
          f"| last val MSE | best val MSE | a, b2 at the end | s |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for r in results:
        gates = ("-" if r["gate_a"] is None else f"{r['gate_a']:.3f}, {r['gate_b2']:.3f}")
        print(f"| {r['label']} | {r['steps']} | {r['converged_at'] or 'not within the budget'}"
              f" | {r['last_mse']:.4f} | {r['best_mse']:.4f} | {gates} | {r['seconds']:.0f} |")
    write_result(a.out, {"task": "adding", "seq_len": a.seq_len, "budget_steps": a.steps,
                         "horizon": a.horizon, "seed": a.seed, "rows": results,
                         "seconds": round(time.perf_counter() - start, 1),
                         "machine": platform.machine(), "python": platform.python_version()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
