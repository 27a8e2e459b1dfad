#!/usr/bin/env bash
# One GPU check of the Triton kernels on a lent H100 / H200 (docs/gpu.md), in under
# 8 minutes, each step bounded so the later ones still run. In order of priority:
#   1. bench/perf/ops.py at the issue's point (T=784, n=128, B=64): the fused scan (one program
#      a group of sequences, and split over 2, 4, 8 column programs with a grid barrier a
#      step) against the Python loop and cuDNN's nn.RNN(relu), the compact-WY matrix against
#      householder_product
#   2. the chains: householder_apply and rotation_chain (Triton kernels, the Python-loop
#      reference) against the dense product (U built once, then one matmul)
#   3. training throughput: steps/s of svdrnn, scornn, dizzyrnn, sgornn at T=784, n=128,
#      B=64 (Triton kernels and the PyTorch reference) against nn.RNN(relu) and cuDNN LSTM
#   4. the Triton op tests with compiled kernels (no TRITON_INTERPRET), gpu-marked included,
#      in pytest-xdist workers (compilation in parallel; a worker a device fault kills is
#      replaced, the others go on)
#   5. bench/perf/ops.py over the docs' grid, the splits at T=784 (scan.COLUMN_TABLE's numbers)
#   6. the papers' long rows side by side on the card in the time left
#      (bench/experiments/long_rows.py: adding T=750 / 1000 and copy T=200 for scornn,
#      sgornn, vprnn, svdrnn, 3 seeds each, one process each); what finished is tabulated
# Run from the checkout: OUT=/some/dir bash bench/perf/gpu_check.sh. Writes 8 files to $OUT
# (the most a lent machine returns): summary.json (every step's exit code and seconds),
# log.txt (the card, driver and versions, then every step's output), ops.json (the point),
# ops-grid.json, ops-splits.json, chains.json, throughput.json, long-rows.json. The compile check (tests/integration/test_triton_compile.py) needs
# no GPU and is not rerun here.
# Environment: BUDGET (seconds, default 470), PYTHON (default python), SMOKE=1 (a tiny run
# of every step on the CPU through the Triton interpreter: checks the script, not the GPU).
set -u
OUT=${OUT:?set OUT to the folder for logs and results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python}
BUDGET=${BUDGET:-470}
SMOKE=${SMOKE:-0}
START=$(date +%s)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export ORTHORNN_KERNELS=auto
if [ "$SMOKE" = 1 ]; then
    export TRITON_INTERPRET=1 CHECK_DEVICE=cpu
else
    unset TRITON_INTERPRET
    export CHECK_DEVICE=cuda
fi
SCRATCH=$(mktemp -d)
LOG="$OUT/log.txt"
: >"$LOG"
STEPS=()

left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME LIMIT CMD...: run CMD under min(LIMIT, time left), log to $LOG, record it.
step() {
    local name=$1 limit=$2
    shift 2
    local remaining
    remaining=$(left)
    if [ "$remaining" -lt "$limit" ]; then limit=$remaining; fi
    if [ "$limit" -lt 15 ]; then
        STEPS+=("{\"step\": \"$name\", \"rc\": null, \"seconds\": 0, \"note\": \"no time left\"}")
        echo "== $name: skipped, no time left" >>"$LOG"
        return
    fi
    local t0
    t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*" >>"$LOG"
    timeout --signal=INT --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    local spent=$(($(date +%s) - t0))
    echo "== $name: exit $rc after ${spent}s" >>"$LOG"
    STEPS+=("{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $spent, \"limit\": $limit}")
}

# The package imports as orthornn.models (pyproject maps the top-level folders to it).
# Without an install, a sitecustomize on PYTHONPATH adds the checkout to the package's
# path, so orthornn.models is models/ whatever sys.path[0] is (worker processes too).
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
    timeout 30 nvidia-smi 2>&1 | head -20
    timeout 90 "$PYTHON" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version())
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton missing:", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "SMs", p.multi_processor_count, "memory GiB",
          round(p.total_memory / 2**30, 1), "capability", f"{p.major}.{p.minor}")
else:
    print("device: no CUDA")
try:
    import onnxruntime
    print("onnxruntime", onnxruntime.__version__, onnxruntime.get_available_providers())
except Exception as e:
    print("onnxruntime missing:", e)
import orthornn.models
print("orthornn.models from", orthornn.models.__file__)
EOF
} >>"$LOG" 2>&1

if [ "$SMOKE" = 1 ]; then
    OPS_POINT=(--smoke --reps 1 --columns 1 2)
    OPS_GRID=(--smoke --reps 1)
    OPS_SPLITS=(--smoke --reps 1 --columns 1 2 --methods fused)
    TESTS=(-k "householder_apply or scan_every_activation or column_programs")
    LONG_ROWS=(--quick --device cpu --jobs 2 --seeds 1 --only copy --arch svdrnn)
else
    OPS_POINT=(--steps 784 --hidden 128 --batch 64 --reps 5 --columns 1 2 4 8)
    OPS_GRID=(--reps 3)
    OPS_SPLITS=(--steps 784 --hidden 128 256 512 --batch 16 64 256 --reps 3 --columns 1 2 4 8
                --methods fused loop)
    TESTS=(-n 6)
    LONG_ROWS=(--device cuda --jobs 16)
fi

# 1. the op benchmark at the issue's point
step ops_point 75 "$PYTHON" bench/perf/ops.py "${OPS_POINT[@]}" --out "$OUT/ops.json"

# 2. the chains against the dense product (x @ U^T with U built once: the matmul alone,
#    and U built by compact WY / householder_product / the Givens chain on I, plus the matmul)
cat >"$SCRATCH/chains.py" <<'EOF'
import datetime, json, os, statistics, sys, time
import torch
from orthornn.models.ops import householder_apply, householder_matrix, rotation_chain
from orthornn.models.parametrizations import PackedGivens

out = sys.argv[1]
dev = torch.device(os.environ.get("CHECK_DEVICE", "cuda"))
smoke = dev.type == "cpu"
sizes, batch, reps = ((16,), 4, 1) if smoke else ((128, 256, 512), 64, 10)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def ms(fn):
    fn(), fn()  # warm-up: Triton compiles
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def both(make):
    """(forward ms, forward+backward ms) of make(grad) -> output."""
    def fwd():
        with torch.no_grad():
            make()

    def fwdbwd():
        make().sum().backward()
    return ms(fwd), ms(fwdbwd)


def modes(run):
    res = {}
    for mode in ("triton", "reference"):
        os.environ["ORTHORNN_KERNELS"] = mode
        res[mode] = both(run)
    os.environ["ORTHORNN_KERNELS"] = "auto"
    return res


rows = []
gen = torch.Generator().manual_seed(0)
for n in sizes:
    x = torch.randn(batch, n, generator=gen).to(dev).requires_grad_()
    y = torch.randn(n, n, generator=gen).to(dev).tril().requires_grad_()
    v = (y / y.diagonal()).detach()  # householder_product's unit-diagonal convention
    tau = 2 / (v.tril(-1).square().sum(0) + 1)
    v.requires_grad_()
    u_fixed = householder_matrix(y).detach()
    r = {"chain": "householder", "n": n, "m": n, "vectors": batch}
    for mode, (f, fb) in modes(lambda: householder_apply(x, y)).items():
        r[f"{mode}_fwd_ms"], r[f"{mode}_fwdbwd_ms"] = f, fb
    r["matmul_fwd_ms"], r["matmul_fwdbwd_ms"] = both(lambda: x @ u_fixed.T)
    r["compact_wy_then_matmul_fwd_ms"], r["compact_wy_then_matmul_fwdbwd_ms"] = both(
        lambda: x @ householder_matrix(y).T)
    r["householder_product_then_matmul_fwd_ms"], r["householder_product_then_matmul_fwdbwd_ms"] = \
        both(lambda: x @ torch.linalg.householder_product(v, tau).T)
    rows.append(r)
    print(r, flush=True)

    p = PackedGivens(n, n - 1, generator=gen)
    cos, sin, partner = (t.detach().to(dev) for t in p.coefficients())
    cos.requires_grad_(), sin.requires_grad_()
    eye = torch.eye(n, device=dev)
    xt = x.detach().T.contiguous().requires_grad_()
    w_fixed = rotation_chain(eye, cos, sin, partner).detach()
    r = {"chain": "givens", "n": n, "rotations": n - 1, "vectors": batch}
    for mode, (f, fb) in modes(lambda: rotation_chain(xt, cos, sin, partner)).items():
        r[f"{mode}_fwd_ms"], r[f"{mode}_fwdbwd_ms"] = f, fb
    for mode, (f, fb) in modes(lambda: rotation_chain(eye, cos, sin, partner) @ xt).items():
        r[f"{mode}_matrix_then_matmul_fwd_ms"], r[f"{mode}_matrix_then_matmul_fwdbwd_ms"] = f, fb
    r["matmul_fwd_ms"], r["matmul_fwdbwd_ms"] = both(lambda: w_fixed @ xt)
    rows.append(r)
    print(r, flush=True)
    json.dump({"date": datetime.date.today().isoformat(), "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "reps": reps, "rows": rows}, open(out, "w"), indent=1)
EOF
step chains 60 "$PYTHON" "$SCRATCH/chains.py" "$OUT/chains.json"

# 3. training throughput at T=784, n=128, B=64 (pixel-by-pixel MNIST's shape)
cat >"$SCRATCH/throughput.py" <<'EOF'
import datetime, json, os, sys, time
import torch
from orthornn.models import build_model

out = sys.argv[1]
dev = torch.device(os.environ.get("CHECK_DEVICE", "cuda"))
smoke = dev.type == "cpu"
T, n, B, classes, budget = (12, 16, 4, 10, 0.2) if smoke else (784, 128, 64, 10, 4.0)
gen = torch.Generator().manual_seed(0)
x = torch.randn(B, T, 1, generator=gen).to(dev)
y = torch.randint(0, classes, (B,), generator=gen).to(dev)
loss_fn = torch.nn.CrossEntropyLoss()
rows = []


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def rate(step):
    for _ in range(2):
        step()  # warm-up: Triton compiles, cuDNN picks its algorithms
    sync()
    count, start = 0, time.perf_counter()
    while count < 3 or (time.perf_counter() - start < budget and count < 200):
        step()
        count += 1
        sync()
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


def save():
    json.dump({"date": datetime.date.today().isoformat(), "torch": torch.__version__,
               "T": T, "n": n, "B": B,
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "rows": rows}, open(out, "w"), indent=1)


for name in ("rnn", "lstm"):
    rows.append({"model": f"nn.{'LSTM' if name == 'lstm' else 'RNN(relu)'}"
                 + (" (cuDNN)" if dev.type == "cuda" else ""),
                 "steps_per_s": rate(baseline(name))})
    print(rows[-1], flush=True)
    save()
# the kernels as dispatched, the scan split over 8 column programs a group (tiles of 16 at
# n = 128, a grid barrier a step), and the PyTorch reference
for arch in ("svdrnn", "scornn", "dizzyrnn", "sgornn"):
    for mode, columns in (("auto", "auto"), ("auto", "8"), ("reference", "auto")):
        os.environ["ORTHORNN_KERNELS"], os.environ["ORTHORNN_SCAN_COLUMNS"] = mode, columns
        label = ("triton" if mode == "auto" else mode) + ("" if columns == "auto" else
                                                          f" split {columns}")
        try:
            rows.append({"model": arch, "kernels": label,
                         "steps_per_s": rate(model_step(arch))})
        except Exception as e:  # one failure does not hide the other rows
            rows.append({"model": arch, "kernels": label, "error": repr(e)[:500]})
        print(rows[-1], flush=True)
        save()
EOF
step throughput 140 "$PYTHON" "$SCRATCH/throughput.py" "$OUT/throughput.json"

# 4. compiled kernels against the reference (the tests pick CUDA when it is there)
step tests 150 "$PYTHON" -m pytest -q -p no:cacheprovider "${TESTS[@]}" \
    tests/integration/test_triton_ops.py tests/unit/models/test_scan.py

# 5. the op benchmark over the docs' grid, then the splits at T=784 over n and B
step ops_grid 120 "$PYTHON" bench/perf/ops.py "${OPS_GRID[@]}" --out "$OUT/ops-grid.json"
step ops_splits 90 "$PYTHON" bench/perf/ops.py "${OPS_SPLITS[@]}" --out "$OUT/ops-splits.json"

# 6. the long rows side by side in the time left, keeping 20 s to write the summary
LONG_BUDGET=$(($(left) - 40))
if [ "$LONG_BUDGET" -ge 30 ]; then
    step long_rows $((LONG_BUDGET + 20)) "$PYTHON" bench/experiments/long_rows.py \
        "${LONG_ROWS[@]}" --budget "$LONG_BUDGET" --out "$SCRATCH/long" \
        --runs "$SCRATCH/long-runs"
fi
for f in "$SCRATCH"/long/long-rows*.json; do
    if [ -f "$f" ]; then cp "$f" "$OUT/long-rows.json"; fi
done

{
    echo "{\"budget_s\": $BUDGET, \"wall_s\": $(($(date +%s) - START)), \"smoke\": $SMOKE, \"steps\": ["
    sep=""
    for s in "${STEPS[@]}"; do echo "$sep$s"; sep=","; done
    echo "]}"
} >"$OUT/summary.json"
rm -rf "$SCRATCH"
cat "$OUT/summary.json"
