"""Training-step speed of every architecture against torch.nn.RNN (ReLU) on the CPU.

Times forward + backward of one classification step at n = 128, T = 256, B = 64 and
reports the median over interleaved repetitions of (time / nn.RNN time) measured in
the same process, so machine noise hits both sides alike. Also compares svdrnn's
dense path (W built once per call) with the papers' per-step reflector path at
m1 = m2 = n.

    python bench/perf/models.py [--hidden 128 --steps 256 --batch 64 --reps 7]

Prints a table and writes bench/results/models.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from orthornn.models import ARCHITECTURES, build_model

from bench.common import seconds, write_result

ORTHOGONAL = ("ornn", "svdrnn", "scornn", "dizzyrnn", "vprnn", "sgornn")


def step_fn(model, x, y, **kwargs):
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model(x, **kwargs) if not kwargs else model.head(model.encode(x, **kwargs)[1]),
                y).backward()
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--inputs", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--factored-reps", type=int, default=2)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "results" / "models.json")
    args = parser.parse_args(argv)
    if min(args.hidden, args.steps, args.batch, args.inputs, args.reps) < 1:
        parser.error("--hidden, --steps, --batch, --inputs and --reps must be positive")

    torch.manual_seed(0)
    n, classes = args.hidden, 10
    x = torch.randn(args.batch, args.steps, args.inputs)
    y = torch.randint(0, classes, (args.batch,))
    rnn = torch.nn.RNN(args.inputs, n, nonlinearity="relu", batch_first=True)
    head = torch.nn.Linear(n, classes)
    loss_fn = torch.nn.CrossEntropyLoss()

    def baseline():
        rnn.zero_grad(set_to_none=True)
        _out, h = rnn(x)
        loss_fn(head(h[0]), y).backward()

    steps = {}
    for arch in ARCHITECTURES:
        if not ARCHITECTURES[arch].recurrent:
            continue
        model = build_model(arch, "classify", input_size=args.inputs, hidden_size=n,
                            num_outputs=classes)
        steps[arch] = step_fn(model, x, y)

    ratios = {arch: [] for arch in steps}
    base_times = []
    for fn in [baseline, *steps.values()]:
        fn()  # warm-up
    for rep in range(args.reps):
        for arch, fn in steps.items():
            base = seconds(baseline)
            base_times.append(base)
            ratios[arch].append(seconds(fn) / base)
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)

    rows = [{"arch": arch, "ratio_to_nn_rnn": statistics.median(r),
             "orthogonal": arch in ORTHOGONAL} for arch, r in ratios.items()]
    base_ms = statistics.median(base_times) * 1e3

    # Dense vs per-step reflector path, svdrnn with m1 = m2 = n.
    svd = build_model("svdrnn", "classify", input_size=args.inputs, hidden_size=n,
                      num_outputs=classes, m1=n, m2=n)
    dense, factored = step_fn(svd, x, y), step_fn(svd, x, y, factored=True)
    dense()
    speedups = []
    for _ in range(args.factored_reps):
        speedups.append(seconds(factored) / seconds(dense))
    speedup = statistics.median(speedups)

    print(f"\nforward+backward, n={n} T={args.steps} B={args.batch}, CPU "
          f"({torch.get_num_threads()} threads); nn.RNN(relu) = {base_ms:.1f} ms\n")
    print(f"| {'arch':<9} | time / nn.RNN(relu) | target |")
    print(f"| {'-' * 9} | {'-' * 19} | {'-' * 6} |")
    for row in rows:
        target = "<= 1.5" if row["orthogonal"] else ""
        print(f"| {row['arch']:<9} | {row['ratio_to_nn_rnn']:>19.2f} | {target:>6} |")
    print(f"\nsvdrnn m1=m2={n}: per-step reflector path / dense path = {speedup:.1f}x "
          f"(target >= 5x)")

    result = {"hidden": n, "steps": args.steps, "batch": args.batch, "inputs": args.inputs,
              "reps": args.reps, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "machine": platform.machine(),
              "nn_rnn_ms": base_ms, "architectures": rows,
              "svdrnn_factored_over_dense": speedup}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
