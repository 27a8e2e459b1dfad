"""The Triton kernels against the pure-PyTorch reference: forward and gradients within
1e-5 in float32. Without a GPU they run in the Triton interpreter on CPU tensors
(conftest sets TRITON_INTERPRET=1); the tests marked gpu rerun them on CUDA."""

import copy
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from orthornn.models import build_model
from orthornn.models.activations import KINDS
from orthornn.models.ops import householder_apply, rnn_scan, rotation_chain
from orthornn.models.parametrizations import PackedGivens, RotationPermutation

from tests.unit.models.test_ops import opcheck_all

TOL = dict(atol=1e-5, rtol=1e-5)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def both_paths(monkeypatch, run, leaves):
    """run() -> tuple of outputs, under ORTHORNN_KERNELS=triton and =reference; asserts
    the outputs and the gradients of a random linear loss agree."""
    results = {}
    for mode in ("triton", "reference"):
        monkeypatch.setenv("ORTHORNN_KERNELS", mode)
        outs = [o for o in run() if o is not None]
        gen = torch.Generator().manual_seed(0)
        loss = sum((o * torch.randn(o.shape, generator=gen).to(o)).sum() for o in outs)
        results[mode] = (*outs, *torch.autograd.grad(loss, leaves))
    for fast, ref in zip(results["triton"], results["reference"], strict=True):
        torch.testing.assert_close(fast, ref, **TOL)


def scan_case(batch, steps, n, kind, gated, padded, device=DEVICE, dtype=torch.float32):
    """(run, leaves): the draws are float32 whatever dtype, so a float64 case made after the
    same seed holds the same values exactly."""
    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape) * scale).to(device, dtype).requires_grad_()

    u, w, h0 = leaf(batch, steps, n), leaf(n, n, scale=n**-0.5), leaf(batch, n)
    lengths = torch.randint(1, steps + 1, (batch,)) if padded else None
    bias = leaf(n, scale=0.3) if kind == "modrelu" else None
    gates = None
    if gated:
        gates = tuple(torch.tensor(v, device=device, dtype=dtype, requires_grad=True)
                      for v in (0.3, 0.6))
    leaves = [t for t in (u, w, h0, bias, *(gates or ())) if t is not None]

    def run(last_only=False, states_only=False):
        states, last = rnn_scan(u, w, h0, lengths, activation=kind, slope=0.1, bias=bias,
                                gates=gates)
        return (None if last_only else states, None if states_only else last)
    return run, leaves


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gated", [False, True])
def test_scan_every_activation(monkeypatch, kind, gated):
    run, leaves = scan_case(3, 5, 20, kind, gated, padded=True)
    both_paths(monkeypatch, run, leaves)


@pytest.mark.parametrize(("batch", "steps", "n", "kind", "gated", "padded"), [
    (1, 7, 5, "tanh", False, False),       # batch 1, odd T, n < 16
    (1, 9, 12, "modrelu", True, True),
    (17, 3, 33, "leaky_relu", True, True),  # two batch blocks, n not a power of two
    (4, 1, 6, "abs", False, True),          # a single step
])
def test_scan_shapes(monkeypatch, batch, steps, n, kind, gated, padded):
    run, leaves = scan_case(batch, steps, n, kind, gated, padded)
    both_paths(monkeypatch, run, leaves)


@pytest.mark.parametrize("which", ["last_only", "states_only"])
def test_scan_one_output_used(monkeypatch, which):
    run, leaves = scan_case(3, 6, 10, "tanh", True, padded=True)
    both_paths(monkeypatch, lambda: run(**{which: True}), leaves)


@pytest.mark.parametrize(("kind", "gated", "n"), [("modrelu", True, 40), ("tanh", False, 33)])
def test_scan_streamed_weight_path(monkeypatch, kind, gated, n):
    """n above the on-chip limit: W streamed in tiles (limits lowered to reach it cheaply)."""
    from orthornn.models.ops import triton_scan

    monkeypatch.setattr(triton_scan, "RESIDENT_MAX", 16)
    monkeypatch.setattr(triton_scan, "TILE", 16)
    assert triton_scan._config(n)[1] is False
    run, leaves = scan_case(5, 4, n, kind, gated, padded=True)
    both_paths(monkeypatch, run, leaves)


def record_phases(monkeypatch):
    """Wraps triton_scan._phases: [(kernel name, column programs, phases, counters after)]."""
    from orthornn.models.ops import triton_scan

    calls, original = [], triton_scan._phases

    def recording(kernel, grid, args, phases, columns, device, meta):
        original(kernel, grid, args, phases, columns, device, meta)
        counter = next(a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.int32)
        calls.append((kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), columns,
                      phases, counter.tolist()))
    monkeypatch.setattr(triton_scan, "_phases", recording)
    return calls


@pytest.mark.parametrize(("columns", "kind", "gated"), [(2, "modrelu", True), (4, "tanh", False),
                                                        (3, "abs", True)])
def test_scan_split_over_column_programs(monkeypatch, columns, kind, gated):
    """Several programs per group of sequences, each its own column tiles of every step,
    meeting at a barrier per step (under the interpreter one launch per phase, a step
    of the forward, a pass of the backward): the reference's states and gradients.
    n = 40 streams W (padded 64): 2 programs take 32 columns each, 3 and 4 take three
    tiles of 16 (40 = 16 + 16 + 8); 17 sequences make two groups."""
    monkeypatch.setenv("ORTHORNN_SCAN_COLUMNS", str(columns))
    calls = record_phases(monkeypatch)
    steps = 4
    run, leaves = scan_case(17, steps, 40, kind, gated, padded=True)
    both_paths(monkeypatch, run, leaves)
    used = min(columns, 3)
    # each program arrives once a step: after the forward's T steps and the backward's T
    # first passes, every group's counter holds T x (its programs)
    assert [(c, p, counts) for _, c, p, counts in calls] == [
        (used, steps, [steps * used] * 2), (used, 2 * steps, [steps * used] * 2)]


def test_program_ahead_of_its_group_waits(tmp_path):
    """The barrier holds a program back, forward and backward: one launch of every phase
    with 2 column programs under the interpreter (which runs the first program alone to
    its end) never passes the first barrier (the forward's step 1 needs the other half of
    h_0, the backward's pass 2 the other half of dz_{T-1}); one program a group finishes
    the same launch (its barrier is its own arrival)."""
    script = tmp_path / "ahead.py"
    script.write_text(
        "import os, sys, torch\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from orthornn.models.ops import triton_scan\n"
        "triton_scan._phases = lambda k, grid, args, phases, columns, device, meta: "
        "k[grid](*args, 0, phases, **meta)\n"
        "u, w = torch.randn(2, 3, 40), torch.randn(40, 40) / 7\n"
        "columns, which = int(sys.argv[1]), sys.argv[2]\n"
        "print('launching', flush=True)\n"
        "if which == 'forward':\n"
        "    out, *_ = triton_scan.scan_forward(u, w, torch.zeros(2, 40), None, None, None, "
        "None, 'tanh', 0.0, False, columns)\n"
        "else:\n"
        "    out, *_ = triton_scan.scan_backward(u, None, w, u, None, None, None, None, "
        "'tanh', 0.0, columns)\n"
        "print('done', float(out.abs().sum()), flush=True)\n")
    import subprocess
    import sys
    import time

    env = dict(os.environ, TRITON_INTERPRET="1")
    runs = {(columns, which): subprocess.Popen(
        [sys.executable, str(script), str(columns), which], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env)
        for columns in (1, 2) for which in ("forward", "backward")}
    try:
        for which in ("forward", "backward"):
            out, err = runs[1, which].communicate(timeout=300)
            assert runs[1, which].returncode == 0 and "done" in out, err[-2000:]
            assert runs[2, which].stdout.readline().strip() == "launching"
        time.sleep(5)  # one program's three steps take well under a second (the runs above)
        for which in ("forward", "backward"):
            assert runs[2, which].poll() is None, runs[2, which].communicate()
    finally:
        for run in runs.values():
            run.kill()
    for which in ("forward", "backward"):
        assert "done" not in runs[2, which].communicate()[0]


def test_column_programs_chosen_and_capped(monkeypatch):
    """The override, the table, then the caps: the tiles of n, and on a GPU the grid
    never larger than the programs resident at once (a spinning program must not wait
    for one that cannot start)."""
    from orthornn.models.ops import scan, triton_scan

    cpu = torch.device("cpu")
    assert scan.columns_for(128, 64) == 1  # no measured split yet: one program a group
    monkeypatch.setattr(scan, "COLUMN_TABLE", (((256, 128), 8), ((1024, 4096), 2)))
    assert [scan.columns_for(n, b) for n, b in ((128, 64), (256, 200), (512, 64))] == [8, 2, 2]
    assert scan.columns_for(2048, 64) == 1
    monkeypatch.setenv("ORTHORNN_SCAN_COLUMNS", "4")
    assert scan.columns_for(128, 64) == 4
    for bad in ("0", "two", "-3"):
        monkeypatch.setenv("ORTHORNN_SCAN_COLUMNS", bad)
        with pytest.raises(ValueError, match="ORTHORNN_SCAN_COLUMNS must be a positive"):
            scan.columns_for(128, 64)
    # tiles: n = 20 is one resident tile; n = 40 three of 16; n = 128 eight of 16
    assert [triton_scan.column_programs(n, 64, 8, cpu) for n in (20, 40, 128)] == [1, 3, 8]
    monkeypatch.setattr(triton_scan, "resident_programs", lambda device: 20)
    # B = 64: 4 groups, 20 resident programs: 5 a group at most, which n = 128 cuts in
    # 4 tiles of 32; B = 512: 32 groups, more than are resident: one program each
    assert triton_scan.column_programs(128, 64, 8, cpu) == 4
    assert triton_scan.column_programs(128, 512, 8, cpu) == 1
    _, meta, used = triton_scan.launch_meta(128, "relu", False, False, "ieee", 5)
    assert (used, meta["BN"], meta["GRID_SYNC"]) == (4, 32, True)
    assert triton_scan.launch_meta(128, "relu", False, False, "ieee", 1)[1]["GRID_SYNC"] is False


@pytest.mark.parametrize(("shape", "m", "transpose"), [
    ((1, 5), 3, False), ((17, 20), 20, True), ((2, 3, 12), 4, False)])
def test_householder_apply(monkeypatch, shape, m, transpose):
    x = torch.randn(*shape, device=DEVICE, requires_grad=True)
    y = torch.randn(shape[-1], m, device=DEVICE, requires_grad=True)
    both_paths(monkeypatch, lambda: (householder_apply(x, y, transpose),), [x, y])


@pytest.mark.parametrize(("n", "cols", "perms"), [(6, 6, False), (20, 17, True), (10, 1, True)])
def test_givens_apply(monkeypatch, n, cols, perms):
    p = RotationPermutation(n, 5) if perms else PackedGivens(n, n - 1)
    cos, sin, partner = (t.detach().to(DEVICE) for t in p.coefficients())
    cos, sin = cos.requires_grad_(), sin.requires_grad_()
    perm = p.permutations.to(DEVICE) if perms else None
    x = torch.randn(n, cols, device=DEVICE, requires_grad=True)
    both_paths(monkeypatch, lambda: (rotation_chain(x, cos, sin, partner, perm),),
               [x, cos, sin])


@pytest.mark.parametrize(("n", "cols", "perms"), [(20, 17, True), (12, 5, False)])
def test_givens_apply_rows_through_memory(monkeypatch, n, cols, perms):
    """The path of n > GATHER_MAX (rows permuted through a scratch buffer), reached at
    small n by lowering the bound."""
    from orthornn.models.ops import triton_chains

    monkeypatch.setattr(triton_chains, "GATHER_MAX", 8)
    assert triton_chains.givens_launch_meta(n, perms)[1]["GATHER_MEM"]
    test_givens_apply(monkeypatch, n, cols, perms)


def test_chains_with_fewer_rows_and_columns_per_program(monkeypatch):
    """Large n takes fewer vectors (Householder) or columns (Givens) per program;
    reached at small n by lowering the per-thread tile bound."""
    from orthornn.models.ops import triton_chains

    monkeypatch.setattr(triton_chains, "TILE_PER_THREAD", 1)
    assert triton_chains.householder_launch_meta(20, False)[1]["BB"] < 16
    assert triton_chains.givens_launch_meta(20, True)[1]["BC"] < 16
    test_householder_apply(monkeypatch, (17, 20), 7, True)
    test_givens_apply(monkeypatch, 20, 17, True)


def test_opcheck_triton(monkeypatch):
    monkeypatch.setenv("ORTHORNN_KERNELS", "triton")
    opcheck_all(DEVICE)


def train(model, mode, monkeypatch, steps=3, factored=False):
    monkeypatch.setenv("ORTHORNN_KERNELS", mode)
    gen = torch.Generator().manual_seed(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randn(4, 7, 3, generator=gen).to(DEVICE)
        y = torch.randint(0, 2, (4,), generator=gen).to(DEVICE)
        lengths = torch.tensor([7, 3, 5, 7], device=DEVICE)
        if factored:
            _, last = model.encode(x, lengths=lengths, factored=True)
            logits = model.head(last[:, : model.hidden_size])
        else:
            logits = model(x, lengths=lengths)
        loss = torch.nn.functional.cross_entropy(logits, y) + model.regularization()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return dict(model.named_parameters())


@pytest.mark.parametrize("arch", ["svdrnn", "scornn", "dizzyrnn", "sgornn", "vprnn", "fastrnn"])
def test_training_steps_match(monkeypatch, arch):
    model = build_model(arch, "classify", input_size=3, hidden_size=10, num_outputs=2,
                        seed=3).to(DEVICE)
    twin, start = copy.deepcopy(model), copy.deepcopy(model)
    fast, ref = train(model, "triton", monkeypatch), train(twin, "reference", monkeypatch)
    assert not all(torch.equal(p, ref[n]) for n, p in start.named_parameters()), "no update"
    for name, value in ref.items():
        torch.testing.assert_close(fast[name], value, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch", ["svdrnn", "sgornn"])
def test_factored_training_steps_match(monkeypatch, arch):
    """The per-step path: the Householder / Givens kernels inside the recurrence."""
    model = build_model(arch, "classify", input_size=3, hidden_size=10, num_outputs=2,
                        seed=3).to(DEVICE)
    twin = copy.deepcopy(model)
    fast = train(model, "triton", monkeypatch, factored=True)
    ref = train(twin, "reference", monkeypatch, factored=True)
    for name, value in ref.items():
        torch.testing.assert_close(fast[name], value, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "kind", "gated", "columns"), [
    (128, "relu", False, 1), (256, "modrelu", True, 1), (100, "tanh", True, 1),
    (128, "relu", False, 2), (128, "modrelu", True, 4), (256, "tanh", True, 8)])
def test_scan_on_gpu_larger_shapes(monkeypatch, n, kind, gated, columns):
    """On the device: auto picks Triton for CUDA tensors, and the kernels (resident W for
    n <= 32, streamed above; split over COLUMNS programs a group, which meet at a grid
    barrier a step in one launch) are as accurate as the float32 reference at realistic
    sizes, and every program of every group arrives once a step.

    Both float32 paths are measured against the reference in float64 on the same values:
    the kernels' error may be at most 4 times the float32 reference's, plus 1e-6 of the
    tensor's largest magnitude. Comparing the two float32 paths with each other at a fixed
    1e-4 failed on an H200 (one element of dW of 65,536 off by 1.2e-4, n = 256, modReLU,
    gated): dW sums B x T = 3,200 products, in another order in each path, and the
    difference was rounding on both sides, not an error of the kernels."""
    from orthornn.models.ops import dispatch

    monkeypatch.setenv("ORTHORNN_KERNELS", "auto")
    assert dispatch.use_triton("rnn_scan", (torch.zeros(1, device="cuda"),))
    assert torch.get_float32_matmul_precision() == "highest"  # full fp32 on both paths
    monkeypatch.setenv("ORTHORNN_SCAN_COLUMNS", str(columns))
    calls = record_phases(monkeypatch)
    results = {}
    for mode, dtype in (("triton", torch.float32), ("reference", torch.float32),
                        ("exact", torch.float64)):
        torch.manual_seed(1234)
        run, leaves = scan_case(64, 50, n, kind, gated, padded=True, device="cuda",
                                dtype=dtype)
        monkeypatch.setenv("ORTHORNN_KERNELS", "reference" if mode == "exact" else mode)
        states, last = run()
        results[mode] = (states, last, *torch.autograd.grad(states.sum() + last.sum(), leaves))
    names = ["states", "last", "d_u", "d_w", "d_h0", *(["d_bias"] if kind == "modrelu" else []),
             *(["d_a", "d_b2"] if gated else [])]
    for name, fast, ref, exact in zip(names, results["triton"], results["reference"],
                                      results["exact"], strict=True):
        error = (fast.double() - exact).abs().max().item()
        ref_error = (ref.double() - exact).abs().max().item()
        scale = exact.abs().max().item()
        print(f"{name}: kernels {error:.2e}, float32 reference {ref_error:.2e}, "
              f"largest {scale:.2e}")
        assert error <= 4 * ref_error + 1e-6 * scale, (name, error, ref_error, scale)
    # B = 64: 4 groups, far fewer programs than SMs, so the split is never capped here;
    # one program a group needs no counter (its barrier is its own)
    arrivals = 50 * columns if columns > 1 else 0
    assert [(c, counts) for _, c, _, counts in calls] == [(columns, [arrivals] * 4)] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
def test_kernels_built_for_gpu_refuse_cpu_tensors():
    """TRITON_INTERPRET set only after the kernels were built: a clear error, not a crash."""
    import os
    import subprocess
    import sys

    script = ("import os, torch\n"
              "from models.ops import triton_scan\n"
              "os.environ['TRITON_INTERPRET'] = '1'\n"
              "from models.ops import rnn_scan\n"
              "try:\n"
              "    rnn_scan(torch.randn(1, 2, 3), torch.eye(3))\n"
              "except RuntimeError as e:\n"
              "    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ORTHORNN_KERNELS"] = "triton"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, cwd=str(Path(__file__).resolve().parents[2]))
    assert "set before the first kernel runs" in done.stdout, done.stdout + done.stderr
