#!/usr/bin/env bash
# Serving speed of two source trees of orthornn, in one sitting: the tree BEFORE names (a
# git revision, checked out with `git worktree add` for the run, or a folder holding such
# a tree) against this checkout, in ROUNDS alternated rounds. Absolute numbers move by up
# to 2x between runs on a shared machine, the ratio within a round much less: per round
# and row, each server for ROUND_S seconds at concurrency 32 (the load harness's load.py
# from CPU 0; both servers up, each pinned to CPU 1, --inference-threads 1), the before
# server first in odd rounds and the after server first in even ones. Rows: POST /predict,
# the OIP infer route with JSON data and with a binary tensor (bench/load/peers.sh's bodies and
# package, bench/load/peer_inputs.sh, exported with this checkout's exporter: both trees serve
# the same package). The before tree needs no venv of its own: it runs in this checkout's
# venv with a folder first on PYTHONPATH whose orthornn/ links to the before tree's
# orthornn/*.py and its service/, export/, models/, training/ (checked before the run:
# PYTHONPATH wins over the editable install's finder).
# Prints per row each round's req/s before and after, their ratio after/before and the
# median ratio, then each server's cost of a /predict request against onnxruntime's own
# time a sequence at the batch the server formed (bench/load/model_limit.py) (table.md);
# rounds.json, model_limit.json and the servers' logs go to OUT (default
# bench/results/trees).
#   BEFORE=REV_OR_DIR [ROUNDS=6] [ROUND_S=5] [PEERS_DIR=DIR] bash bench/load/trees.sh [OUT]
# PEERS_DIR: the load harness (default: shared/peers beside this checkout).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BEFORE="${BEFORE:-}"
if [ -z "$BEFORE" ]; then
  echo "bench/load/trees.sh: set BEFORE to a git revision or a source tree of orthornn" >&2
  exit 2
fi
PEERS="${PEERS_DIR:-$ROOT/../shared/peers}"
if [ ! -f "$PEERS/load.py" ]; then
  echo "bench/load/trees.sh: $PEERS has no load.py: set PEERS_DIR to a checkout of the load harness" >&2
  exit 2
fi
PEERS="$(cd "$PEERS" && pwd)"
OUT="$(realpath -m "${1:-$ROOT/bench/results/trees}")"
ROUNDS="${ROUNDS:-6}"
ROUND_S="${ROUND_S:-5}"
PY="${XDG_CACHE_HOME:-$HOME/.cache}/orthornn-peers/base/bin/python"
ORTHORNN_PY="$ROOT/.venv/bin/python"
mkdir -p "$OUT"
rm -rf "$OUT/rounds"
mkdir -p "$OUT/rounds"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/orthornn-trees.XXXXXX")"
WORKTREE=""
declare -A PID PORT
cleanup() {
  local pid
  for pid in "${PID[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${PID[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ -n "$WORKTREE" ]; then
    git -C "$ROOT" worktree remove --force "$WORKTREE" 2>/dev/null || true
    git -C "$ROOT" worktree prune 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# the before tree: a folder as it is, or a revision in a worktree of its own
if [ -d "$BEFORE" ]; then
  BEFORE_TREE="$(cd "$BEFORE" && pwd)"
  BEFORE_COMMIT="$(git -C "$BEFORE_TREE" rev-parse HEAD 2>/dev/null || echo unknown)"
else
  BEFORE_COMMIT="$(git -C "$ROOT" rev-parse --verify --quiet "$BEFORE^{commit}")" || {
    echo "bench/load/trees.sh: BEFORE=$BEFORE is neither a folder nor a revision" >&2; exit 2; }
  WORKTREE="$WORK/before"
  git -C "$ROOT" worktree add --detach --quiet "$WORKTREE" "$BEFORE_COMMIT"
  BEFORE_TREE="$WORKTREE"
fi
AFTER_COMMIT="$(git -C "$ROOT" rev-parse HEAD)"
AFTER_CHANGED="$(git -C "$ROOT" status --porcelain | wc -l)"

# orthornn importable from the before tree: links to its command package and stages
SHIM="$WORK/path"
mkdir -p "$SHIM/orthornn"
ln -s "$BEFORE_TREE"/orthornn/*.py "$SHIM/orthornn/"
for stage in service export models training; do
  [ -d "$BEFORE_TREE/$stage" ] || { echo "bench/load/trees.sh: $BEFORE_TREE has no $stage/" >&2; exit 2; }
  ln -s "$BEFORE_TREE/$stage" "$SHIM/orthornn/$stage"
done
# which tree `import orthornn` takes, run from $WORK (not from a checkout: python -c and
# -m put the working folder first on sys.path, before PYTHONPATH)
check_tree() {  # TREE [PYTHONPATH]
  local tree=$1 got
  got="$(cd "$WORK" && env -u PYTHONPATH ${2:+PYTHONPATH="$2"} "$ORTHORNN_PY" -c '
import os, orthornn, orthornn.service, orthornn.export
for m in (orthornn, orthornn.service, orthornn.export):
    print(os.path.realpath(m.__file__))')"
  while read -r file; do
    [[ "$file" == "$tree"/* ]] || {
      echo "bench/load/trees.sh: orthornn is not imported from $tree:" >&2
      echo "$got" >&2
      exit 1; }
  done <<<"$got"
  echo "orthornn from $(dirname "$(sed -n 2p <<<"$got")")"
}
check_tree "$BEFORE_TREE" "$SHIM"
check_tree "$ROOT"

# the package and the three bodies (bench/load/peers.sh's), exported by this checkout
bash "$ROOT/bench/load/peer_inputs.sh" "$PEERS" "$OUT"
HEADER="Inference-Header-Content-Length: $(cat "$OUT/oip_binary.header")"

start() {  # NAME [PYTHONPATH]: orthornn serve on a free port, pinned to CPU 1
  local name=$1 port
  port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  (cd "$WORK" && exec env -u PYTHONPATH ${2:+PYTHONPATH="$2"} setsid taskset -c 1 \
    "$ORTHORNN_PY" -m orthornn serve --repo "$OUT/repo" --port "$port" \
    --inference-threads 1 --log-level warning) > "$OUT/$name.log" 2>&1 &
  PID[$name]=$!
  PORT[$name]=$port
}
ready() {  # NAME
  local name=$1
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:${PORT[$name]}/v2/health/ready" >/dev/null 2>&1 && return
    kill -0 "${PID[$name]}" 2>/dev/null || break
    sleep 0.2
  done
  echo "bench/load/trees.sh: the $name server is not ready; $OUT/$name.log:" >&2
  tail -20 "$OUT/$name.log" >&2
  exit 1
}
start before "$SHIM"
start after
ready before
ready after

ROWS=(predict oip_json oip_binary)
row_args() {  # ROW -> PATH BODY [header]: what load.py and the check send
  case $1 in
    predict) ARGS=(/predict "$OUT/orthornn_predict.json") ;;
    oip_json) ARGS=(/v2/models/bench/infer "$OUT/oip_body.json") ;;
    oip_binary) ARGS=(/v2/models/bench/infer "$OUT/oip_binary.bin" "$HEADER") ;;
  esac
}
# both servers answer each body with 200 (the same package read by both trees)
for row in "${ROWS[@]}"; do
  row_args "$row"
  for tree in before after; do
    code=$(curl -s -o "$OUT/answer-$row-$tree" -w '%{http_code}' --data-binary "@${ARGS[1]}" \
      -H 'Content-Type: application/json' ${ARGS[2]:+-H "${ARGS[2]}"} \
      "http://127.0.0.1:${PORT[$tree]}${ARGS[0]}")
    if [ "$code" != 200 ]; then
      echo "bench/load/trees.sh: $row on the $tree server answered $code:" >&2
      head -c 500 "$OUT/answer-$row-$tree" >&2; echo >&2
      exit 1
    fi
  done
  cmp -s "$OUT/answer-$row-before" "$OUT/answer-$row-after" \
    && echo "$row: 200 from both, the same answer" \
    || echo "$row: 200 from both, answers differ ($OUT/answer-$row-{before,after})"
done

for r in $(seq "$ROUNDS"); do
  if (( r % 2 )); then order=(before after); else order=(after before); fi
  echo "round $r/$ROUNDS (${order[0]} first)"
  for row in "${ROWS[@]}"; do
    row_args "$row"
    for tree in "${order[@]}"; do
      "$PY" "$PEERS/load.py" "http://127.0.0.1:${PORT[$tree]}${ARGS[0]}" --body "${ARGS[1]}" \
        ${ARGS[2]:+-H "${ARGS[2]}"} --label "$row-$tree" --concurrency 32 \
        --duration "$ROUND_S" --warmup 1 --client-cpus 0 --no-probe \
        --json "$OUT/rounds/$row-$tree-$r.json" > /dev/null
      kill -0 "${PID[$tree]}" 2>/dev/null || {
        echo "bench/load/trees.sh: the $tree server stopped; $OUT/$tree.log:" >&2
        tail -20 "$OUT/$tree.log" >&2; exit 1; }
    done
  done
done
echo

"$ORTHORNN_PY" - "$OUT" "$ROUNDS" "$ROUND_S" "$BEFORE" "$BEFORE_TREE" "$BEFORE_COMMIT" \
  "$ROOT" "$AFTER_COMMIT" "$AFTER_CHANGED" <<'EOF' | tee "$OUT/table.md"
import json, statistics, sys
from pathlib import Path

out, rounds, round_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
before_rev, before_tree, before_commit, after_tree, after_commit, changed = sys.argv[4:10]
rows = {"predict": "/predict", "oip_json": "OIP JSON", "oip_binary": "OIP binary"}
rps = {row: {"before": [], "after": []} for row in rows}
for r in range(1, rounds + 1):
    for row in rows:
        for tree in ("before", "after"):
            path = out / "rounds" / f"{row}-{tree}-{r}.json"
            level = json.loads(path.read_text())["levels"][0]
            if level["error_total"]:
                sys.exit(f"round {r}, {row}, {tree}: {level['error_total']} errors ({path})")
            rps[row][tree].append(level["rps"])
ratio = {row: [a / b for a, b in zip(v["after"], v["before"])] for row, v in rps.items()}
median = {row: statistics.median(v) for row, v in ratio.items()}
print(f"before: {before_rev} ({before_commit[:12]}, {before_tree})")
print(f"after:  {after_tree} ({after_commit[:12]} + {changed} changed paths)")
print(f"{rounds} alternated rounds at c=32, {round_s:g} s per server and row (req/s; "
      "the before server first in odd rounds)")
print("row         round   before    after  after/before")
for row, name in rows.items():
    for r in range(rounds):
        print(f"{name:<11} {r + 1:>5} {rps[row]['before'][r]:>8.0f} {rps[row]['after'][r]:>8.0f}"
              f" {ratio[row][r]:>13.3f}")
    print(f"{name:<11} median ratio {median[row]:.3f} "
          f"(rounds {min(ratio[row]):.3f}-{max(ratio[row]):.3f})")
print("median after/before: " + ", ".join(f"{name} {median[row]:.3f}"
                                          for row, name in rows.items()))
(out / "rounds.json").write_text(json.dumps({
    "before": {"rev": before_rev, "commit": before_commit, "tree": before_tree},
    "after": {"tree": after_tree, "commit": after_commit, "changed_paths": int(changed)},
    "rounds": rounds, "round_s": round_s, "concurrency": 32,
    "first": ["before" if r % 2 else "after" for r in range(1, rounds + 1)],
    "rps": rps, "ratio": ratio, "median_ratio": median}, indent=2) + "\n")
print(f"wrote {out / 'rounds.json'}")
for tree in ("before", "after"):  # the median /predict req/s: model_limit.py's
    (out / f"{tree}.rps").write_text(f"{statistics.median(rps['predict'][tree]):.1f}\n")
EOF

# the model's own limit: onnxruntime alone on CPU 1, at the mean batch each server formed
# (over its three rows), against each server's median /predict req/s
echo
taskset -c 1 "$ORTHORNN_PY" "$ROOT/bench/load/model_limit.py" "$OUT/repo/bench/1" \
  "$OUT/model_limit.json" \
  "before=http://127.0.0.1:${PORT[before]}/metrics:$(cat "$OUT/before.rps")" \
  "after=http://127.0.0.1:${PORT[after]}/metrics:$(cat "$OUT/after.rps")" | tee -a "$OUT/table.md"
