"""The papers' long rows at their full budgets, side by side on one GPU, within a budget.

One run of a long row (adding T = 750 / 1000 at 20,000 steps, copy T = 200) keeps a few
of a large GPU's SMs busy (one program per 16 sequences), so many fit on the card at
once. This script starts every seed of every long row of ``reproduce.py --full``
(``LONG``: adding T = 750 and T = 1000 and copy T = 200 for scornn, sgornn, vprnn and
svdrnn; 3 seeds each) as concurrent processes, longest first, at most ``--jobs`` at a
time; when ``--budget`` seconds have passed it stops the ones still running, and it
tabulates what finished with reproduce.py's verdicts (a row short of its seeds says how
many finished). Progress (finished, running, rate and ETA) goes to stderr.

    python bench/experiments/long_rows.py --budget 3600 --device cuda [--jobs 16]
        [--seeds 3] [--only adding,copy] [--arch svdrnn,...] [--runs DIR] [--quick]

``--runs`` keeps the run directories: a seed that finished there earlier is read, not
trained again, so a second call with a new budget goes on where the first stopped.
Writes bench/results/long-rows[-quick].json and .md. ``--quick`` runs each seed for a
handful of steps (a smoke test of the script, not a result).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.common import write_result
from bench.experiments import reproduce

#: (experiment, architecture) of the long rows (issue 63, step 3).
ARCHS = ("scornn", "sgornn", "vprnn", "svdrnn")
LONG = tuple((experiment, arch) for experiment in (
    "adding T=750", "adding T=1000", "copy T=200, every step, 8 symbols") for arch in ARCHS)
#: Seconds a stopped process gets to exit before it is killed.
GRACE = 10.0


def long_rows(groups=("adding", "copy"), archs=None) -> list[dict]:
    """reproduce.py's rows named in ``LONG``, in its order, filtered."""
    wanted = set(LONG)
    return [e for e in reproduce.experiments() if (e["experiment"], e["arch"]) in wanted
            and e["group"] in groups and (archs is None or e["arch"] in archs)]


def cost(row: dict) -> int:
    """A row's relative cost for the launch order: steps x sequence length."""
    from orthornn.training.presets import resolve

    config, _ = resolve({"arch": row["arch"], **row["given"]})
    return (config.steps or 1) * (config.seq_len or 1)


def run_concurrently(tasks: list, target, jobs: int, budget: float, log=print) -> dict:
    """Runs ``target(task)`` for every task in its own process, at most ``jobs`` at once,
    in the order given; after ``budget`` seconds stops (SIGTERM, then SIGKILL after
    ``GRACE``) what still runs and starts nothing more. Returns {task index: "finished"
    (exit 0), "failed" (another exit), "stopped" or "not started"}."""
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked into children
    start = time.monotonic()
    deadline = start + budget
    waiting = list(range(len(tasks)))
    running: dict[int, multiprocessing.Process] = {}
    state: dict[int, str] = {}
    seconds: list[float] = []
    began: dict[int, float] = {}
    while waiting or running:
        while waiting and len(running) < jobs and time.monotonic() < deadline:
            i = waiting.pop(0)
            process = context.Process(target=target, args=(tasks[i],), daemon=True)
            process.start()
            running[i], began[i] = process, time.monotonic()
        for i, process in list(running.items()):
            if process.exitcode is not None:
                process.join()
                del running[i]
                state[i] = "finished" if process.exitcode == 0 else "failed"
                seconds.append(time.monotonic() - began[i])
                done = len(state)
                elapsed = time.monotonic() - start
                mean = sum(seconds) / len(seconds)
                # the jobs left, in waves of `jobs`, each about the mean job's time
                eta = mean * -(-(len(waiting) + len(running)) // max(jobs, 1))
                log(f"[{done}/{len(tasks)} done, {len(running)} running] task {i} "
                    f"{state[i]} after {seconds[-1]:.0f} s; {done / elapsed * 3600:.1f} "
                    f"jobs/h, ETA {eta / 60:.1f} min (budget left "
                    f"{max(deadline - time.monotonic(), 0) / 60:.1f} min)")
        if time.monotonic() >= deadline and (running or waiting):
            for process in running.values():
                process.terminate()
            end = time.monotonic() + GRACE
            for i, process in running.items():
                process.join(max(end - time.monotonic(), 0))
                if process.exitcode is None:
                    process.kill()
                    process.join()
                state[i] = "stopped"
            running.clear()
            for i in waiting:
                state[i] = "not started"
            waiting.clear()
            log(f"budget of {budget:.0f} s reached: stopped the seeds still running")
        time.sleep(0.2)
    return state


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, required=True,
                        help="wall seconds for the whole run; what runs then is stopped")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="processes at once (default: one per CPU core)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per row (default 3)")
    parser.add_argument("--only", default="adding,copy",
                        help="comma-separated groups among adding, copy")
    parser.add_argument("--arch", help=f"comma-separated among {', '.join(ARCHS)} (default all)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quick", action="store_true", help="a few steps each: smoke test")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    parser.add_argument("--runs", type=Path, help="keep the run directories here (a seed "
                        "finished there is read, not trained again)")
    args = parser.parse_args(argv)
    groups = args.only.split(",")
    unknown = sorted(set(groups) - {"adding", "copy"})
    if unknown:
        parser.error(f"--only: unknown group(s) {', '.join(unknown)}; allowed: adding, copy")
    archs = None if not args.arch else set(args.arch.split(","))
    if archs is not None and archs - set(ARCHS):
        parser.error(f"--arch: unknown architecture(s) {', '.join(sorted(archs - set(ARCHS)))}; "
                     f"allowed: {', '.join(ARCHS)}")
    if args.budget <= 0 or args.jobs < 1 or args.seeds < 1:
        parser.error("--budget must be positive, --jobs and --seeds at least 1")
    rows = long_rows(groups, archs)
    runs_root = args.runs or Path(tempfile.mkdtemp(prefix="orthornn-long-rows-"))
    tasks = []
    for i, row in enumerate(rows, 1):
        name = f"{i:02d}-{row['experiment'].split(',')[0].replace(' ', '').replace('=', '')}"
        for seed in range(args.seeds):
            run = runs_root / f"{name}-{row['arch']}-seed{seed}"
            tasks.append((row, seed, str(run), True, args.quick, args.device, False))
    order = sorted(range(len(tasks)), key=lambda k: -cost(tasks[k][0]))  # longest first
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    print(f"{len(tasks)} seeds of {len(rows)} rows, {args.jobs} at a time, budget "
          f"{args.budget:.0f} s; runs in {runs_root}", file=sys.stderr, flush=True)
    # each child trains one seed; its run directory's summary.json is the result
    state = run_concurrently([tasks[k] for k in order], reproduce._train_one, args.jobs,
                             args.budget,
                             log=lambda line: print(line, file=sys.stderr, flush=True))
    outcome = {order[i]: s for i, s in state.items()}
    results, unfinished = [], []
    for i, row in enumerate(rows):
        seeds, missing = [], []
        for k in range(i * args.seeds, (i + 1) * args.seeds):
            done = reproduce._train_one((*tasks[k][:-1], True))  # reads the summary only
            if done is not None:
                seeds.append(done)
            else:
                missing.append(f"seed {tasks[k][1]} {outcome.get(k, 'not started')}")
        if seeds:
            results.append({**reproduce.summarize(row, seeds), "seeds_finished": len(seeds),
                            "seeds_wanted": args.seeds})
        if missing:
            unfinished.append(f"{row['experiment']} {row['arch']}: {', '.join(missing)}")
    text = reproduce.table(results)
    short = [r for r in results if r["seeds_finished"] < args.seeds]
    if short:
        text += ("\n\nRows with fewer seeds than asked (n in the table): "
                 + "; ".join(f"{r['experiment']} {r['arch']}" for r in short) + ".")
    if unfinished:
        text += "\n\nNot finished within the budget: " + "; ".join(unfinished) + "."
    print(text)
    total = time.perf_counter() - start
    print(f"total wall time {total / 60:.1f} min ({args.jobs} jobs)", file=sys.stderr)
    suffix = "-quick" if args.quick else ""
    write_result(args.out / f"long-rows{suffix}.json",
                 {"rows": results, "unfinished": unfinished, "budget_s": args.budget,
                  "wall_seconds": round(total, 1), "jobs": args.jobs, "seeds": args.seeds,
                  "device": args.device, "cpu_count": os.cpu_count()})
    (args.out / f"long-rows{suffix}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
