"""``orthornn quickstart`` (and ``make serve``): default models -> repository -> service.

When the repository lacks them, trains two small default models, a digit-sequence
classifier (scikit-learn's digits read pixel by pixel) and a word-level language
model on the bundled corpus, exports and publishes them, then replaces this process
with ``orthornn serve`` (torch-free) on 127.0.0.1:8000. A second run reuses what the
first one built.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# The docs show these models' answers, so they must not depend on the machine: float64
# keeps the kernels' last-bit differences (MKL's branch, ATen's AVX2/AVX-512/scalar
# kernels) small through training (weights within 2.2e-9, answers 2e-7), where float32's
# grew into other words and probabilities on other CPUs (docs/training.md, "Across
# CPUs"). One thread: some of ATen's reductions split by thread.
DEFAULT_MODELS = {
    "digits": dict(arch="scornn", task="digits", hidden_size=64, epochs=30, batch_size=64,
                   optimizer="rmsprop", lr=1e-3, orthogonal_lr=1e-4, log_every=100, threads=1,
                   precision="float64"),
    "words": dict(arch="svdrnn", task="lm", hidden_size=128, embedding_size=128,
                  vocab_size=5000, bptt=35, batch_size=32, epochs=1, optimizer="adam", lr=2e-3,
                  log_every=100, threads=1, precision="float64"),
}

CURL = """\
curl -s http://{host}:{port}/predict -H 'content-type: application/json' \\
  -d '{{"model": "words", "text": ["the history of the"], "top_k": 5}}'"""


def build_defaults(root: Path, progress: bool = True) -> tuple[Path, dict[str, str]]:
    """Train and publish whichever default model the repository lacks; returns REPO and,
    per model, what was done ("trained and published VERSION_DIR" or "reused ...").
    progress: training and export report progress (a bar on a terminal, else a line
    every few seconds). The same bytes on one machine at every run; on another CPU,
    weights that agree within ~1e-9 and the same answers to the digits the docs show
    (float64 training; docs/training.md, "Across CPUs")."""
    from orthornn.export.artifacts.repository import versions
    from orthornn.export.builder.exporter import export_run
    from orthornn.training.checkpoint import read_run_config
    from orthornn.training.config import TrainConfig
    from orthornn.training.trainer import train

    repo, runs = root / "models", root / "runs"
    done: dict[str, str] = {}
    for name, options in DEFAULT_MODELS.items():
        found = versions(repo / name)
        if found:
            print(f"quickstart: {name}: using {repo / name}", file=sys.stderr)
            done[name] = f"reused {repo / name / str(max(found))}"
            continue
        run = runs / name
        if not (run / "summary.json").is_file():
            if (run / "config.json").is_file():  # an interrupted earlier attempt: start over
                import shutil

                shutil.rmtree(run)
            print(f"quickstart: training {name} ({options['arch']} on {options['task']})",
                  file=sys.stderr)
            train(TrainConfig(out=str(run), **options), progress=progress)
        read_run_config(run)
        published = export_run(run, repo, name, progress=progress)
        print(f"quickstart: published {published}", file=sys.stderr)
        done[name] = f"trained ({run}) and published {published}"
    return repo, done


def quickstart(root: str | Path, host: str = "127.0.0.1", port: int = 8000,
               serve: bool = True) -> Path:
    root = Path(root)
    if serve:  # what would stop the server, before minutes of training
        from orthornn.service.server.launch import listen
        from orthornn.service.settings import Settings

        refusal = Settings(repo=root, host=host, port=port).repository_api_exposure()
        if refusal is not None:
            raise ValueError(refusal)
        listen(host, port).close()
    start = time.monotonic()
    repo, done = build_defaults(root)
    report = "".join(f"  {name}: {what}\n" for name, what in done.items())
    if not serve:
        print(f"\nquickstart: the model repository {repo} is complete "
              f"({time.monotonic() - start:.0f} s):\n{report}\nServe it with:\n\n"
              f"  orthornn serve --repo {repo} --host {host} --port {port}\n\n"
              f"then, once /v2/health/ready answers 200:\n\n"
              + CURL.format(host=host, port=port) + "\n", file=sys.stderr)
        return repo
    print("\nTry it (once the server says it is ready):\n\n"
          + CURL.format(host=host, port=port) + "\n", file=sys.stderr)
    args = [sys.executable, "-m", "orthornn", "serve", "--repo", str(repo),
            "--host", host, "--port", str(port)]
    sys.stderr.flush()
    sys.stdout.flush()
    os.execv(sys.executable, args)  # a clean, torch-free server process
    return repo


def add_quickstart_parser(sub) -> None:
    parser = sub.add_parser(
        "quickstart", help="train and publish the default models if missing, then serve them",
        description="Trains a digit-sequence classifier and a word-level language model "
        "(when DIR/models lacks them), publishes them into DIR/models and starts "
        "orthornn serve. A second run reuses what the first built.")
    parser.add_argument("--dir", default="orthornn-quickstart",
                        help="where runs and the model repository live")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--no-serve", action="store_true", help="build the models and stop")
    parser.set_defaults(run=run_quickstart)


def run_quickstart(args: argparse.Namespace) -> int:
    if not 1 <= args.port <= 65535:
        raise ValueError(f"port must be an integer in [1, 65535], got {args.port}")
    quickstart(args.dir, args.host, args.port, serve=not args.no_serve)
    return 0
