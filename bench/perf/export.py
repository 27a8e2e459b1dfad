"""onnxruntime (CPU execution provider) against torch eager on the CPU.

For every recurrent architecture and both export modes: inference time of a
classifier (T = 128, n = 128, 8 features) at batch 1 and 64, as the ratio
torch time / onnxruntime time (above 1: onnxruntime is faster), medians of
interleaved repetitions in one process. Also the model file size of the dense and
the factored export of svdrnn with n = 512 and 16 reflectors (m1 = m2 = 8).

    python bench/perf/export.py [--reps 20] [--steps 128] [--hidden 128]

Prints a table and writes bench/results/export.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from orthornn.export.artifacts.package import session_from_bytes
from orthornn.export.builder.golden import choose_recurrence
from orthornn.export.builder.onnx_export import build_graph
from orthornn.models import ARCHITECTURES, build_model

from bench.common import seconds, write_result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--big-hidden", type=int, default=512)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "results" / "export.json")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    rows = []
    for arch in [a for a in ARCHITECTURES if ARCHITECTURES[a].recurrent]:
        model = build_model(arch, "classify", input_size=8, hidden_size=args.hidden,
                            num_outputs=10).eval()
        for mode in ("dense", "factored"):
            recurrence, proto = choose_recurrence(model, mode, 18)
            sess = session_from_bytes(proto.SerializeToString())
            for batch in batches:
                x = torch.randn(batch, args.steps, 8)
                lengths = torch.full((batch,), args.steps)
                feeds = {"x": x.numpy(), "lengths": lengths.numpy().astype(np.int64)}

                def eager(x=x, lengths=lengths, model=model):
                    with torch.no_grad():
                        model(x, lengths=lengths)

                def ort(feeds=feeds, sess=sess):
                    sess.run(None, feeds)
                eager()
                ort()
                ratios, ort_times = [], []
                for _ in range(args.reps):
                    t_torch, t_ort = seconds(eager), seconds(ort)
                    ratios.append(t_torch / t_ort)
                    ort_times.append(t_ort)
                rows.append({"arch": arch, "mode": mode, "recurrence": recurrence,
                             "batch": batch, "torch_over_ort": statistics.median(ratios),
                             "ort_ms": statistics.median(ort_times) * 1e3})
        print(f"{arch} done", file=sys.stderr)

    big = build_model("svdrnn", "classify", input_size=8, hidden_size=args.big_hidden,
                      num_outputs=10, m1=8, m2=8).eval()
    sizes = {mode: len(build_graph(big, mode).SerializeToString()) for mode in ("dense",
                                                                                "factored")}

    print(f"\nonnxruntime CPU vs torch eager CPU, classifier T={args.steps} n={args.hidden}, "
          f"{torch.get_num_threads()} threads; ratio = torch time / onnxruntime time\n")
    header = "| arch | mode | recurrence | " + " | ".join(f"batch {b}" for b in batches) + " |"
    print(header)
    print("| --- | --- | --- | " + " | ".join("---:" for _ in batches) + " |")
    for arch in dict.fromkeys(r["arch"] for r in rows):
        for mode in ("dense", "factored"):
            cells = [r for r in rows if r["arch"] == arch and r["mode"] == mode]
            values = " | ".join(f"{r['torch_over_ort']:.2f}x ({r['ort_ms']:.1f} ms)"
                                for r in cells)
            print(f"| {arch} | {mode} | {cells[0]['recurrence']} | {values} |")
    print(f"\nsvdrnn n={args.big_hidden}, 16 reflectors: dense {sizes['dense'] / 1e6:.2f} MB, "
          f"factored {sizes['factored'] / 1e6:.2f} MB "
          f"({sizes['dense'] / sizes['factored']:.1f}x smaller)")
    write_result(args.out, {"steps": args.steps, "hidden": args.hidden, "rows": rows,
                            "svdrnn_512_bytes": sizes})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
