#!/usr/bin/env bash
# orthornn beside its peers (the load harness in the checkout PEERS_DIR names: wrk, server
# pinned to CPU 1, client to CPU 0), in one run on one machine with the peers' input
# (B=1, T=128, d=9):
#   1. the peers: a naive FastAPI + onnxruntime server and MLServer (run_peers.sh);
#   2. orthornn serve (svdrnn classifier, n=128, 6 classes, dense export): POST /predict,
#      the OIP infer route with JSON data and with a binary tensor, at concurrency 1, 8, 32;
#   3. overload: /predict at concurrency 256 and 1024 (the excess refused with 503 +
#      Retry-After), and at 1024 once more with bench/load/answered.py beside wrk: the latency
#      of answered and refused requests apart, and of health GETs (/v2/health/ready, one
#      every 10 ms on a connection of their own); then the goodput line: served (200)
#      requests a second at c=1024 as a share of c=32's (goodput.json);
#   4. sessions: 8-step chunks of 128 open sessions at concurrency 32, with the in-process
#      session store and with Redis (bench/load/streaming.py --parts stores; sessions.json).
#   5. with ROUNDS=N: /predict and OIP JSON against the naive server in N alternated
#      rounds at c=32 (rounds.json: each round's ratio and their median).
# Prints the harness's tables; JSON and logs go to OUT (default bench/results/peers).
#   PEERS_DIR=DIR [DURATION=S] [LEVELS=1,8,32] [SKIP_PEERS=1] [ROUNDS=N] [ROUND_S=S] \
#     bash bench/load/peers.sh [OUT]
# DIR is a checkout of the load harness (setup.sh, run_peers.sh, load.py, make_model.py);
# DURATION: seconds per level (default 10); LEVELS: the levels of the three normal rows
# (32 must be among them for the goodput line); SKIP_PEERS=1 leaves out the peers (quicker,
# to compare orthornn with itself); ROUND_S: seconds per server and round (default 5).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="${PEERS_DIR:-}"
if [ -z "$PEERS" ] || [ ! -f "$PEERS/load.py" ]; then
  echo "bench/load/peers.sh: set PEERS_DIR to a checkout of the load harness (the folder with setup.sh, run_peers.sh and load.py)${PEERS:+; $PEERS has no load.py}" >&2
  exit 2
fi
PEERS="$(cd "$PEERS" && pwd)"
OUT="$(realpath -m "${1:-$ROOT/bench/results/peers}")"
DURATION="${DURATION:-10}"
LEVELS="${LEVELS:-1,8,32}"
PY="${XDG_CACHE_HOME:-$HOME/.cache}/orthornn-peers/base/bin/python"
ORTHORNN_PY="$ROOT/.venv/bin/python"
mkdir -p "$OUT"
[ -x "$PY" ] || bash "$PEERS/setup.sh"

# the peers' model input and bodies, and orthornn's package of the same shape
bash "$ROOT/bench/load/peer_inputs.sh" "$PEERS" "$OUT"

PEER_TABLE=()
if [ "${SKIP_PEERS:-0}" != 1 ]; then
  bash "$PEERS/run_peers.sh" --peers naive,mlserver --duration "$DURATION" --out "$OUT/peers"
  PEER_TABLE=("$OUT"/peers/naive.json "$OUT"/peers/mlserver.json)
fi

PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
setsid taskset -c 1 "$ORTHORNN_PY" -m orthornn serve --repo "$OUT/repo" --port "$PORT" \
  --inference-threads 1 --log-level warning > "$OUT/orthornn.log" 2>&1 &
PID=$!
trap 'kill -TERM -- -$PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/v2/health/ready" >/dev/null 2>&1 && break
  sleep 0.2
done
URL="http://127.0.0.1:$PORT"
load() {  # LABEL PATH BODY CONCURRENCY [extra load.py args]
  local label=$1 path=$2 body=$3 levels=$4; shift 4
  "$PY" "$PEERS/load.py" "$URL$path" --body "$body" --ceiling-url "$URL/v2/health/live" \
    --label "$label" --concurrency "$levels" --duration "$DURATION" --warmup 3 \
    --client-cpus 0 --json "$OUT/$label.json" "$@"
}
load orthornn /predict "$OUT/orthornn_predict.json" "$LEVELS"
load orthornn-oip-json /v2/models/bench/infer "$OUT/oip_body.json" "$LEVELS"
load orthornn-oip-binary /v2/models/bench/infer "$OUT/oip_binary.bin" "$LEVELS" \
  -H "Inference-Header-Content-Length: $(cat "$OUT/oip_binary.header")"
load orthornn-overload /predict "$OUT/orthornn_predict.json" 256,1024 --ceiling-concurrency 256
# wrk's histogram mixes answers and refusals: once more at c=1024, with a probe of 64
# connections of its own that times the answered (200) and refused (503) apart
"$PY" "$PEERS/load.py" "$URL/predict" --body "$OUT/orthornn_predict.json" --no-probe \
  --label orthornn-overload-probed --concurrency 1024 --duration "$DURATION" --warmup 3 \
  --client-cpus 0 --json "$OUT/orthornn-overload-probed.json" > "$OUT/probed-load.log" 2>&1 &
LOAD=$!
trap 'kill $LOAD 2>/dev/null || true; kill -TERM -- -$PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
sleep 4  # load.py's 3 s warm-up, then the probe inside the timed run
# the probes share CPU 0 with wrk (the client core), so client-side delays count in all;
# health GETs from a process of their own, so that the POST probe's work does not delay them
SECONDS_PROBED="$(python3 -c "print(max(1.0, float('$DURATION') - 2))")"
taskset -c 0 "$ORTHORNN_PY" "$ROOT/bench/load/answered.py" --connections 0 \
  --health "$URL/v2/health/ready" --json "$OUT/health.json" --seconds "$SECONDS_PROBED" \
  > "$OUT/health.log" 2>&1 &
HEALTH=$!
taskset -c 0 "$ORTHORNN_PY" "$ROOT/bench/load/answered.py" "$URL/predict" \
  --body "$OUT/orthornn_predict.json" --connections 64 --json "$OUT/answered.json" \
  --seconds "$SECONDS_PROBED"
wait $HEALTH
cat "$OUT/health.log"
wait $LOAD
echo "rss_mib $(ps -o rss= -p "$PID" | awk '{printf "%.0f", $1/1024}')"
"$PY" "$PEERS/load.py" --table "${PEER_TABLE[@]}" \
  "$OUT"/orthornn.json "$OUT"/orthornn-oip-json.json "$OUT"/orthornn-oip-binary.json \
  "$OUT"/orthornn-overload.json "$OUT"/orthornn-overload-probed.json | tee "$OUT/table.md"
echo
"$ORTHORNN_PY" "$ROOT/bench/load/answered.py" --goodput "$OUT" --json "$OUT/goodput.json" \
  | tee -a "$OUT/table.md"
echo
# the session row: the same chunks with sessions in this process and in Redis
"$ORTHORNN_PY" "$ROOT/bench/load/streaming.py" --parts stores --sessions 128 \
  --out "$OUT/sessions.json" | tee -a "$OUT/table.md"

# ROUNDS=N: /predict against the naive server in N alternated rounds (naive /predict, then
# orthornn's /predict and OIP JSON, ROUND_S seconds each at c=32, both servers up, pinned
# to CPU 1): single runs move by up to 2x on a shared machine, the ratio within a round
# much less; per-round ratios and their median go to the table and rounds.json
if [ "${ROUNDS:-0}" -gt 0 ]; then
  NPORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  setsid taskset -c 1 "$PY" "$PEERS/naive_fastapi.py" --model "$OUT/model.onnx" \
    --port "$NPORT" --threads 1 > "$OUT/naive-rounds.log" 2>&1 &
  NPID=$!
  trap 'kill -TERM -- -$NPID 2>/dev/null || true; kill -TERM -- -$PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$NPORT/health" >/dev/null 2>&1 && break
    sleep 0.2
  done
  mkdir -p "$OUT/rounds"
  for r in $(seq "$ROUNDS"); do
    for row in naive predict oip_json; do
      case $row in
        naive) url="http://127.0.0.1:$NPORT/predict" body="$OUT/predict_body.json" ;;
        predict) url="$URL/predict" body="$OUT/orthornn_predict.json" ;;
        oip_json) url="$URL/v2/models/bench/infer" body="$OUT/oip_body.json" ;;
      esac
      "$PY" "$PEERS/load.py" "$url" --body "$body" --label "$row" --concurrency 32 \
        --duration "${ROUND_S:-5}" --warmup 1 --client-cpus 0 --no-probe \
        --json "$OUT/rounds/$row-$r.json" > /dev/null
    done
  done
  kill -TERM -- -$NPID 2>/dev/null || true
  echo
  "$ORTHORNN_PY" - "$OUT" "$ROUNDS" <<'EOF2' | tee -a "$OUT/table.md"
import json, statistics, sys
from pathlib import Path

out, rounds = Path(sys.argv[1]), int(sys.argv[2])
rows = ("naive", "predict", "oip_json")
rps = {row: [] for row in rows}
for r in range(1, rounds + 1):
    for row in rows:
        level = json.loads((out / "rounds" / f"{row}-{r}.json").read_text())["levels"][0]
        if level["error_total"]:
            sys.exit(f"round {r}, {row}: {level['error_total']} errors")
        rps[row].append(level["rps"])
ratio = {row: [a / b for a, b in zip(rps[row], rps["naive"])] for row in ("predict", "oip_json")}
print(f"/predict against the naive server, {rounds} alternated rounds at c=32 (req/s)")
print("round   naive  /predict  OIP JSON  /predict/naive  OIP JSON/naive")
for r in range(rounds):
    print(f"{r + 1:>5} {rps['naive'][r]:>7.0f} {rps['predict'][r]:>9.0f} "
          f"{rps['oip_json'][r]:>9.0f} {ratio['predict'][r]:>15.2f} {ratio['oip_json'][r]:>15.2f}")
median = {row: statistics.median(v) for row, v in ratio.items()}
print(f"median ratio: /predict {median['predict']:.2f}x the naive server "
      f"(rounds {min(ratio['predict']):.2f}-{max(ratio['predict']):.2f}), "
      f"OIP JSON {median['oip_json']:.2f}x")
(out / "rounds.json").write_text(json.dumps({"rounds": rounds, "rps": rps, "ratio": ratio,
                                             "median_ratio": median}, indent=2) + "\n")
print(f"wrote {out / 'rounds.json'}")
EOF2
fi
