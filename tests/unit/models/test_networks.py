"""The model zoo through its public interface (docs/design.md's contract)."""

import math

import numpy as np
import pytest
import torch
from orthornn.models import ALIASES, ARCHITECTURES, build_model
from orthornn.models.activations import KINDS, Activation
from orthornn.models.ops import rnn_scan
from orthornn.models.registry import SVDRNN_ACTIVATIONS

from tests.helpers import loop_rnn, spectral_error

RECURRENT = [a for a in ARCHITECTURES if ARCHITECTURES[a].recurrent]
CELLS = [a for a in RECURRENT if a != "lstm"]  # the generic cell with a transition matrix
ORTHOGONAL = ["ornn", "scornn", "dizzyrnn", "vprnn", "sgornn"]
N, D, C, V = 8, 3, 4, 11


def make(arch, task="classify", **kw):
    kw = {"input_size": V if task == "lm" else D, "hidden_size": N,
          "num_outputs": None if task in ("lm", "regress") else C, **kw}
    return build_model(arch, task, **kw)


def example(task, batch=3, steps=6, dtype=torch.float32):
    if task == "lm":
        return torch.randint(0, V, (batch, steps))
    return torch.randn(batch, steps, D, dtype=dtype)


def test_registry_names():
    assert list(ARCHITECTURES) == ["rnn", "irnn", "lstm", "ornn", "svdrnn", "scornn", "dizzyrnn",
                                   "vprnn", "fastrnn", "sgornn", "svdmlp"]
    assert "spectral-rnn" in ARCHITECTURES and ALIASES["spectral-rnn"] == "svdrnn"
    assert make("spectral-rnn").arch == "svdrnn"


@pytest.mark.parametrize("arch", RECURRENT)
@pytest.mark.parametrize("task", ["classify", "regress", "seq2seq", "lm"])
def test_output_shapes(arch, task):
    model = make(arch, task)
    out = model(example(task))
    expected = {"classify": (3, C), "regress": (3, 1), "seq2seq": (3, 6, C), "lm": (3, 6, V)}
    assert out.shape == expected[task]
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("arch", CELLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_equals_plain_loop_with_recurrent_weight(arch, dtype):
    model = make(arch, "seq2seq").to(dtype)
    x = example("seq2seq", dtype=dtype)
    h0 = torch.randn(3, N, dtype=dtype)
    states, last = model.encode(x, h0)
    ref_states, ref_last = loop_rnn(model, x, h0)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(states, ref_states, atol=tol, rtol=tol)
    torch.testing.assert_close(last, ref_last, atol=tol, rtol=tol)
    # and the gradients of the fast scan equal autograd through that loop
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.randn_like(states)
    fast = torch.autograd.grad((model.encode(x, h0)[0] * g).sum(), params, allow_unused=True)
    ref = torch.autograd.grad((loop_rnn(model, x, h0)[0] * g).sum(), params, allow_unused=True)
    for a, b, p in zip(fast, ref, params, strict=True):
        if b is None:
            continue  # parameters the loop does not touch (none here but the head)
        torch.testing.assert_close(a, b, atol=tol * 10, rtol=tol * 10)
        assert p.shape == a.shape


# The cells' activations written out in numpy from their papers: loop_rnn and the scan
# tests take the package's own, so a wrong formula there would pass them.
SLOPE = 0.2
HAND = {
    "tanh": lambda z, b: (np.exp(z) - np.exp(-z)) / (np.exp(z) + np.exp(-z)),
    "relu": lambda z, b: np.maximum(z, 0),
    "leaky_relu": lambda z, b: np.maximum(SLOPE * z, z),  # svdRNN: max(leak x, x)
    # scoRNN eq. 3: (z / |z|) (|z| + b) where |z| + b >= 0, else 0; z / |z| = sign(z) (real)
    "modrelu": lambda z, b: np.where(np.abs(z) + b >= 0, np.sign(z) * (np.abs(z) + b), 0),
    "abs": lambda z, b: np.where(z < 0, -z, z),  # DizzyRNN section 4.3
}


def test_every_cell_activation_has_a_hand_formula():
    used = {make(arch).layer.activation.kind for arch in CELLS} | set(SVDRNN_ACTIVATIONS)
    assert used == set(KINDS) == set(HAND)


@pytest.mark.parametrize("kind", KINDS)
def test_activation_is_the_papers_formula(kind):
    z = torch.cat([torch.randn(5, 16, dtype=torch.float64) * 2,
                   torch.zeros(1, 16, dtype=torch.float64)])
    act = Activation(kind, 16, SLOPE).double()
    if kind == "modrelu":
        with torch.no_grad():
            act.bias.normal_(0, 1)  # both signs: some |z| + b < 0 are cut to 0
    bias = act.bias.detach().numpy() if act.bias is not None else None
    expected = HAND[kind](z.numpy(), bias)
    with torch.no_grad():
        np.testing.assert_allclose(act(z).numpy(), expected, rtol=1e-12, atol=1e-12)
        # the scan the cells' dense path runs: one step from h0 = 0 is g(u)
        states, _ = rnn_scan(z[:, None], torch.zeros(16, 16, dtype=torch.float64),
                             activation=kind, slope=SLOPE, bias=act.bias)
    np.testing.assert_allclose(states[:, 0].numpy(), expected, rtol=1e-12, atol=1e-12)
    if kind == "modrelu":
        assert 0 < (expected == 0).mean() < 0.9  # the bias cut some units and kept others


@pytest.mark.parametrize("arch", CELLS)
def test_factored_path_equals_dense_path(arch):
    model = make(arch, "seq2seq").double()
    x = example("seq2seq", dtype=torch.float64)
    lengths = torch.tensor([6, 3, 1])
    dense = model.encode(x, lengths=lengths)
    factored = model.encode(x, lengths=lengths, factored=True)
    for a, b in zip(dense, factored, strict=True):
        torch.testing.assert_close(a, b)
    params = list(model.layer.parameters())
    g1 = torch.autograd.grad(dense[0].sum() + dense[1].square().sum(), params)
    g2 = torch.autograd.grad(factored[0].sum() + factored[1].square().sum(), params)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("arch", RECURRENT)
@pytest.mark.parametrize("task", ["classify", "seq2seq", "lm"])
def test_padded_batch_equals_each_sequence_alone(arch, task):
    model = make(arch, task).double()
    lengths = [5, 2, 7, 1]
    seqs = [example(task, batch=1, steps=t, dtype=torch.float64) for t in lengths]
    padded = torch.zeros(4, 7, *seqs[0].shape[2:], dtype=seqs[0].dtype)
    for i, s in enumerate(seqs):
        padded[i, : s.shape[1]] = s
        if task != "lm":  # garbage in the padding must not leak into the result
            padded[i, s.shape[1]:] = 100.0
    out = model(padded, lengths=torch.tensor(lengths))
    _, last = model.encode(padded, lengths=torch.tensor(lengths))
    for i, s in enumerate(seqs):
        alone = model(s)
        if task == "classify":
            torch.testing.assert_close(out[i], alone[0])
        else:
            torch.testing.assert_close(out[i, : lengths[i]], alone[0])
        torch.testing.assert_close(last[i], model.encode(s)[1][0])


@pytest.mark.parametrize("arch", RECURRENT)
def test_encode_carries_state_across_calls(arch):
    model = make(arch, "lm").double()
    x = example("lm", steps=9)
    states, last = model.encode(x)
    assert states.shape == (3, 9, N) and last.shape == (3, model.state_size)
    s1, h = model.encode(x[:, :4])
    s2, h = model.encode(x[:, 4:], h0=h)
    torch.testing.assert_close(torch.cat([s1, s2], dim=1), states)
    torch.testing.assert_close(h, last)


@pytest.mark.parametrize("arch", RECURRENT)
def test_recurrent_weight(arch):
    w = make(arch).recurrent_weight()
    if arch == "lstm":
        assert w is None
        return
    assert w.shape == (N, N)
    if arch in ORTHOGONAL:
        assert spectral_error(w) <= 1e-5
    if arch == "irnn":
        torch.testing.assert_close(w, torch.eye(N))


@pytest.mark.parametrize("n,ni,ny,m1,m2", [(16, 3, 4, 16, 16), (20, 5, 2, 7, 3), (9, 1, 10, 1, 9)])
def test_svdrnn_parameter_count_is_the_papers(n, ni, ny, m1, m2):
    model = build_model("svdrnn", "classify", input_size=ni, hidden_size=n, num_outputs=ny,
                        m1=m1, m2=m2)
    paper = (ny + ni + m1 + m2 + 2) * n - (m1**2 + m2**2 - m1 - m2) // 2
    # the paper's readout y = Y h has no bias; ours adds one per output
    assert sum(p.numel() for p in model.parameters()) == paper + ny


def test_svdrnn_singular_values_bounded():
    model = make("svdrnn", r=0.1, sigma_star=0.9)
    with torch.no_grad():
        model.layer.transition.singular.logits.normal_(0, 5)
    s = torch.linalg.svdvals(model.recurrent_weight().detach())
    assert s.max() <= 1.0 + 1e-6 and s.min() >= 0.8 - 1e-6


def test_dizzyrnn_gradient_norm_is_preserved_theorem3():
    steps, n = 1000, 16
    model = build_model("dizzyrnn", "regress", input_size=2, hidden_size=n).double()
    x = torch.randn(1, steps, 2, dtype=torch.float64)
    h0 = torch.randn(1, n, dtype=torch.float64, requires_grad=True)
    _, last = model.encode(x, h0)
    c = torch.randn(1, n, dtype=torch.float64)
    (grad_h0,) = torch.autograd.grad((last * c).sum(), h0)  # dL/dh_T = c
    assert grad_h0.norm().item() == pytest.approx(c.norm().item(), rel=1e-9)


def test_vanilla_rnn_does_not_preserve_gradient_norm():
    # the contrast that makes the DizzyRNN test meaningful
    model = build_model("rnn", "regress", input_size=2, hidden_size=16).double()
    x = torch.randn(1, 200, 2, dtype=torch.float64)
    h0 = torch.randn(1, 16, dtype=torch.float64, requires_grad=True)
    _, last = model.encode(x, h0)
    (grad_h0,) = torch.autograd.grad(last.sum(), h0)
    assert grad_h0.norm().item() < 1e-3 * math.sqrt(16)


def test_sgornn_gate_constraint_holds_for_any_parameters():
    gates = make("sgornn").layer.gates
    values = torch.tensor([-50.0, -5.0, -1.0, 0.0, 0.5, 1.0, 5.0, 50.0])
    for alpha in values:
        for beta in values:
            with torch.no_grad():
                gates.alpha.fill_(alpha)
                gates.beta.fill_(beta)
            a, b2 = gates()
            assert 0 <= a.item() <= 0.5
            assert b2.item() <= 1 - 2 * a.item() + 1e-7  # SGORNN eq. 3
            assert b2.item() <= torch.sigmoid(beta).item() + 1e-7
    fast = make("fastrnn").layer.gates
    with torch.no_grad():
        fast.alpha.fill_(2.0)
        fast.beta.fill_(2.0)
    a, b2 = fast()
    assert b2.item() == pytest.approx(torch.sigmoid(torch.tensor(2.0)).item())  # no clip


def test_sgornn_gates_start_inside_the_constraint_and_both_get_gradient():
    # FastRNN's alpha = -3, beta = 3 put b2 = 0.953 > 1 - 2a = 0.905: a clip after the
    # sigmoid would be active at step 0 and beta's gradient exactly zero.
    torch.manual_seed(0)
    model = make("sgornn")
    a, b2 = model.layer.gates()
    assert a.item() == pytest.approx(1 / (1 + math.exp(3)), rel=1e-5)  # FastRNN's a
    assert b2.item() == pytest.approx(0.95 * (1 - 2 * a.item()), rel=1e-5)
    assert b2.item() < 1 - 2 * a.item()
    x = torch.randn(4, 12, D)
    model(x).square().sum().backward()
    gates = model.layer.gates
    assert gates.alpha.grad is not None and gates.alpha.grad.abs().item() > 1e-6
    assert gates.beta.grad is not None and gates.beta.grad.abs().item() > 1e-6


def test_sgornn_gate_initial_values_are_options_and_the_step_is_the_papers():
    model = make("sgornn", a_init=0.2, b2_init=0.5)
    a, b2 = model.layer.gates()
    assert (a.item(), b2.item()) == (pytest.approx(0.2), pytest.approx(0.5))
    # one step from h0 against SGORNN eq. 1 written out: h1 = a relu(W_x x + W h0 + b) + b2 h0
    layer = model.layer
    x, h0 = torch.randn(3, 1, D), torch.randn(3, N)
    _, h1 = layer(x, h0)
    w = layer.recurrent_weight()
    z = x[:, 0] @ layer.input.weight.T + layer.input.bias + h0 @ w.T
    torch.testing.assert_close(h1, 0.2 * torch.relu(z) + 0.5 * h0, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="b2_init"):
        make("sgornn", a_init=0.2, b2_init=0.6)  # 0.6 > 1 - 2 * 0.2
    with pytest.raises(ValueError, match="a_init"):
        make("sgornn", a_init=0.5)


def test_dizzyrnn_svd_regularization():
    model = make("dizzyrnn", svd=True, svd_lambda=0.5)
    with torch.no_grad():
        model.layer.transition.singular.values.copy_(torch.linspace(0.5, 1.5, N))
    s = model.layer.transition.singular.values
    torch.testing.assert_close(model.regularization(), 0.25 * (s - 1).square().sum())
    torch.testing.assert_close(torch.linalg.svdvals(model.recurrent_weight().detach()),
                               torch.sort(s.detach(), descending=True).values)
    assert make("dizzyrnn").regularization().item() == 0.0


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_param_groups_partition_the_parameters(arch):
    model = make(arch)
    groups = model.param_groups(lr=1e-3, orthogonal_lr=1e-4)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    names = {g["name"]: g for g in groups}
    if arch in [*ORTHOGONAL, "svdrnn", "svdmlp"]:
        assert names["orthogonal"]["lr"] == 1e-4 and names["orthogonal"]["params"]
    else:
        assert "orthogonal" not in names
    torch.optim.RMSprop(groups)  # the groups are what optimizers take


def test_scornn_orthogonal_group_holds_the_skew_parameters():
    model = make("scornn", rho=3)
    (group,) = [g for g in model.param_groups(1e-3, 1e-5) if g["name"] == "orthogonal"]
    assert [p is model.layer.transition.skew for p in group["params"]] == [True]
    assert int((model.layer.transition.diagonal == -1).sum()) == 3


@pytest.mark.parametrize("arch", [*ORTHOGONAL, "svdrnn"])
def test_training_keeps_transition_orthogonal(arch):
    model = make(arch, "regress", hidden_size=16)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    x, y = torch.randn(16, 10, D), torch.randn(16, 1)
    losses = []
    for _ in range(100):
        opt.zero_grad()
        loss = (model(x) - y).square().mean() + model.regularization()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    if arch != "svdrnn":
        assert spectral_error(model.recurrent_weight()) <= 1e-5
    else:
        s = torch.linalg.svdvals(model.recurrent_weight().detach())
        assert s.max() <= 1.01 + 1e-5 and s.min() >= 0.99 - 1e-5


# -- svdmlp ----------------------------------------------------------------------------

def test_svdmlp():
    model = build_model("svdmlp", "classify", input_size=12, hidden_size=20, num_outputs=5, depth=3)
    assert model(torch.randn(4, 12)).shape == (4, 5)
    assert model(torch.randn(4, 3, 4)).shape == (4, 5)  # [B, T, d] flattened
    assert len(model.layers) == 4
    for layer in model.layers:
        p = layer.weight_param
        k = min(p.rows, p.cols)
        assert p.left.reflectors + p.right.reflectors == 2 * k  # Theorem 4
        s = torch.linalg.svdvals(p.matrix().detach())
        assert s.max() <= 1.5 + 1e-5 and s.min() >= 0.5 - 1e-5
    assert model.recurrent_weight() is None
    with pytest.raises(ValueError, match="not recurrent"):
        model.encode(torch.randn(4, 12))


# -- bad input -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    ({"arch": "nope"}, "unknown architecture 'nope'; valid names: rnn, irnn, lstm"),
    ({"arch": "rnn", "task": "translate"}, "task must be one of"),
    ({"arch": "svdmlp", "task": "lm"}, "task must be one of 'classify', 'regress'"),
    ({"arch": "svdrnn", "m1": 9}, "m1 must be an integer in \\[1, 8\\]"),
    ({"arch": "svdrnn", "m2": 0}, "m2 must be an integer in \\[1, 8\\]"),
    ({"arch": "ornn", "m": 20}, "m must be an integer in \\[1, 8\\]"),
    ({"arch": "scornn", "rho": 9}, "rho must be an integer in \\[0, 8\\]"),
    ({"arch": "dizzyrnn", "rotations": 8}, "rotations must be an integer in \\[1, 7\\]"),
    ({"arch": "dizzyrnn", "hidden_size": 7}, "hidden_size must be even"),
    ({"arch": "vprnn", "rotations": 7}, "rotations must be an integer in \\[1, 6\\]"),
    ({"arch": "sgornn", "hidden_size": 9}, "hidden_size must be even"),
    ({"arch": "rnn", "activation": "gelu"}, "activation must be one of 'tanh', 'relu'"),
    ({"arch": "rnn", "m1": 3}, "unknown option\\(s\\) m1 for rnn; allowed: activation"),
    ({"arch": "rnn", "hidden_size": 0}, "hidden_size must be an integer"),
    ({"arch": "rnn", "num_outputs": 1}, "num_outputs must be an integer >= 2"),
    ({"arch": "dizzyrnn", "svd": "yes"}, "svd must be true or false"),
])
def test_bad_options_raise_value_error(kwargs, match):
    kwargs = {"task": "classify", "input_size": D, "hidden_size": N, "num_outputs": C, **kwargs}
    arch, task = kwargs.pop("arch"), kwargs.pop("task")
    with pytest.raises(ValueError, match=match):
        build_model(arch, task, **kwargs)


def test_bad_inputs_raise_value_error():
    model = make("svdrnn")
    with pytest.raises(ValueError, match="x must be a float tensor \\[B, T, 3\\]"):
        model(torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match="lengths must lie in \\[1, 5\\]"):
        model(torch.randn(2, 5, D), lengths=torch.tensor([6, 1]))
    with pytest.raises(ValueError, match="lengths must be an integer tensor \\[2\\]"):
        model(torch.randn(2, 5, D), lengths=torch.tensor([3]))
    with pytest.raises(ValueError, match="h0 must be a tensor \\[2, 8\\]"):
        model.encode(torch.randn(2, 5, D), h0=torch.zeros(2, 7))
    lm = make("svdrnn", "lm")
    with pytest.raises(ValueError, match="token ids must lie in \\[0, 10\\]"):
        lm(torch.tensor([[1, 11]]))
    with pytest.raises(ValueError, match="x must be token ids"):
        lm(torch.randn(1, 3))


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_module_apply_reaches_every_submodule(arch):
    """model.apply(fn), how PyTorch users initialise weights, works on every architecture
    (a parametrization's own product is multiply(), not nn.Module.apply's name)."""
    model = build_model(arch, "classify", input_size=3, hidden_size=8, num_outputs=4)
    seen = []

    def init(module):
        seen.append(module)
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.zeros_(module.bias)

    assert model.apply(init) is model
    assert seen[-1] is model and len(seen) == len(list(model.modules()))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears or arch == "svdmlp"  # svdmlp: U diag(s) V^T layers only
    assert all(torch.count_nonzero(m.bias) == 0 for m in linears)
