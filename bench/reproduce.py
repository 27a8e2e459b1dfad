"""Reproduce the papers' experiments at a size that fits 2 CPU cores (~30 min).

Trains each configuration with orthornn's own trainer and prints this project's
test numbers beside the papers' and the task baselines:

* adding, T = 200 (500 with --full): svdrnn, scornn, sgornn, lstm; the orthogonal
  models must fall well below the baseline MSE 0.167.
* copy, T = 100 (1000 with --full): svdrnn, scornn, dizzyrnn, lstm; the orthogonal
  models must beat the baseline cross-entropy 10 log 8 / (T + 20).
* UCR ArrowHead, GunPoint, ItalyPowerDemand: svdrnn with n = 32 and 16 reflectors
  (m1 = m2 = 8) against the Spectral-RNN paper's table (0.800, 0.960, 0.973).
* permuted-digits and the word-level LM: svdrnn, scornn, sgornn against an lstm of
  similar parameter count.

    python bench/reproduce.py [--full] [--only adding,copy,ucr,digits,lm] [--quick]

Writes bench/results/reproduce.json and bench/results/reproduce.md (the table).
``--quick`` runs every configuration for a handful of steps (a smoke test, not a
result).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from orthornn.training.config import TrainConfig
from orthornn.training.trainer import train

from bench.common import write_result

GROUPS = ("adding", "copy", "ucr", "digits", "lm")


def experiments(full: bool) -> list[dict]:
    """(group, label, paper value or claim, config) for every run."""
    adding_t, copy_t = (500, 1000) if full else (200, 100)
    scale = 5 if full else 1
    rows = []
    for arch, opts in [("svdrnn", {}), ("scornn", {"orthogonal_lr": 1e-3}), ("sgornn", {}),
                       ("lstm", {})]:
        rows.append(("adding", f"adding T={adding_t}", arch, "MSE well below 0.167",
                     dict(task="adding", seq_len=adding_t, hidden_size=64, steps=2000 * scale,
                          batch_size=64, optimizer="adam", lr=1e-2, log_every=250,
                          eval_batch_size=500, **opts)))
    for arch, opts in [("svdrnn", {}), ("scornn", {"orthogonal_lr": 1e-4}),
                       ("dizzyrnn", {"arch_options": {"rotations": 10}}), ("lstm", {})]:
        rows.append(("copy", f"copy T={copy_t}", arch, "CE below the baseline",
                     dict(task="copy", seq_len=copy_t, hidden_size=128, steps=1500 * scale,
                          batch_size=64, optimizer="rmsprop", lr=1e-3, log_every=250,
                          eval_batch_size=500, **opts)))
    for dataset, paper in [("ArrowHead", 0.800), ("GunPoint", 0.960), ("ItalyPowerDemand", 0.973)]:
        rows.append(("ucr", f"UCR {dataset}", "svdrnn", paper,
                     dict(task="ucr", dataset=dataset, hidden_size=32, batch_size=16,
                          steps=2000 * scale, optimizer="adam", lr=3e-3, log_every=50,
                          arch_options={"m1": 8, "m2": 8, "r": 0.01})))
    # lstm sized to a parameter count like the orthogonal models' (see the params column)
    scornn_opts = {"optimizer": "rmsprop", "lr": 1e-3, "orthogonal_lr": 1e-4}
    for arch, hidden, opts in [("svdrnn", 128, {}), ("scornn", 128, scornn_opts),
                               ("sgornn", 128, {}), ("lstm", 56, {})]:
        rows.append(("digits", "permuted-digits", arch, None,
                     dict(task="permuted-digits", hidden_size=hidden, epochs=40 * scale,
                          batch_size=64, **{"optimizer": "adam", "lr": 2e-3, **opts},
                          log_every=100)))
    for arch, hidden, opts in [("svdrnn", 128, {}), ("scornn", 128, scornn_opts),
                               ("sgornn", 128, {}), ("lstm", 64, {})]:
        rows.append(("lm", "word LM (wiki+news)", arch, None,
                     dict(task="lm", hidden_size=hidden, vocab_size=5000, bptt=35,
                          batch_size=32, epochs=1 * scale, **{"optimizer": "adam", "lr": 2e-3,
                                                              **opts},
                          log_every=100, embedding_size=128)))
    return [{"group": g, "experiment": e, "arch": a, "paper": p, "config": c}
            for g, e, a, p, c in rows]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="paper-size runs (for a GPU)")
    parser.add_argument("--quick", action="store_true", help="a few steps each: smoke test")
    parser.add_argument("--only", default=",".join(GROUPS),
                        help=f"comma-separated groups among {', '.join(GROUPS)}")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--runs", type=Path, help="keep the run directories here")
    args = parser.parse_args(argv)
    groups = args.only.split(",")
    bad = sorted(set(groups) - set(GROUPS))
    if bad:
        parser.error(f"--only: unknown group(s) {', '.join(bad)}; allowed: {', '.join(GROUPS)}")

    chosen = [e for e in experiments(args.full) if e["group"] in groups]
    runs_root = args.runs or Path(tempfile.mkdtemp(prefix="orthornn-reproduce-"))
    results = []
    for i, exp in enumerate(chosen, 1):
        config = dict(exp["config"])
        if args.quick:
            config.pop("epochs", None)
            config.update(steps=3, log_every=3)
            if config["task"] == "lm":
                config["vocab_size"] = 200
        run_dir = runs_root / f"{i:02d}-{exp['experiment'].split()[0]}-{exp['arch']}"
        start = time.perf_counter()
        print(f"[{i}/{len(chosen)}] {exp['experiment']} {exp['arch']} ...", file=sys.stderr,
              flush=True)
        summary = train(TrainConfig(arch=exp["arch"], out=str(run_dir), device=args.device,
                                    **config), progress=sys.stderr.isatty())
        metric = summary["metric"]
        row = {**{k: exp[k] for k in ("group", "experiment", "arch", "paper")},
               "metric": metric, "value": summary["test"][metric],
               "extra": {k: v for k, v in summary["test"].items() if k not in ("loss", metric)},
               "baseline": summary["baseline"], "parameters": summary["parameters"],
               "steps": summary["steps"], "seconds": round(time.perf_counter() - start, 1)}
        results.append(row)
        print(f"    test {metric} = {row['value']:.4f} ({row['seconds']} s)", file=sys.stderr)

    header = "| experiment | arch | params | metric | orthornn | paper | baseline | steps | s |"
    lines = [header, "| --- | --- | ---: | --- | ---: | --- | ---: | ---: | ---: |"]
    for r in results:
        paper = "" if r["paper"] is None else (f"{r['paper']:.3f}" if isinstance(r["paper"], float)
                                               else r["paper"])
        extra = "".join(f" ({k} {v:.3f})" for k, v in r["extra"].items())
        baseline = "" if r["baseline"] is None else f"{r['baseline']:.3f}"
        lines.append(f"| {r['experiment']} | {r['arch']} | {r['parameters']:,} | {r['metric']} | "
                     f"{r['value']:.3f}{extra} | {paper} | {baseline} | {r['steps']} | "
                     f"{r['seconds']:.0f} |")
    table = "\n".join(lines)
    print(table)
    suffix = "-quick" if args.quick else "-full" if args.full else ""
    write_result(args.out / f"reproduce{suffix}.json", results)
    (args.out / f"reproduce{suffix}.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
