"""PNG learning curves from RUN_DIR/metrics.jsonl: training loss, the validation metric
(with the task's baseline), the spectral margin and ||dL/dh_0||."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} has no metrics.jsonl to plot")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from orthornn.export.artifacts.records import atomic_write

    from .checkpoint import read_run_config

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    config = read_run_config(run_dir)
    metric = config["metric"]
    steps = [r["step"] for r in rows]
    panels = [("training loss", "loss", None),
              (f"validation {metric}", f"val_{metric}", config.get("baseline")
               if metric in ("mse", "cross_entropy") else None),
              ("spectral margin max|s - 1|", "spectral_margin", None),
              ("||dL/dh_0||", "grad_h0", None)]
    panels = [p for p in panels if any(r.get(p[1]) is not None for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (title, key, baseline) in zip(axes[0], panels, strict=True):
        points = [(s, r[key]) for s, r in zip(steps, rows, strict=True) if r.get(key) is not None]
        ax.plot(*zip(*points, strict=True), marker="." if len(points) < 30 else None)
        if baseline is not None:
            ax.axhline(baseline, color="gray", linestyle="--", label="baseline")
            ax.legend()
        if key in ("loss", "grad_h0") and all(v > 0 for _, v in points):
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{config['arch']} on {config['task_name']}")
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return out
