"""What ``orthornn versions`` lists: every version of a model and every kept refused
candidate, with its status in the promotion and the rollouts."""

from __future__ import annotations

import json
from pathlib import Path

from .repository import REJECTED, live_version, promoted, rejected, versions
from .rollout import Phase, read_plan, rolled_back


def describe(model_dir: str | Path) -> list[dict]:
    """Every version of model_dir and every kept refused candidate, oldest first: id,
    status (promoted | published | rollout | rolled_back | rejected), evaluation, lineage
    and, for a refused or rolled-back candidate, why (what ``orthornn versions`` prints).
    Reads manifests; verifies nothing."""
    model_dir = Path(model_dir)
    on_disk = versions(model_dir)
    live = live_version(on_disk, promoted(model_dir))
    try:
        plan = read_plan(model_dir)
    except ValueError:
        plan = None
    backed = rolled_back(plan)
    rolling = plan.candidate if plan is not None and plan.running else None
    rows = []
    for path in [*(model_dir / str(v) for v in on_disk), *rejected(model_dir)]:
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except (OSError, ValueError):
            manifest = {}
        row = {"id": path.name, "evaluation": manifest.get("evaluation"),
               "lineage": manifest.get("lineage"), "created": manifest.get("created")}
        if path.parent.name == REJECTED:
            try:
                gate = json.loads((path / "gate.json").read_text())
            except (OSError, ValueError):
                gate = {}
            row.update(status="rejected", reason=gate.get("refused"))
        else:
            version = int(path.name)
            row["status"] = "promoted" if version == live else "rollout" \
                if version == rolling else "published"
            if version in backed and version != live:  # a rollout broke a threshold
                row.update(status=Phase.ROLLED_BACK, reason=backed[version]["reason"],
                           breach=backed[version]["breach"])
        rows.append(row)
    return rows
