"""GPU benchmark of the custom ops (issue 3): the fused Triton recurrence against the
Python loops and cuDNN, and the compact-WY matrix against householder_product.

For every T in {128, 784, 2000}, n in {128, 256, 512}, B in {1, 64, 256} it times the
forward and forward+backward (loss = sum of states and last state) of
    fused      torch.ops.orthornn.rnn_scan with ORTHORNN_KERNELS=triton (ReLU)
    loop       the same op with ORTHORNN_KERNELS=reference: the Python loop, one addmm
               per step, explicit reverse-scan backward
    autograd   models.ops.rnn_scan_steps: the Python loop through plain autograd
    cudnn      torch.nn.RNN(n, n, nonlinearity="relu") (cuDNN; its input GEMM included)
and, for n in the same list with m = n reflectors, models.ops.householder_matrix
(compact WY) against torch.linalg.householder_product. Times are medians of CUDA-
synchronised wall times after a warm-up (which also compiles the kernels).

    python bench/perf/ops.py                       # the full grid, on a CUDA device
    python bench/perf/ops.py --steps 784 --hidden 128 --batch 64   # one point
    python bench/perf/ops.py --tf32                # TF32 tensor cores for fp32 products
    python bench/perf/ops.py --columns 1 2 4 8     # the fused scan split over 1, 2, 4, 8
                                              # column programs a group (fused_c2, ...):
                                              # the measurements scan.COLUMN_TABLE takes
    python bench/perf/ops.py --smoke               # tiny grid on the CPU through the Triton
                                              # interpreter: checks the script, times are
                                              # meaningless

Prints tables and the issue's targets at T = 784, n = 128, B = 64 (fused
forward+backward >= 10x faster than the loop, <= 1.5x cuDNN's ReLU RNN); writes
bench/results/ops.json with the card, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from orthornn.models.ops import householder_matrix, rnn_scan, rnn_scan_steps

from bench.common import write_result

METHODS = ("fused", "loop", "autograd", "cudnn")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device, reps: int) -> float:
    fn()  # warm-up (and Triton compilation)
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def scan_methods(steps, n, batch, device, columns=()):
    gen = torch.Generator(device="cpu").manual_seed(0)
    u = (torch.randn(batch, steps, n, generator=gen) * 0.1).to(device).requires_grad_()
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen))
    w = q.to(device).requires_grad_()  # orthogonal: states stay bounded over 2000 steps
    rnn = torch.nn.RNN(n, n, nonlinearity="relu", batch_first=True).to(device)

    def op(mode, split="auto"):
        def run():
            os.environ["ORTHORNN_KERNELS"] = mode
            os.environ["ORTHORNN_SCAN_COLUMNS"] = str(split)  # auto: scan.COLUMN_TABLE
            return rnn_scan(u, w, activation="relu")
        return run

    def autograd_loop():
        return rnn_scan_steps(u, lambda h: h @ w.T, torch.relu)

    def cudnn():
        states, h = rnn(u)
        return states, h[0]
    return {"fused": op("triton"), "loop": op("reference"), "autograd": autograd_loop,
            "cudnn": cudnn, **{f"fused_c{c}": op("triton", c) for c in columns}}


def time_scan(steps, n, batch, device, reps, methods, columns=()):
    fns = scan_methods(steps, n, batch, device, columns)
    row = {"T": steps, "n": n, "B": batch}
    if columns:  # what each requested split launches (capped by tiles and residency)
        from orthornn.models.ops import triton_scan

        row["columns_used"] = {c: triton_scan.column_programs(n, batch, c, device)
                               for c in columns}
    for name in [*methods, *(f"fused_c{c}" for c in columns)]:
        fn = fns[name]

        def forward(fn=fn):
            with torch.no_grad():
                fn()

        def both(fn=fn):
            states, last = fn()
            (states.sum() + last.sum()).backward()

        row[f"{name}_fwd_ms"] = median_time(forward, device, reps) * 1e3
        row[f"{name}_fwdbwd_ms"] = median_time(both, device, reps) * 1e3
    return row


def time_householder(n, device, reps):
    y = torch.randn(n, n, device=device).tril()
    v = y / y.diagonal()  # householder_product's unit-diagonal convention
    tau = 2 / (v.tril(-1).square().sum(0) + 1)
    wy = median_time(lambda: householder_matrix(y), device, reps) * 1e3
    lapack = median_time(lambda: torch.linalg.householder_product(v, tau), device, reps) * 1e3
    return {"n": n, "compact_wy_ms": wy, "householder_product_ms": lapack}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[128, 784, 2000])
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--columns", type=int, nargs="*", default=[],
                        help="also time the fused scan split over these column programs")
    parser.add_argument("--tf32", action="store_true",
                        help="allow TF32 tensor cores in fp32 matmuls (cuBLAS and tl.dot)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny grid on the CPU through the Triton interpreter")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "results" / "ops.json")
    args = parser.parse_args(argv)
    if min(*args.steps, *args.hidden, *args.batch, *args.columns, args.reps) < 1:
        parser.error("--steps, --hidden, --batch, --columns and --reps must be positive")
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
        # n = 40 streams W in tiles, so a split (--columns) has columns to split
        hidden = 40 if args.columns else 16
        args.steps, args.hidden, args.batch, args.reps = [5], [hidden], [2], 1
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("bench/perf/ops.py needs a CUDA device (or --smoke to check the script on the CPU)",
              file=sys.stderr)
        return 2

    card = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine())
    print(f"device: {card}; torch {torch.__version__}; fp32 matmul precision "
          f"{torch.get_float32_matmul_precision()}", file=sys.stderr)
    rows = []
    for steps in args.steps:
        for n in args.hidden:
            for batch in args.batch:
                rows.append(time_scan(steps, n, batch, device, args.reps, args.methods,
                                      args.columns))
                print(f"done T={steps} n={n} B={batch}", file=sys.stderr)
    wy_rows = [time_householder(n, device, args.reps) for n in args.hidden]

    names = [*args.methods, *(f"fused_c{c}" for c in args.columns)]
    cols = [f"{m}_{k}_ms" for k in ("fwd", "fwdbwd") for m in names]
    print("\n| T | n | B | " + " | ".join(c.removesuffix("_ms") + " (ms)" for c in cols) + " |")
    print("|" + " --- |" * (3 + len(cols)))
    for row in rows:
        print(f"| {row['T']} | {row['n']} | {row['B']} | "
              + " | ".join(f"{row[c]:.2f}" for c in cols) + " |")
    print("\n| n = m | compact WY (ms) | householder_product (ms) |\n| --- | --- | --- |")
    for row in wy_rows:
        print(f"| {row['n']} | {row['compact_wy_ms']:.3f} | {row['householder_product_ms']:.3f} |")

    if args.columns:  # the fastest split forward + backward: COLUMN_TABLE's candidates
        print("\n| T | n | B | fastest split (fwd+bwd) | its ms | one program's ms |\n"
              "| --- | --- | --- | --- | --- | --- |")
        for row in rows:
            best = min(args.columns, key=lambda c: row[f"fused_c{c}_fwdbwd_ms"])
            row["fastest_columns"] = row["columns_used"][best]
            one = row.get("fused_c1_fwdbwd_ms", float("nan"))
            print(f"| {row['T']} | {row['n']} | {row['B']} | {row['fastest_columns']} | "
                  f"{row[f'fused_c{best}_fwdbwd_ms']:.2f} | {one:.2f} |")

    targets = {}
    point = [r for r in rows if (r["T"], r["n"], r["B"]) == (784, 128, 64)]
    if point and {"fused", "loop", "cudnn"} <= set(args.methods):
        p = point[0]
        targets = {"loop_over_fused_fwdbwd": p["loop_fwdbwd_ms"] / p["fused_fwdbwd_ms"],
                   "fused_over_cudnn_fwdbwd": p["fused_fwdbwd_ms"] / p["cudnn_fwdbwd_ms"]}
        print(f"\nT=784 n=128 B=64: loop / fused (fwd+bwd) = "
              f"{targets['loop_over_fused_fwdbwd']:.1f}x (target >= 10); fused / cuDNN = "
              f"{targets['fused_over_cudnn_fwdbwd']:.2f} (target <= 1.5)")

    result = {"date": datetime.date.today().isoformat(), "device": card,
              "torch": torch.__version__, "smoke": args.smoke, "reps": args.reps,
              "fp32_matmul_precision": torch.get_float32_matmul_precision(),
              "scan": rows, "householder": wy_rows, "targets": targets}
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
