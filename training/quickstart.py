"""``orthornn quickstart`` (and ``make serve``): default models -> repository -> service.

When the repository lacks them, trains two small default models, a digit-sequence
classifier (scikit-learn's digits read pixel by pixel) and a word-level language
model on the bundled corpus, exports and publishes them, then replaces this process
with ``orthornn serve`` (torch-free) on 127.0.0.1:8000. A second run reuses what the
first one built.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_MODELS = {
    "digits": dict(arch="scornn", task="digits", hidden_size=64, epochs=30, batch_size=64,
                   optimizer="rmsprop", lr=1e-3, orthogonal_lr=1e-4, log_every=100),
    "words": dict(arch="svdrnn", task="lm", hidden_size=128, embedding_size=128,
                  vocab_size=5000, bptt=35, batch_size=32, epochs=1, optimizer="adam", lr=2e-3,
                  log_every=100),
}

CURL = """\
curl -s http://{host}:{port}/predict -H 'content-type: application/json' \\
  -d '{{"model": "words", "text": ["the history of the"], "top_k": 5}}'"""


def build_defaults(root: Path, progress: bool = True) -> Path:
    """Train and publish whichever default model the repository lacks; returns REPO."""
    from export.exporter import export_run
    from export.repository import versions

    from .checkpoint import read_run_config
    from .config import TrainConfig
    from .trainer import train

    repo, runs = root / "models", root / "runs"
    for name, options in DEFAULT_MODELS.items():
        if versions(repo / name):
            print(f"quickstart: {name}: using {repo / name}", file=sys.stderr)
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
        print(f"quickstart: published {export_run(run, repo, name)}", file=sys.stderr)
    return repo


def quickstart(root: str | Path, host: str = "127.0.0.1", port: int = 8000,
               serve: bool = True) -> Path:
    root = Path(root)
    repo = build_defaults(root, progress=sys.stderr.isatty())
    print("\nTry it (once the server says it is ready):\n\n"
          + CURL.format(host=host, port=port) + "\n", file=sys.stderr)
    if serve:
        args = [sys.executable, "-m", "service.cli", "serve", "--repo", str(repo),
                "--host", host, "--port", str(port)]
        sys.stderr.flush()
        sys.stdout.flush()
        os.execv(sys.executable, args)  # a clean, torch-free server process
    return repo
