"""ONNX's RNN operator against a Scan over one step, on onnxruntime's CPU provider.

For every architecture whose cell the RNN operator can express, exports the same model
both ways and times them interleaved in one process at several batch sizes and
lengths; ratio = Scan time / RNN time (above 1: the RNN operator is faster). This is
the measurement behind the exporter's fixed rule (export.exporter.RECURRENCE_RULE):
the export no longer races the two on the exporting machine.

    python bench/perf/recurrence.py [--hidden 128 --reps 20 --out bench/results/recurrence.json]

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from orthornn.export.artifacts.package import session_from_bytes
from orthornn.export.builder.onnx_export import RNN_ACTIVATIONS, build_graph
from orthornn.models import ARCHITECTURES, build_model

from bench.common import write_result


def seconds(sess, feeds, reps: int) -> list[float]:
    sess.run(None, feeds)
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        sess.run(None, feeds)
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" /
                                             "recurrence.json"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for arch, spec in ARCHITECTURES.items():
        if not spec.recurrent or arch == "lstm":
            continue
        model = build_model(arch, "classify", input_size=1, hidden_size=args.hidden,
                            num_outputs=10).eval()
        if model.layer.gates is not None or model.layer.activation.kind not in RNN_ACTIVATIONS:
            continue
        sessions = {kind: session_from_bytes(build_graph(model, "dense", recurrence=kind,
                                                         opset=18).SerializeToString(),
                                             threads=1)
                    for kind in ("rnn", "scan")}
        for batch in args.batches:
            for length in args.lengths:
                feeds = {"x": np.random.default_rng(0).normal(
                    size=(batch, length, 1)).astype(np.float32),
                    "lengths": np.full(batch, length, dtype=np.int64)}
                times = {"rnn": [], "scan": []}
                for _ in range(3):  # interleaved rounds: noise hits both alike
                    for kind, sess in sessions.items():
                        times[kind] += seconds(sess, feeds, max(1, args.reps // 3))
                rnn, scan = (statistics.median(times[k]) for k in ("rnn", "scan"))
                rows.append({"arch": arch, "batch": batch, "length": length,
                             "rnn_ms": rnn * 1e3, "scan_ms": scan * 1e3,
                             "scan_over_rnn": scan / rnn})
    print(f"\nn={args.hidden}, 1 onnxruntime thread; ratio = Scan time / RNN time\n")
    print("| arch | batch | T | RNN ms | Scan ms | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['arch']} | {r['batch']} | {r['length']} | {r['rnn_ms']:.2f} | "
              f"{r['scan_ms']:.2f} | {r['scan_over_rnn']:.2f} |")
    write_result(Path(args.out), {"hidden": args.hidden, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
