"""Which CPU numerics settings change the quickstart's word model, and its served answers.

Trains the quickstart's word model (svdRNN n=128 language model, ``DEFAULT_MODELS["words"]``)
once per numerics setting that can differ between x86-64 CPUs (MKL's branch, MKL's
instruction cap, ATen's capability, oneDNN), each in a fresh process (MKL and ATen read
their variables once), two at a time at one thread each. For each it records the trained
weights' sha256, the training speed against the quickstart's setting in the same run,
and what ``orthornn serve`` answers to every words example of the docs (the same curl
commands, the model name swapped). Then, for each setting's graph, it checks whether
onnxruntime's own options (intra-op threads 1 or 2, graph optimisations on or off)
change the logits. The docs' table (docs/training.md, "Across CPUs") comes from this.

    python bench/experiments/numerics.py [--steps N] [--settings a,b,...] [--jobs 2] [--keep DIR]
                                         [--precision float32|float64]
                                         [--out bench/results/numerics.json]

--steps shortens the run (the default is the quickstart's: one epoch); --precision trains
in another dtype than the quickstart's (float64; float32 shows how far single precision
moves). Each row also gives how far its weights and its answers (every number of every
example) are from the first setting's. Prints a table, writes JSON and a markdown table
beside it (numerics.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import chosen_rows, write_result  # noqa: E402
from orthornn.quickstart import DEFAULT_MODELS  # noqa: E402

#: name: (environment, oneDNN left on during training, CPU flag the setting needs). The
#: first is the quickstart's (nothing pinned: what `orthornn train` does, MKL_CBWR set by
#: orthornn per vendor); each other changes one knob of it, but the last two, which are
#: the quickstart's pins before this table was made and the one candidate with no code path
#: chosen by instruction set. Every variable named here is removed before a setting's own
#: are set.
SETTINGS: dict[str, tuple[dict[str, str], bool, str | None]] = {
    "quickstart": ({}, False, None),
    "mkl-compatible": ({"MKL_CBWR": "COMPATIBLE,STRICT"}, False, None),
    "mkl-auto": ({"MKL_CBWR": "AUTO,STRICT"}, False, None),
    "mkl-avx2": ({"MKL_CBWR": "AVX2,STRICT"}, False, "avx2"),
    "mkl-avx512": ({"MKL_CBWR": "AVX512,STRICT"}, False, "avx512f"),
    "mkl-instructions-avx2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, False, "avx2"),
    "aten-default": ({"ATEN_CPU_CAPABILITY": "default"}, False, None),
    "aten-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, False, "avx2"),
    "aten-avx512": ({"ATEN_CPU_CAPABILITY": "avx512"}, False, "avx512f"),
    "onednn-on": ({}, True, None),
    "compatible-avx2": ({"MKL_CBWR": "COMPATIBLE,STRICT", "ATEN_CPU_CAPABILITY": "avx2"},
                        False, "avx2"),
    "compatible-default": ({"MKL_CBWR": "COMPATIBLE,STRICT", "ATEN_CPU_CAPABILITY": "default"},
                           False, None),
}
VARIABLES = {"MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY"}


def cpu() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo."""
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == "unknown":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return name, flags


def environment(setting: str) -> dict[str, str]:
    """The process environment of SETTING."""
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    env.update(SETTINGS[setting][0])
    env["PYTHONPATH"] = str(ROOT)
    return env


def train_worker(run: str, steps: int | None, onednn: bool, precision: str | None = None
                 ) -> None:
    """In the setting's process: train the quickstart's word model into RUN."""
    import torch

    if onednn:  # the trainer turns oneDNN off; keep it on for this setting
        mkldnn = type(torch.backends.mkldnn)
        mkldnn.enabled = torch.backends.ContextProp(torch._C._get_mkldnn_enabled,
                                                    lambda _: None)
    from orthornn.training.config import TrainConfig
    from orthornn.training.trainer import train

    options = dict(DEFAULT_MODELS["words"])
    if precision is not None:
        options["precision"] = precision
    if steps is not None:
        options.pop("epochs")
        options.update(steps=steps, log_every=steps)
    train(TrainConfig(out=run, **options), progress=False)


def train_setting(setting: str, steps: int | None, work: Path, repo: Path,
                  precision: str | None = None) -> dict:
    run = work / setting
    _, onednn, _ = SETTINGS[setting]
    if (run / "summary.json").is_file() and (repo / f"words-{setting}").is_dir():
        return summarise_run(setting, run)  # kept from an earlier run (--keep)
    command = [sys.executable, str(Path(__file__).resolve()), "--train-worker", str(run)]
    if steps is not None:
        command += ["--steps", str(steps)]
    if onednn:
        command.append("--onednn")
    if precision is not None:
        command += ["--precision", precision]
    done = subprocess.run(command, env=environment(setting), cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{setting}: training failed:\n{done.stderr[-2000:]}")
    subprocess.run([sys.executable, "-m", "orthornn", "export", str(run), "--repo", str(repo),
                    "--name", f"words-{setting}"], env=environment("quickstart"), cwd=ROOT,
                   capture_output=True, text=True, check=True)
    return summarise_run(setting, run)


def summarise_run(setting: str, run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    weights = (run / "model.safetensors").read_bytes()
    return {"setting": setting, "environment": SETTINGS[setting][0], "onednn": SETTINGS[setting][1],
            "sha256": hashlib.sha256(weights).hexdigest(),
            "steps": summary["steps"], "seconds": summary["seconds"],
            "cpu_capability": summary["numerics"]["cpu_capability"],
            "precision": summary["numerics"].get("precision", "float32"),
            "test_perplexity": summary["test"].get("perplexity")}


def weights_apart(one: Path, other: Path) -> float:
    """The largest |difference| between two runs' weights (model.safetensors)."""
    from safetensors.numpy import load_file

    a, b = load_file(one / "model.safetensors"), load_file(other / "model.safetensors")
    return float(max(abs(a[k].astype("float64") - b[k].astype("float64")).max() for k in a))


def numbers(value) -> list[float]:
    """Every number in an answer, depth first."""
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers(v)]
    return [float(value)] if isinstance(value, int | float) and not isinstance(value, bool) \
        else []


def words(value):
    """An answer without its numbers: the tokens, ids' places, text, finish reason."""
    if isinstance(value, dict):
        return {k: words(v) for k, v in value.items() if k not in ("model", "version")}
    if isinstance(value, list):
        return [words(v) for v in value]
    return None if isinstance(value, int | float) and not isinstance(value, bool) else value


def answers_apart(one: list, other: list) -> float:
    """The largest |difference| between two settings' numbers (probabilities, perplexities,
    ids), or infinity when their words differ."""
    if words(one) != words(other):
        return float("inf")
    a, b = numbers(one), numbers(other)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def words_examples() -> list[str]:
    """The docs' curl commands that ask the words model (tests/readme_examples finds them)."""
    from tests.readme_examples import examples

    return [e.command for e in examples() if '"model": "words"' in e.command]


def serve_answers(repo: Path, settings: list[str]) -> dict[str, list]:
    """Each setting's answers to the docs' words examples, from one orthornn serve."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "orthornn", "serve", "--repo", str(repo),
                             "--port", str(port), "--log-level", "warning"], cwd=ROOT,
                            env=environment("quickstart"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("orthornn serve did not become ready")
            time.sleep(0.3)
        answers: dict[str, list] = {}
        for setting in settings:
            answers[setting] = []
            for command in words_examples():
                command = re.sub(r"(localhost|127\.0\.0\.1):8000", f"127.0.0.1:{port}", command)
                command = command.replace('"model": "words"', f'"model": "words-{setting}"')
                out = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                                     timeout=60).stdout
                answers[setting].append(json.loads(out))
        return answers
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def onnxruntime_spread(repo: Path, setting: str) -> float:
    """The largest |logit difference| between onnxruntime option sets (intra-op threads
    1 and 2, graph optimisations all or none) on one setting's full graph."""
    import numpy as np
    import onnxruntime as ort

    package = repo / f"words-{setting}" / "1"
    golden = np.load(package / "golden.npz")
    inputs = {k.split("/", 1)[1]: golden[k] for k in golden.files if k.startswith("model/")}
    outputs = []
    for threads in (1, 2):
        for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                      ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.graph_optimization_level = level
            options.log_severity_level = 3
            session = ort.InferenceSession(str(package / "model.onnx"), options,
                                           providers=["CPUExecutionProvider"])
            names = {i.name for i in session.get_inputs()}
            outputs.append(session.run(None, {k: v for k, v in inputs.items() if k in names})[0])
    return float(max(np.abs(o - outputs[0]).max() for o in outputs))


def summarise(answers: list) -> list[str]:
    """One short line per example answer: top tokens with probabilities, or the text."""
    lines = []
    for answer in answers:
        if "text" in answer and "outputs" not in answer:
            lines.append(answer["text"])
            continue
        out = answer["outputs"][0]
        tokens = ", ".join(f"{t['token']} {t['probability']:.3f}" for t in out["next_tokens"])
        lines.append(tokens + (f" (ppl {out['perplexity']:.1f})" if "perplexity" in out else ""))
    return lines


def label(command: str) -> str:
    """A column heading for an example: its text or prompt, quoted."""
    found = re.search(r'"(?:text|prompt)": \[?"([^"]*)"', command)
    return f'"{found.group(1)}"' if found else command[:30]


def markdown(result: dict) -> str:
    rows = result["rows"]
    digests: dict[str, str] = {}
    for row in rows:
        digests.setdefault(row["sha256"], f"w{len(digests) + 1}")
    labels = [label(command) for command in result["examples"]]
    lines = ["| setting | what is pinned | ATen ran | weights | max abs weights vs first | "
             "max abs answers vs first | speed vs first | onnxruntime | "
             + " | ".join(labels) + " |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | --- |" + " --- |" * len(labels)]
    for row in rows:
        env = " ".join(f"`{k}={v}`" for k, v in row["environment"].items()) or "nothing"
        env += " + oneDNN on" if row["onednn"] else ""
        ort = "same" if row["onnxruntime_max_abs_diff"] == 0 else \
            f"{row['onnxruntime_max_abs_diff']:.1e}"
        answers = "other words" if row["answers_apart"] == float("inf") else \
            f"{row['answers_apart']:.1e}"
        lines.append(f"| {row['setting']} | {env} | {row['cpu_capability']} | "
                     f"{digests[row['sha256']]} | {row['weights_apart']:.1e} | {answers} | "
                     f"{row['speed']:.2f} | {ort} | "
                     + " | ".join(summarise(row["answers"])) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="train this many steps (default: one epoch)")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--precision", choices=("float32", "float64"),
                        help="train in this dtype (default: the quickstart's, "
                        f"{DEFAULT_MODELS['words']['precision']})")
    parser.add_argument("--keep", help="keep the runs and the repository (words-SETTING) "
                        "here; a later run with the same DIR reuses them and asks again")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "numerics.json"))
    parser.add_argument("--train-worker", help=argparse.SUPPRESS)
    parser.add_argument("--onednn", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.train_worker:
        train_worker(args.train_worker, args.steps, args.onednn, args.precision)
        return 0
    name, flags = cpu()
    chosen = chosen_rows(parser, args.settings, list(SETTINGS))
    skipped = [s for s in chosen if SETTINGS[s][2] and SETTINGS[s][2] not in flags]
    chosen = [s for s in chosen if s not in skipped]
    print(f"{name}; settings: {', '.join(chosen)}"
          + (f" (not on this CPU: {', '.join(skipped)})" if skipped else ""), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        keep = Path(args.keep) if args.keep else Path(tmp)
        work, repo = keep / "runs", keep / "repo"
        start = time.monotonic()
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(train_setting, s, args.steps, work, repo, args.precision)
                       for s in chosen]
            rows = []
            for future in futures:
                rows.append(future.result())
                print(f"  trained {rows[-1]['setting']} ({rows[-1]['seconds']:.0f} s, "
                      f"{time.monotonic() - start:.0f} s so far)", flush=True)
        answers = serve_answers(repo, chosen)
        base = rows[0]  # chosen[0]'s
        for row in rows:
            row["answers"] = answers[row["setting"]]
            row["onnxruntime_max_abs_diff"] = onnxruntime_spread(repo, row["setting"])
            row["speed"] = base["seconds"] / row["seconds"]
            row["weights_apart"] = weights_apart(work / base["setting"], work / row["setting"])
            row["answers_apart"] = answers_apart(answers[base["setting"]], row["answers"])
    result = {"cpu": name, "avx512f": "avx512f" in flags, "steps": args.steps,
              "examples": words_examples(), "rows": rows, "not_on_this_cpu": skipped}
    table = markdown(result)
    print("\n" + table)
    print(f"distinct weights: {len({r['sha256'] for r in rows})} of {len(rows)} settings; "
          f"largest differences from {base['setting']}: weights "
          f"{max(r['weights_apart'] for r in rows):.1e}, answers "
          f"{max(r['answers_apart'] for r in rows):.1e}")
    write_result(Path(args.out), result)
    Path(args.out).with_suffix(".md").write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
