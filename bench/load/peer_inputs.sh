#!/usr/bin/env bash
# The inputs of the peer benchmarks (bench/load/peers.sh, bench/load/trees.sh), written to OUT:
#   model.onnx, predict_body.json, oip_body.json, input.npy   the peers' model and bodies
#       (the load harness's make_model.py: B=1, T=128, d=9);
#   repo/bench                  orthornn's package of the same shape (svdrnn classifier,
#       n=128, 6 classes; one training step), exported with THIS checkout's exporter;
#       kept when it is already there;
#   orthornn_predict.json       /predict's body (the peers' body naming the model);
#   oip_binary.bin, oip_binary.header   the OIP infer body with a binary FP32 tensor, and
#       its JSON head's length (the Inference-Header-Content-Length header's value).
#   bash bench/load/peer_inputs.sh PEERS_DIR OUT
# Creates the harness's base venv (setup.sh ... base) when it is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="$1" OUT="$2"
PY="${XDG_CACHE_HOME:-$HOME/.cache}/orthornn-peers/base/bin/python"
ORTHORNN_PY="$ROOT/.venv/bin/python"
mkdir -p "$OUT"
[ -x "$PY" ] || bash "$PEERS/setup.sh" "${XDG_CACHE_HOME:-$HOME/.cache}/orthornn-peers" base

"$PY" "$PEERS/make_model.py" --out "$OUT/model.onnx" --bodies "$OUT" --steps 128 --batch 1
"$ORTHORNN_PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
import numpy as np
from orthornn.export.builder.exporter import export_run
from orthornn.training.config import TrainConfig
from orthornn.training.trainer import train

out = Path(sys.argv[1])
rng = np.random.default_rng(0)
np.savez(out / "data.npz", x=rng.normal(size=(64, 128, 9)).astype(np.float32),
         y=rng.integers(0, 6, size=64))
if not (out / "repo" / "bench").is_dir():
    train(TrainConfig(arch="svdrnn", task="classify", data=str(out / "data.npz"),
                      hidden_size=128, steps=1, batch_size=16, log_every=1,
                      out=str(out / "run")), progress=False)
    export_run(out / "run", out / "repo", "bench", progress=False)
body = json.loads((out / "predict_body.json").read_text())
(out / "orthornn_predict.json").write_text(json.dumps({"model": "bench", **body}))
x = np.load(out / "input.npy")
blob = x.astype("<f4").tobytes()
head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                               "parameters": {"binary_data_size": len(blob)}}],
                   "outputs": [{"name": "logits"}]}).encode()
(out / "oip_binary.bin").write_bytes(head + blob)
(out / "oip_binary.header").write_text(str(len(head)))
PYEOF
