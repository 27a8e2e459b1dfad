"""Reproduce the papers' headline results from the task presets, over seeds.

Every row trains one architecture on one task with that task's preset (training/presets/table.py:
the papers' recipes) for 3 seeds and reports the mean +- sd of the test metric with the
budget beside it (optimizer steps and wall seconds per seed), the paper's figure and a
verdict:

* reproduced: the mean reaches the paper's figure (within 0.01) or its claim;
* close: within 0.05 of the figure, or past the baseline but short of the claim (a
  claim on a secondary metric, DizzyRNN's copy accuracy: within 0.05 of it);
* budget-limited: short of that after fewer steps than the paper's recipe runs;
* not reproduced: short of it with the paper's budget.

The default run (``--jobs 2``) shortens the generated tasks' budgets for 2 CPU cores
(measured: 18 minutes on 2 idle cores, 44 beside other jobs); each row says how many steps
it ran against the preset's; ``--full`` runs the presets' (the papers') budgets
and every architecture of every row (for a GPU).

    python bench/experiments/reproduce.py [--full] [--only copy,ucr,...] [--seeds 3] [--jobs 2]
        [--quick]

Writes bench/results/reproduce[-full|-quick].json and .md (the README's table).
``--quick`` runs every configuration for a handful of steps (a smoke test, not a result).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.common import write_result

GROUPS = ("copy", "ucr", "har", "digits", "adding", "lm")


def _row(group, label, arch, given, budget, paper=None, claim=None, source="", full_only=False,
         claim_metric=None):
    """given: the task and its data options; budget: the CPU budget (overrides of the
    preset's steps/epochs and, for lm, its size); paper: a figure (higher is better);
    claim: (target, text) for lower-is-better metrics (MSE, cross-entropy), or, with
    claim_metric (a higher-is-better secondary metric such as copy_accuracy), the
    target of that metric."""
    return {"group": group, "experiment": label, "arch": arch, "given": given,
            "budget": budget, "paper": paper, "claim": claim, "source": source,
            "full_only": full_only, "claim_metric": claim_metric}


# Arjovsky et al.'s copy task, as Spectral-RNN sec. 7.1 and scoRNN sec. 5.1 run it: the
# cross-entropy of every step, 8 data symbols (training/tasks/generated.py); DizzyRNN's preset
# scores the copied portion only (sec. 6), so its Arjovsky rows name the variant.
ARJOVSKY = {"copy_loss": "all", "copy_symbols": 8}


def experiments() -> list[dict]:
    rows = []
    for t, steps in ((200, 800), (750, 500)):
        for arch in ("svdrnn", "scornn", "sgornn", "vprnn", "lstm"):
            rows.append(_row("adding", f"adding T={t}", arch, {"task": "adding", "seq_len": t},
                             {"steps": steps, "log_every": 100, "eval_batch_size": 500},
                             claim=(0.05, "MSE <= 0.05 (to ~0: scoRNN Fig. 2, SGORNN Fig. 1)"),
                             full_only=arch == "vprnn" or (
                                 t == 750 and arch in ("svdrnn", "lstm"))))
    for t, steps in ((1000, 20000), (5000, 20000)):  # SGORNN sec. 3.1, Figs. 2-3
        for arch in ("sgornn", "vprnn", *(("scornn", "svdrnn") if t == 1000 else ())):
            rows.append(_row("adding", f"adding T={t}", arch, {"task": "adding", "seq_len": t},
                             {"steps": steps, "log_every": 100, "eval_batch_size": 500},
                             claim=(0.05, "MSE <= 0.05 (SGORNN sec. 3.1, Figs. 2-3: "
                                          "SGORNN converges, VPRNN at most partly)"),
                             full_only=True))
    for t, steps in ((100, 2000), (200, 1500)):
        for arch in ("svdrnn", "scornn", "dizzyrnn", "lstm",
                     *(("sgornn", "vprnn") if t == 200 else ())):
            rows.append(_row("copy", f"copy T={t}, every step, 8 symbols", arch,
                             {"task": "copy", "seq_len": t, **ARJOVSKY},
                             # dizzyrnn: its preset's budget (DizzyRNN sec. 6: 1,000 steps
                             # of 100), the same as its copied-portion row's
                             {"steps": None if arch == "dizzyrnn" else steps,
                              "log_every": 250, "eval_batch_size": 500},
                             claim=("half", "CE < baseline / 2 (Spectral-RNN Fig. 2: svdRNN "
                                            "beats every model)"),
                             full_only=t == 200 and arch in ("dizzyrnn", "lstm", "sgornn",
                                                             "vprnn")))
    rows.append(_row("copy", "copy T=90, copied portion, 10 symbols (DizzyRNN sec. 6)",
                     "dizzyrnn", {"task": "copy"}, {"log_every": 100, "eval_batch_size": 500},
                     claim=(0.95, "copy accuracy >= 0.95 in 1,000 steps (DizzyRNN sec. 6: "
                                  "near perfect in under 100 epochs)"),
                     claim_metric="copy_accuracy"))
    for dataset, paper in (("ArrowHead", 0.800), ("GunPoint", 0.960),
                           ("ItalyPowerDemand", 0.973)):
        rows.append(_row("ucr", f"UCR {dataset}", "svdrnn", {"task": "ucr", "dataset": dataset},
                         {}, paper=paper, source="Spectral-RNN Table 4"))
    for arch, paper in (("sgornn", 0.9407), ("svdrnn", None), ("scornn", None),
                        ("lstm", 0.9345)):
        rows.append(_row("har", "UEA BasicMotions (HAR-2 stand-in)", arch,
                         {"task": "ucr", "dataset": "BasicMotions"}, {}, paper=paper,
                         source="SGORNN Table 2, HAR-2 (another data set)"))
    for arch, paper in (("svdrnn", None), ("scornn", 0.943), ("sgornn", None),
                        ("vprnn", None), ("lstm", None)):
        rows.append(_row("digits", "permuted-digits", arch, {"task": "permuted-digits"}, {},
                         paper=paper, source="scoRNN Table 1, permuted MNIST (28x28)"
                         if paper else ""))
    for arch in ("svdrnn", "scornn", "sgornn", "lstm"):
        rows.append(_row("lm", "word LM (wiki+news)", arch, {"task": "lm"},
                         {"steps": 200, "epochs": None, "bptt": 70, "vocab_size": 5000,
                          "hidden_size": 128, "embedding_size": 128, "log_every": 100},
                         source="PTB in the papers: not comparable"))
    return rows


def _train_one(args: tuple) -> dict:
    """One seed of one row, in its own process (one thread)."""
    row, seed, run_dir, full, quick, device, collect = args
    import torch

    torch.set_num_threads(1)
    from orthornn.training.presets import resolve
    from orthornn.training.trainer import train

    # one thread a job: train() would otherwise take the cores idle at its start, every
    # job all of them at once (the same numbers at any thread count, only slower: an
    # ArrowHead seed took 267 s instead of 34)
    given = {"arch": row["arch"], **row["given"], "seed": seed, "out": run_dir,
             "device": device, "threads": 1}
    preset, _ = resolve(dict(given))
    paper_budget = (f"{preset.steps} steps" if preset.steps is not None
                    else f"{preset.epochs:g} epochs")
    if not full:
        given.update({k: v for k, v in row["budget"].items() if v is not None or k == "epochs"})
    if quick:
        given.update(steps=3, epochs=None, log_every=3)
        if row["given"]["task"] == "lm":
            given.update(vocab_size=200, bptt=20, hidden_size=16, embedding_size=16)
    config, _ = resolve(given)
    done = Path(run_dir) / "summary.json"
    if done.is_file():  # a finished seed of an earlier (interrupted) run: read, not rerun
        summary = json.loads(done.read_text())
    elif collect:
        return None
    else:
        summary = train(config, progress=False)
    curve = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text()
             .splitlines()]
    metric = summary["metric"]
    return {"seed": seed, "value": summary["test"][metric], "metric": metric,
            "extra": {k: v for k, v in summary["test"].items() if k not in ("loss", metric)},
            "baseline": summary["baseline"], "parameters": summary["parameters"],
            "steps": summary["steps"], "paper_budget": paper_budget,
            "paper_steps": preset.steps if preset.steps is not None else (
                summary["steps"] if not full and "epochs" not in row["budget"] else None),
            "seconds": round(summary["seconds"], 1),
            "curve": [(r["step"], r.get(f"val_{metric}")) for r in curve]}


def verdict(row: dict, mean: float, steps: int, paper_steps: int | None,
            baseline: float | None, claimed: float | None = None) -> str:
    """claimed: the mean of row['claim_metric'] when the claim is on that metric."""
    limited = paper_steps is not None and steps < paper_steps
    if row.get("claim_metric"):  # a target of a secondary, higher-is-better metric
        if claimed >= row["claim"][0]:
            return "reproduced"
        if claimed >= row["claim"][0] - 0.05:
            return "close"
        short = "budget-limited" if limited else "not reproduced"
        return short + (" (below baseline)" if baseline is not None and mean < baseline else "")
    if row["paper"] is not None:
        if mean >= row["paper"] - 0.01:
            return "reproduced"
        if mean >= row["paper"] - 0.05:
            return "close"
        return "budget-limited" if limited else "not reproduced"
    if row["claim"] is not None:
        target = baseline / 2 if row["claim"][0] == "half" else row["claim"][0]
        if mean <= target:
            return "reproduced"
        if baseline is not None and mean < baseline:
            return "close" if not limited else "budget-limited (below baseline)"
        return "budget-limited" if limited else "not reproduced"
    return "no paper figure"


def summarize(row: dict, seeds: list[dict]) -> dict:
    values = [s["value"] for s in seeds]
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    first = seeds[0]
    extra = {k: statistics.fmean(s["extra"][k] for s in seeds) for k in first["extra"]}
    return {**{k: row[k] for k in ("group", "experiment", "arch", "paper", "source")},
            "claim": None if row["claim"] is None else row["claim"][1],
            "metric": first["metric"], "mean": mean, "sd": sd, "values": values,
            "extra": extra, "baseline": first["baseline"], "parameters": first["parameters"],
            "steps": first["steps"], "paper_steps": first["paper_steps"],
            "paper_budget": first["paper_budget"],
            "seconds_per_seed": statistics.fmean(s["seconds"] for s in seeds),
            "verdict": verdict(row, mean, first["steps"], first["paper_steps"],
                               first["baseline"], extra.get(row.get("claim_metric"))),
            "curves": {s["seed"]: s["curve"] for s in seeds}}


def table(results: list[dict]) -> str:
    lines = ["| experiment | arch | params | metric | orthornn (mean +- sd, n seeds) | paper "
             "| baseline | steps (preset's) | s / seed | verdict |",
             "| --- | --- | ---: | --- | ---: | --- | ---: | ---: | ---: | --- |"]
    for r in results:
        paper = (f"{r['paper']:.3f}" if r["paper"] is not None else r["claim"] or "")
        if r["source"] and r["paper"] is not None:
            paper += f" ({r['source']})"
        extra = "".join(f"; {k} {v:.3f}" for k, v in r["extra"].items())
        baseline = "" if r["baseline"] is None else f"{r['baseline']:.3f}"
        budget = f"{r['steps']}" + ("" if r["paper_steps"] == r["steps"]
                                    else f" ({r['paper_budget']})")
        lines.append(f"| {r['experiment']} | {r['arch']} | {r['parameters']:,} | {r['metric']} | "
                     f"{r['mean']:.3f} +- {r['sd']:.3f} (n={len(r['values'])}){extra} | "
                     f"{paper} | {baseline} | {budget} | {r['seconds_per_seed']:.0f} | "
                     f"{r['verdict']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true",
                        help="the presets' (papers') budgets and every row (for a GPU)")
    parser.add_argument("--quick", action="store_true", help="a few steps each: smoke test")
    parser.add_argument("--only", default=",".join(GROUPS),
                        help=f"comma-separated groups among {', '.join(GROUPS)}")
    parser.add_argument("--arch", help="comma-separated architectures (default all)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per row (default 3)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (one thread each)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    parser.add_argument("--runs", type=Path, help="keep the run directories here; a seed whose "
                        "run directory holds a summary is read instead of trained again")
    parser.add_argument("--collect", action="store_true",
                        help="train nothing: tabulate the finished seeds in --runs (rows "
                        "missing a seed are listed as not run)")
    args = parser.parse_args(argv)
    groups = args.only.split(",")
    bad = sorted(set(groups) - set(GROUPS))
    if bad:
        parser.error(f"--only: unknown group(s) {', '.join(bad)}; allowed: {', '.join(GROUPS)}")
    if args.seeds < 1 or args.jobs < 1:
        parser.error("--seeds and --jobs must be at least 1")
    archs = None if not args.arch else set(args.arch.split(","))
    chosen = [e for e in experiments() if e["group"] in groups
              and (args.full or not e["full_only"]) and (archs is None or e["arch"] in archs)]
    chosen.sort(key=lambda e: GROUPS.index(e["group"]))  # stable: the rows' order within
    runs_root = args.runs or Path(tempfile.mkdtemp(prefix="orthornn-reproduce-"))
    tasks = []
    for i, row in enumerate(chosen, 1):
        name = f"{i:02d}-{row['experiment'].split()[0]}-{row['arch']}"
        label = re.sub(r"[^A-Za-z0-9.]+", "_", row["experiment"].replace("=", "")).strip("_")
        for seed in range(args.seeds):
            run = runs_root / f"{name}-{label}-seed{seed}"
            tasks.append((row, seed, str(run), args.full, args.quick, args.device,
                          args.collect))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    if args.jobs == 1:
        outcomes = []
        for k, t in enumerate(tasks, 1):
            print(f"[{k}/{len(tasks)}] {t[0]['experiment']} {t[0]['arch']} seed {t[1]}",
                  file=sys.stderr, flush=True)
            outcomes.append(_train_one(t))
    else:
        with ProcessPoolExecutor(args.jobs) as pool:
            outcomes = list(pool.map(_train_one, tasks))
    results, missing = [], []
    for i, row in enumerate(chosen):
        seeds = outcomes[i * args.seeds:(i + 1) * args.seeds]
        if any(s is None for s in seeds):
            missing.append(f"{row['experiment']} {row['arch']}")
            continue
        results.append(summarize(row, seeds))
        r = results[-1]
        print(f"{r['experiment']} {r['arch']}: {r['metric']} {r['mean']:.4f} +- {r['sd']:.4f} "
              f"({r['steps']} steps, {r['seconds_per_seed']:.0f} s/seed) {r['verdict']}",
              file=sys.stderr)
    text = table(results)
    if missing:
        text += ("\n\nNot run (no finished seeds in time): " + "; ".join(missing)
                 + ".")
    print(text)
    total = time.perf_counter() - start
    print(f"total wall time {total / 60:.1f} min ({args.jobs} jobs)", file=sys.stderr)
    suffix = "-quick" if args.quick else "-full" if args.full else ""
    write_result(args.out / f"reproduce{suffix}.json",
                 {"rows": results, "not_run": missing, "wall_seconds": round(total, 1),
                  "jobs": args.jobs, "seeds": args.seeds, "full": args.full, "groups": groups,
                  "cpu_count": os.cpu_count(), "device": args.device})
    (args.out / f"reproduce{suffix}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
