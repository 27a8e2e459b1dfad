"""The custom ops on their reference (CPU) path: registration, dispatch and the
Householder and Givens ops against independent dense references."""

import pytest
import torch
from orthornn.models.ops import (
    dispatch,
    householder_apply,
    householder_matrix,
    rnn_scan,
    rotation_chain,
)
from orthornn.models.parametrizations import PackedGivens, RotationPermutation

from tests.helpers import givens_dense


def scan_args(batch=3, steps=5, n=6, kind="modrelu", gated=True, padded=True,
              dtype=torch.float32, device="cpu"):
    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, dtype=dtype) * scale).to(device).requires_grad_()

    u, w, h0 = leaf(batch, steps, n), leaf(n, n, scale=n**-0.5), leaf(batch, n)
    lengths = torch.randint(1, steps + 1, (batch,), device=device) if padded else None
    a = b2 = bias = None
    if gated:
        a = torch.tensor(0.3, dtype=dtype, device=device, requires_grad=True)
        b2 = torch.tensor(0.6, dtype=dtype, device=device, requires_grad=True)
    if kind == "modrelu":
        bias = leaf(n, scale=0.3)
    return (u, w, h0, lengths, a, b2, bias, kind, 0.1, True)


def test_scan_inference_saves_nothing():
    args = scan_args()
    with torch.no_grad():
        states, last, pre, carried = torch.ops.orthornn.rnn_scan(*args[:-1], False)
    assert pre.numel() == carried.numel() == 0
    ref = torch.ops.orthornn.rnn_scan(*args)
    torch.testing.assert_close((states, last), ref[:2])


def givens_args(n=6, cols=5, perms=True, keep=True, device="cpu"):
    p = RotationPermutation(n, 3) if perms else PackedGivens(n, 4)
    cos, sin, partner = (t.detach().to(device) for t in p.coefficients())
    return (torch.randn(n, cols, device=device, requires_grad=True), cos.requires_grad_(),
            sin.requires_grad_(), partner, p.permutations.to(device) if perms else None, keep)


def opcheck_all(device="cpu"):
    """Each op with inputs that exercise every optional branch it has."""
    for kind, gated, padded in [("modrelu", True, True), ("tanh", False, False)]:
        args = scan_args(kind=kind, gated=gated, padded=padded, device=device)
        torch.library.opcheck(torch.ops.orthornn.rnn_scan.default, args)
        inference = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args[:-1])
        torch.library.opcheck(torch.ops.orthornn.rnn_scan.default, (*inference, False))
    x = torch.randn(4, 5, device=device, requires_grad=True)
    y = torch.randn(5, 3, device=device, requires_grad=True)
    for transpose in (False, True):
        torch.library.opcheck(torch.ops.orthornn.householder_apply.default, (x, y, transpose))
    for perms in (True, False):
        torch.library.opcheck(torch.ops.orthornn.givens_apply.default,
                              givens_args(perms=perms, device=device))


def test_opcheck_reference(monkeypatch):
    monkeypatch.setenv("ORTHORNN_KERNELS", "reference")
    opcheck_all()


@pytest.mark.parametrize("value", ["cuda", "Triton please", "0"])
def test_bad_kernel_mode_is_rejected(monkeypatch, value):
    monkeypatch.setenv("ORTHORNN_KERNELS", value)
    with pytest.raises(ValueError, match=r"ORTHORNN_KERNELS must be one of auto, triton, refer"):
        rnn_scan(torch.randn(1, 2, 3), torch.eye(3))


def test_auto_uses_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("ORTHORNN_KERNELS", "auto")
    x = torch.randn(2, 3)
    assert not dispatch.use_triton("op", (x,))
    monkeypatch.setenv("ORTHORNN_KERNELS", "reference")
    assert not dispatch.use_triton("op", (x,))


def test_forced_triton_needs_the_interpreter_on_cpu(monkeypatch):
    monkeypatch.setenv("ORTHORNN_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1|not installed"):
        dispatch.use_triton("op", (torch.randn(2),))


def test_forced_triton_rejects_unsupported_inputs(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("ORTHORNN_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    u = torch.randn(1, 2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="rnn_scan supports float32 only"):
        rnn_scan(u, torch.eye(3, dtype=torch.float64))


class _CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on CUDA: enough for the dispatch decision."""

    @property
    def is_cuda(self):
        return True


@pytest.mark.parametrize(("mode", "n", "kernel"), [
    ("auto", 256, True), ("auto", 512, False), ("auto", 1024, False),
    ("triton", 256, True), ("triton", 512, True), ("triton", 1024, True),
    ("reference", 256, False)])
def test_scan_dispatch_by_hidden_size(monkeypatch, mode, n, kernel):
    """auto runs the fused scan on CUDA only up to scan.MAX_AUTO_HIDDEN (measured slower
    than the reference loop at n = 512 on an H200, docs/gpu.md); triton mode forces it
    at any size the kernel takes."""
    from orthornn.models.ops import scan

    assert scan.MAX_AUTO_HIDDEN == 256
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setenv("ORTHORNN_KERNELS", mode)
    u = torch.zeros(2, 3, n).as_subclass(_CudaLooking)
    w = torch.zeros(n, n).as_subclass(_CudaLooking)
    assert u.is_cuda and w.is_cuda
    assert scan._triton(u, w) is kernel


def test_slower_is_not_an_error_when_triton_is_forced(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setenv("ORTHORNN_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_triton("op", (torch.randn(2),), slower="is slower here")
    monkeypatch.setenv("ORTHORNN_KERNELS", "auto")
    assert not dispatch.use_triton("op", (torch.randn(2).as_subclass(_CudaLooking),),
                                   slower="is slower here")


def test_scan_rejects_bad_input():
    u = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="activation must be one of"):
        rnn_scan(u, torch.eye(4), activation="gelu")
    with pytest.raises(ValueError, match=r"weight must be a tensor \[4, 4\]"):
        rnn_scan(u, torch.eye(3))
    with pytest.raises(ValueError, match="bias must be a tensor"):
        rnn_scan(u, torch.eye(4), activation="modrelu")
    with pytest.raises(ValueError, match="u must have at least one sequence, step and unit"):
        rnn_scan(torch.randn(2, 0, 4), torch.eye(4))
    with pytest.raises(ValueError, match="lengths must be an integer tensor"):
        rnn_scan(u, torch.eye(4), lengths=torch.tensor([1.0, 2.0]))


def reflector_product(y):
    """U = H(y_0) ... H(y_{m-1}) by explicit dense reflectors (eq. 1)."""
    n = y.shape[0]
    u = torch.eye(n, dtype=y.dtype)
    for i in range(y.shape[1]):
        v = y[:, i]
        u = u @ (torch.eye(n, dtype=y.dtype) - 2 * torch.outer(v, v) / (v @ v))
    return u


@pytest.mark.parametrize("transpose", [False, True])
def test_householder_apply_matches_dense_product(transpose):
    x = torch.randn(2, 4, 7, dtype=torch.float64, requires_grad=True)
    y = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    out = householder_apply(x, y, transpose)
    u = reflector_product(y)
    ref = x @ (u if transpose else u.T)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad((out * g).sum(), (x, y)),
                               torch.autograd.grad((ref * g).sum(), (x, y)))


def test_householder_matrix_matches_lapack():
    y = torch.randn(6, 4, dtype=torch.float64).tril()
    # householder_product wants unit-diagonal vectors v = y / y_ii and tau = 2 / ||v||^2.
    v = y / y.diagonal()
    tau = 2 / (v.tril(-1).square().sum(0) + 1)
    # It returns the first m columns of the product.
    torch.testing.assert_close(householder_matrix(y)[:, :4],
                               torch.linalg.householder_product(v, tau))


def test_givens_apply_matches_dense_rotations():
    p = PackedGivens(6, 3)
    x = torch.randn(6, 4, dtype=torch.float64)
    w = torch.eye(6, dtype=torch.float64)
    for j in range(3):  # W = P_1 P_2 P_3
        pairs = torch.stack([p.first[j], p.second[j]], 1).tolist()
        w = w @ givens_dense(6, pairs, p.angles[j].detach().double())
    cos, sin, partner = (t.detach().double() if t.is_floating_point() else t
                         for t in p.coefficients())
    torch.testing.assert_close(rotation_chain(x, cos, sin, partner), w @ x)


def test_givens_apply_skips_saving_without_grad():
    args = givens_args(keep=False)
    out, saved = torch.ops.orthornn.givens_apply(*args)
    assert saved.numel() == 0
    torch.testing.assert_close(out, torch.ops.orthornn.givens_apply(*args[:-1], True)[0])


def test_compiled_model_matches_eager():
    """torch.compile traces the ops through their fake implementations and autograd
    formulas (aot_eager: no C++ toolchain needed)."""
    from orthornn.models import build_model

    layer = build_model("sgornn", "classify", input_size=3, hidden_size=8, num_outputs=2).layer
    x, lengths = torch.randn(2, 5, 3), torch.tensor([5, 3])
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    params = list(layer.parameters())
    for factored in (False, True):  # rnn_scan + givens_apply, then givens_apply per step
        eager_out = layer(x, lengths=lengths, factored=factored)
        compiled_out = compiled(x, lengths=lengths, factored=factored)
        torch.testing.assert_close(compiled_out, eager_out)
        torch.testing.assert_close(
            torch.autograd.grad(sum(o.sum() for o in compiled_out), params),
            torch.autograd.grad(sum(o.sum() for o in eager_out), params))
