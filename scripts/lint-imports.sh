#!/usr/bin/env bash
# make lint's import contracts ([tool.importlinter] in pyproject.toml), checked with
# import-linter. The stages install as orthornn.<stage> through a package-dir mapping,
# which import-linter cannot follow, so it reads a tree laid out as the wheel installs
# it: build/import-graph/orthornn/ with a link to each stage folder.
#   bash scripts/lint-imports.sh [VENV]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(cd "${1:-$ROOT/.venv}" && pwd)"  # absolute: the check runs from inside the tree
TREE="$ROOT/build/import-graph"
rm -rf "$TREE"
mkdir -p "$TREE/orthornn"
for f in "$ROOT"/orthornn/*.py; do ln -s "$f" "$TREE/orthornn/"; done
for stage in models training export service; do ln -s "$ROOT/$stage" "$TREE/orthornn/$stage"; done
# from inside the tree: the checkout's own orthornn/ (without the stages) must not be found
cd "$TREE"
PYTHONPATH="$TREE" "$VENV/bin/lint-imports" --config "$ROOT/pyproject.toml" --no-cache
