"""The scan op's explicit backward against autograd through the plain loop."""

import pytest
import torch
from orthornn.models.activations import KINDS, activation_forward
from orthornn.models.ops import rnn_scan, rnn_scan_steps


def _inputs(batch=3, steps=7, n=5, gated=False, kind="relu"):
    u = torch.randn(batch, steps, n, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(n, n, dtype=torch.float64) / n**0.5).requires_grad_()
    h0 = torch.randn(batch, n, dtype=torch.float64, requires_grad=True)
    bias = None
    if kind == "modrelu":
        bias = (torch.randn(n, dtype=torch.float64) * 0.3).requires_grad_()
    gates = None
    if gated:
        gates = (torch.tensor(0.3, dtype=torch.float64, requires_grad=True),
                 torch.tensor(0.6, dtype=torch.float64, requires_grad=True))
    return u, w, h0, bias, gates


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_scan_matches_autograd_loop(kind, gated, padded):
    u, w, h0, bias, gates = _inputs(gated=gated, kind=kind)
    lengths = torch.tensor([7, 2, 5]) if padded else None

    def act(z):
        return activation_forward(kind, z, 0.1, bias)

    fast = rnn_scan(u, w, h0, lengths, activation=kind, slope=0.1, bias=bias, gates=gates)
    ref = rnn_scan_steps(u, lambda h: h @ w.T, act, h0, lengths, gates)
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b)
    leaves = [t for t in (u, w, h0, bias, *(gates or ())) if t is not None]
    g_states, g_last = torch.randn_like(fast[0]), torch.randn_like(fast[1])
    grads_fast = torch.autograd.grad((fast[0] * g_states).sum() + (fast[1] * g_last).sum(), leaves)
    grads_ref = torch.autograd.grad((ref[0] * g_states).sum() + (ref[1] * g_last).sum(), leaves)
    for a, b in zip(grads_fast, grads_ref, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["tanh", "leaky_relu", "modrelu"])
def test_scan_gradcheck(kind):
    u, w, h0, bias, gates = _inputs(batch=2, steps=4, n=3, gated=True, kind=kind)
    lengths = torch.tensor([4, 2])
    extra = (bias,) if bias is not None else ()

    def run(u, w, h0, a, b2, *bias_):
        states, last = rnn_scan(u, w, h0, lengths, activation=kind, slope=0.2,
                                bias=bias_[0] if bias_ else None, gates=(a, b2))
        return states, last

    assert torch.autograd.gradcheck(run, (u, w, h0, *gates, *extra))


def test_scan_only_last_state_used():
    u, w, h0, _, _ = _inputs()
    _, last = rnn_scan(u, w, h0, activation="tanh")
    (g,) = torch.autograd.grad(last.sum(), w)
    _, last_ref = rnn_scan_steps(u, lambda h: h @ w.T, torch.tanh, h0)
    (g_ref,) = torch.autograd.grad(last_ref.sum(), w)
    torch.testing.assert_close(g, g_ref)


def test_padding_never_changes_results():
    u, w, h0, _, _ = _inputs(batch=1, steps=4)
    padded = torch.cat([u, torch.randn(1, 3, 5, dtype=torch.float64)], dim=1)
    states, last = rnn_scan(padded, w, h0, torch.tensor([4]), activation="relu")
    states_ref, last_ref = rnn_scan(u, w, h0, activation="relu")
    torch.testing.assert_close(last, last_ref)
    torch.testing.assert_close(states[:, :4], states_ref)
    assert torch.all(states[:, 4:] == 0)
