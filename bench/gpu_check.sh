#!/usr/bin/env bash
# One GPU check of the Triton kernels on a lent H100 / H200 (docs/gpu.md), in under
# 8 minutes, each step bounded so the later ones still run:
#   1. the Triton op tests with compiled kernels (no TRITON_INTERPRET), gpu-marked included
#   2. bench/ops.py: the headline point (T=784, n=128, B=64), then the docs' grid
#   3. training throughput: steps/s of svdrnn, scornn, dizzyrnn, sgornn at T=784, n=128,
#      B=64 (Triton kernels and the PyTorch reference) against nn.RNN(relu) and cuDNN LSTM
#   4. the long rows of bench/reproduce.py --full that fit in the time left: DizzyRNN's
#      copy rows (its preset's 1,000 steps, the Givens kernels inside), one seed each
# Run from the checkout: OUT=/some/dir bash bench/gpu_check.sh. Writes 8 files to $OUT
# (the most a lent machine returns): summary.json (every step's exit code and seconds),
# env.txt, tests.log, ops.log (with the throughput log), ops.json, throughput.json,
# reproduce.log, reproduce.json. The compile check (tests/test_triton_compile.py) needs
# no GPU and is not rerun here.
# Environment: BUDGET (seconds, default 470), PYTHON (default python).
set -u
OUT=${OUT:?set OUT to the folder for logs and results}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python}
BUDGET=${BUDGET:-470}
START=$(date +%s)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export ORTHORNN_KERNELS=auto
SCRATCH=$(mktemp -d)
STEPS=()

left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME LIMIT LOG CMD...: run CMD under min(LIMIT, time left), log to LOG, record it.
step() {
    local name=$1 limit=$2 log=$3
    shift 3
    local remaining
    remaining=$(left)
    if [ "$remaining" -lt "$limit" ]; then limit=$remaining; fi
    if [ "$limit" -lt 15 ]; then
        STEPS+=("{\"step\": \"$name\", \"rc\": null, \"seconds\": 0, \"note\": \"no time left\"}")
        echo "== $name: skipped, no time left" >>"$log"
        return
    fi
    local t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*" >>"$log"
    timeout --signal=INT --kill-after=15 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    local spent=$(($(date +%s) - t0))
    echo "== $name: exit $rc after ${spent}s" >>"$log"
    STEPS+=("{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $spent, \"limit\": $limit}")
}

# The package imports as orthornn.models (pyproject maps the top-level folders to it).
# Without an install, a sitecustomize on PYTHONPATH adds the checkout to the package's
# path, so orthornn.models is models/ whatever sys.path[0] is.
if ! "$PYTHON" -c "import orthornn.models" 2>/dev/null; then
    mkdir -p "$SCRATCH/site"
    cat >"$SCRATCH/site/sitecustomize.py" <<EOF
import sys as _sys
_sys.path.insert(0, "$ROOT")
import orthornn as _orthornn
_orthornn.__path__.append("$ROOT")
EOF
    export PYTHONPATH="$SCRATCH/site:$PYTHONPATH"
fi

{
    date -u
    nvidia-smi 2>&1 | head -20
    "$PYTHON" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton missing:", e)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
import orthornn.models
print("orthornn.models from", orthornn.models.__file__)
EOF
} >"$OUT/env.txt" 2>&1

# 1. compiled kernels against the reference (the tests pick CUDA when it is there)
step tests 200 "$OUT/tests.log" "$PYTHON" -m pytest -q -p no:cacheprovider \
    tests/test_triton_ops.py tests/test_scan.py

# 2. the op benchmark: the issue's point first, then the docs' grid
step ops_point 60 "$OUT/ops.log" "$PYTHON" bench/ops.py --steps 784 --hidden 128 --batch 64 \
    --reps 5 --out "$OUT/ops.json"
step ops_grid 150 "$OUT/ops.log" "$PYTHON" bench/ops.py --reps 3 --out "$SCRATCH/ops-grid.json"
if [ -f "$SCRATCH/ops-grid.json" ]; then cp "$SCRATCH/ops-grid.json" "$OUT/ops.json"; fi

# 3. training throughput at T=784, n=128, B=64 (pixel-by-pixel MNIST's shape)
cat >"$SCRATCH/throughput.py" <<'EOF'
import json, os, sys, time
import torch
from orthornn.models import build_model

out = sys.argv[1]
dev = torch.device("cuda")
T, n, B, classes, budget = 784, 128, 64, 10, 6.0
gen = torch.Generator().manual_seed(0)
x = torch.randn(B, T, 1, generator=gen).to(dev)
y = torch.randint(0, classes, (B,), generator=gen).to(dev)
loss_fn = torch.nn.CrossEntropyLoss()
rows = []


def rate(step):
    for _ in range(2):
        step()  # warm-up: Triton compiles, cuDNN picks its algorithms
    torch.cuda.synchronize()
    count, start = 0, time.perf_counter()
    while count < 3 or (time.perf_counter() - start < budget and count < 200):
        step()
        count += 1
        torch.cuda.synchronize()
    return count / (time.perf_counter() - start)


def baseline(kind):
    cell = (torch.nn.LSTM if kind == "lstm" else torch.nn.RNN)(
        1, n, batch_first=True, **({} if kind == "lstm" else {"nonlinearity": "relu"})).to(dev)
    head = torch.nn.Linear(n, classes).to(dev)
    opt = torch.optim.Adam([*cell.parameters(), *head.parameters()], lr=1e-3)

    def step():
        _, h = cell(x)
        h = h[0] if kind == "lstm" else h
        loss = loss_fn(head(h[0]), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def model_step(arch):
    model = build_model(arch, "classify", input_size=1, hidden_size=n, num_outputs=classes,
                        seed=0).to(dev)
    opt = torch.optim.Adam(model.param_groups(1e-3, 1e-4))

    def step():
        loss = loss_fn(model(x), y) + model.regularization()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


for name in ("rnn", "lstm"):
    rows.append({"model": f"nn.{'LSTM' if name == 'lstm' else 'RNN(relu)'} (cuDNN)",
                 "steps_per_s": rate(baseline(name))})
    print(rows[-1], flush=True)
for arch in ("svdrnn", "scornn", "dizzyrnn", "sgornn"):
    for mode in ("auto", "reference"):
        os.environ["ORTHORNN_KERNELS"] = mode
        try:
            rows.append({"model": arch, "kernels": "triton" if mode == "auto" else mode,
                         "steps_per_s": rate(model_step(arch))})
        except Exception as e:  # one failure does not hide the other rows
            rows.append({"model": arch, "kernels": mode, "error": repr(e)[:500]})
        print(rows[-1], flush=True)
        json.dump({"T": T, "n": n, "B": B, "device": torch.cuda.get_device_name(),
                   "rows": rows}, open(out, "w"), indent=1)
EOF
step throughput 120 "$OUT/throughput.log" "$PYTHON" "$SCRATCH/throughput.py" \
    "$OUT/throughput.json"
cat "$OUT/throughput.log" >>"$OUT/ops.log" 2>/dev/null && rm -f "$OUT/throughput.log"

# 4. long rows of reproduce.py --full (copy T=200 is --full only), as far as time allows
step reproduce_copy 600 "$OUT/reproduce.log" "$PYTHON" bench/reproduce.py --full \
    --only copy --arch dizzyrnn --seeds 1 --jobs 3 --device cuda --out "$SCRATCH/reproduce" \
    --runs "$SCRATCH/reproduce-runs"
if [ -f "$SCRATCH/reproduce/reproduce-full.json" ]; then
    cp "$SCRATCH/reproduce/reproduce-full.json" "$OUT/reproduce.json"
fi

{
    echo "{\"budget_s\": $BUDGET, \"wall_s\": $(($(date +%s) - START)), \"steps\": ["
    sep=""
    for s in "${STEPS[@]}"; do echo "$sep$s"; sep=","; done
    echo "]}"
} >"$OUT/summary.json"
rm -rf "$SCRATCH"
cat "$OUT/summary.json"
