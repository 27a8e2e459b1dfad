"""Parametrizations against independent references (torch.linalg, explicit dense
products, the papers' formulas)."""

import itertools
import math

import pytest
import torch
from orthornn.models.ops import rotation_chain
from orthornn.models.parametrizations import (
    BoundedSingularValues,
    DenseTransition,
    FreeSingularValues,
    HouseholderChain,
    PackedGivens,
    RotationPermutation,
    ScaledCayley,
    SVDForm,
    pair_coefficients,
    round_robin_pairs,
)
from torch.func import functional_call

from tests.helpers import givens_dense, householder_qr_vectors, spectral_error

ORTHOGONAL = {
    "householder": lambda n: HouseholderChain(n, max(1, n // 2)),
    "householder-full": lambda n: HouseholderChain(n),
    "cayley": lambda n: ScaledCayley(n, rho=n // 3),
    "givens": lambda n: PackedGivens(n, n - 1),
    "rotation-permutation": lambda n: RotationPermutation(n),
    "svd-unit": lambda n: SVDForm(HouseholderChain(n), BoundedSingularValues(n, 0.0, 1.0),
                                  HouseholderChain(n)),
}

ALL = {
    **ORTHOGONAL,
    "svd": lambda n: SVDForm(HouseholderChain(n, 3), BoundedSingularValues(n, 0.3, 1.0),
                             HouseholderChain(n, 2)),
    "svd-givens": lambda n: SVDForm(PackedGivens(n, 3), FreeSingularValues(n, 0.1),
                                    PackedGivens(n, 2)),
    "svd-rect-wide": lambda n: SVDForm(HouseholderChain(n // 2),
                                       BoundedSingularValues(n // 2, 0.3, 1.0),
                                       HouseholderChain(n, n // 2)),
    "svd-rect-tall": lambda n: SVDForm(HouseholderChain(n, n // 2),
                                       BoundedSingularValues(n // 2, 0.3, 1.0),
                                       HouseholderChain(n // 2)),
    "dense": lambda n: DenseTransition(n),
}


def _randomize(p):
    with torch.no_grad():
        for param in p.parameters():
            param.normal_()
    return p


@pytest.mark.parametrize("name", ORTHOGONAL)
@pytest.mark.parametrize("n", [2, 6, 32, 128])
def test_orthogonal_for_random_parameters(name, n):
    for _ in range(3):
        w = _randomize(ORTHOGONAL[name](n)).matrix()
        assert spectral_error(w) <= 1e-5


@pytest.mark.parametrize("name", ORTHOGONAL)
def test_orthogonal_after_100_optimizer_steps(name):
    p = ORTHOGONAL[name](32)
    target = torch.randn(32, 32)
    opt = torch.optim.Adam(p.parameters(), lr=0.05)
    first = None
    for _ in range(100):
        opt.zero_grad()
        loss = (p.matrix() - target).square().sum()
        first = loss.item() if first is None else first
        loss.backward()
        opt.step()
    assert loss.item() < first  # it did train
    assert spectral_error(p.matrix()) <= 1e-5


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_factored_apply_equals_dense_matrix(name, dtype):
    p = _randomize(ALL[name](8)).to(dtype)
    w = p.matrix()
    x = torch.randn(5, w.shape[1], dtype=dtype)
    xt = torch.randn(4, 3, w.shape[0], dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(p.multiply(x), x @ w.T, atol=tol, rtol=tol)
    torch.testing.assert_close(p.multiply(xt, transpose=True), xt @ w, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ALL)
def test_factored_and_dense_gradients_match(name):
    p = _randomize(ALL[name](8)).double()
    x = torch.randn(5, p.matrix().shape[1], dtype=torch.float64)
    g = torch.randn(5, p.matrix().shape[0], dtype=torch.float64)
    params = list(p.parameters())
    dense = torch.autograd.grad((x @ p.matrix().T * g).sum(), params)
    factored = torch.autograd.grad((p.multiply(x) * g).sum(), params)
    for a, b in zip(dense, factored, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


class _MatrixOf(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self):
        return self.p.matrix()


@pytest.mark.parametrize("name", ALL)
def test_gradcheck(name):
    wrapper = _MatrixOf(_randomize(ALL[name](6)).double())
    names = [k for k, _ in wrapper.named_parameters()]
    values = tuple(v.detach().clone().requires_grad_() for _, v in wrapper.named_parameters())

    def matrix(*vals):
        return functional_call(wrapper, dict(zip(names, vals, strict=True)), ())

    assert torch.autograd.gradcheck(matrix, values)


# -- Householder ---------------------------------------------------------------------

@pytest.mark.parametrize("n,m", [(1, 1), (5, 5), (9, 4), (33, 33)])
def test_householder_chain_equals_linalg_householder_product(n, m):
    p = HouseholderChain(n, m).double()
    y = p.reflector_matrix().detach()
    # LAPACK's form: H_i = I - tau_i v_i v_i^T with v_i[i] = 1 implicit.
    lead = y.diagonal()[:m]
    a = torch.eye(n, dtype=torch.float64)
    a[:, :m] = y / lead
    tau = torch.zeros(n, dtype=torch.float64)
    tau[:m] = 2 * lead.square() / y.square().sum(0)  # tau = 0: the identity
    reference = torch.linalg.householder_product(a, tau)
    torch.testing.assert_close(p.matrix(), reference, atol=1e-12, rtol=1e-12)


def test_householder_reflector_acts_on_last_k_coordinates():
    # H_k(u) for reflector i = H_{n-i} leaves the first i coordinates alone (eq. 1).
    n, m = 7, 4
    p = HouseholderChain(n, m)
    y = p.reflector_matrix()
    for i in range(m):
        assert torch.all(y[:i, i] == 0)
        assert torch.all(y[i:, i] != 0)
    assert p.vectors.numel() == m * n - m * (m - 1) // 2


def test_zero_reflector_is_identity():
    p = HouseholderChain(4, 2).double()
    y = p.reflector_matrix().detach().clone()
    y[:, 1] = 0
    p.set_factors(reflectors=y)
    h0 = torch.eye(4, dtype=torch.float64) - 2 * torch.outer(y[:, 0], y[:, 0]) / (y[:, 0] @ y[:, 0])
    torch.testing.assert_close(p.matrix(), h0)
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(p.multiply(x), x @ h0.T)


# -- SVD (Spectral-RNN) -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_svd_singular_values_are_s_within_bounds(dtype):
    n, r, s_star = 16, 0.2, 1.0
    p = SVDForm(HouseholderChain(n, 5), BoundedSingularValues(n, r, s_star),
                HouseholderChain(n, 7)).to(dtype)
    with torch.no_grad():
        p.singular.logits.normal_(0, 3)
    s = p.singular_values().detach()
    assert torch.all(s >= s_star - r) and torch.all(s <= s_star + r)
    svals = torch.linalg.svdvals(p.matrix().detach())
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(svals, torch.sort(s, descending=True).values, atol=tol, rtol=tol)


def test_svd_eq7_formula():
    p = BoundedSingularValues(3, 0.1, 0.9)
    with torch.no_grad():
        p.logits.copy_(torch.tensor([-2.0, 0.0, 5.0]))
    expected = 2 * 0.1 * (torch.sigmoid(p.logits) - 0.5) + 0.9
    torch.testing.assert_close(p(), expected)


@pytest.mark.parametrize("n", [1, 4, 12])
def test_svd_reaches_any_matrix_theorem2(n):
    m = torch.randn(n, n, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(m)
    s_star = float(s.max() + s.min()) / 2
    r = float(s.max() - s.min()) / 2 * 1.01 + 1e-3
    p = SVDForm(HouseholderChain(n), BoundedSingularValues(n, r, s_star),
                HouseholderChain(n)).double()
    p.left.set_factors(reflectors=householder_qr_vectors(u))
    p.right.set_factors(reflectors=householder_qr_vectors(vh.T))
    p.set_factors(singular_values=s)
    torch.testing.assert_close(p.matrix(), m, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("rows,cols", [(3, 7), (7, 3), (5, 5)])
def test_rectangular_svd_with_2_min_reflectors_reaches_any_matrix_theorem4(rows, cols):
    k = min(rows, cols)
    m = torch.randn(rows, cols, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    top = float(s.max())
    p = SVDForm(HouseholderChain(rows, k), BoundedSingularValues(k, top, top + 0.01),
                HouseholderChain(cols, k)).double()
    assert p.left.reflectors + p.right.reflectors == 2 * k
    p.left.set_factors(reflectors=householder_qr_vectors(u))
    p.right.set_factors(reflectors=householder_qr_vectors(vh.T))
    p.set_factors(singular_values=s)
    torch.testing.assert_close(p.matrix(), m, atol=1e-9, rtol=1e-9)


def test_free_singular_values_penalty():
    p = FreeSingularValues(4, penalty=0.3)
    with torch.no_grad():
        p.values.copy_(torch.tensor([1.0, 2.0, 0.5, 1.0]))
    torch.testing.assert_close(p.regularization(), torch.tensor(0.5 * 0.3 * (1 + 0.25)))


# -- scaled Cayley (scoRNN) ---------------------------------------------------------------

def test_cayley_matches_formula_and_det():
    n, rho = 9, 4
    p = _randomize(ScaledCayley(n, rho)).double()
    a = p.skew_matrix().detach()
    torch.testing.assert_close(a, -a.T)
    eye = torch.eye(n, dtype=torch.float64)
    d = torch.diag(torch.tensor([-1.0] * rho + [1.0] * (n - rho), dtype=torch.float64))
    expected = torch.linalg.inv(eye + a) @ (eye - a) @ d
    torch.testing.assert_close(p.matrix(), expected)
    # the Cayley factor has determinant 1, so det W = det D = (-1)^rho
    assert torch.linalg.det(p.matrix()).item() == pytest.approx((-1) ** rho)
    assert p.skew.numel() == n * (n - 1) // 2


def test_cayley_gradient_is_theorem_3_2():
    n = 7
    p = _randomize(ScaledCayley(n, rho=3)).double()
    target = torch.randn(n, n, dtype=torch.float64)
    w = p.matrix()
    loss = (torch.sin(w) * target).sum()  # dL/dW = cos(W) * target
    (grad_a,) = torch.autograd.grad(loss, p.skew)
    w = w.detach()
    dl_dw = torch.cos(w) * target
    a = p.skew_matrix().detach()
    eye = torch.eye(n, dtype=torch.float64)
    d = torch.diag(p.diagonal.double())
    v = torch.linalg.inv(eye + a).T @ dl_dw @ (d + w.T)
    theorem = v.T - v
    rows, cols = torch.triu_indices(n, n, 1)
    torch.testing.assert_close(grad_a, theorem[rows, cols])


def test_cayley_block_init_eigenvalues_on_right_half_circle():
    p = ScaledCayley(10, rho=0)
    eig = torch.linalg.eigvals(p.matrix().detach().double())
    torch.testing.assert_close(eig.abs(), torch.ones(10, dtype=torch.float64))
    assert torch.all(eig.real >= -1e-9)  # t_j in [0, pi/2]: e^{+-i t_j}
    a = p.skew_matrix().detach()
    off_block = a.clone()
    for j in range(5):
        off_block[2 * j, 2 * j + 1] = off_block[2 * j + 1, 2 * j] = 0
    assert torch.all(off_block == 0)


# -- Givens / rotation-permutation -----------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4, 10, 16])
def test_round_robin_covers_every_pair_once(n):
    rounds = round_robin_pairs(n)
    assert rounds.shape == (n - 1, n // 2, 2)
    for r in rounds:
        assert sorted(r.reshape(-1).tolist()) == list(range(n))  # disjoint, all coordinates
    pairs = [tuple(p) for p in rounds.reshape(-1, 2).tolist()]
    assert sorted(pairs) == sorted(itertools.combinations(range(n), 2))


def test_packed_givens_equals_product_of_explicit_rotations():
    n, k = 8, 5
    p = PackedGivens(n, k).double()
    expected = torch.eye(n, dtype=torch.float64)
    for j in range(k):
        pairs = list(zip(p.first[j].tolist(), p.second[j].tolist(), strict=True))
        expected = expected @ givens_dense(n, pairs, p.angles[j].detach())
    torch.testing.assert_close(p.matrix(), expected)


def test_rotation_permutation_equals_explicit_product():
    n = 8
    p = RotationPermutation(n, 4, seed=3).double()
    expected = torch.eye(n, dtype=torch.float64)
    eye = torch.eye(n, dtype=torch.float64)
    for j in range(4):
        pairs = [(2 * i, 2 * i + 1) for i in range(n // 2)]
        q = eye[p.permutations[j]]  # (Q x)_i = x_{perm_i}
        expected = expected @ givens_dense(n, pairs, p.angles[j].detach()) @ q
    torch.testing.assert_close(p.matrix(), expected)
    # fixed and seeded: the same seed gives the same permutations
    assert torch.equal(RotationPermutation(n, 4, seed=3).permutations, p.permutations)
    assert not torch.equal(RotationPermutation(n, 4, seed=4).permutations, p.permutations)


def test_rotation_chain_gradcheck():
    n, k = 6, 3
    order = torch.stack([torch.randperm(n) for _ in range(k)])
    angles = torch.randn(k, n // 2, dtype=torch.float64)
    cos, sin, partner = pair_coefficients(angles, order[:, : n // 2], order[:, n // 2:])
    cos, sin = cos.requires_grad_(), sin.requires_grad_()
    perms = torch.stack([torch.randperm(n) for _ in range(k)])
    x = torch.randn(n, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: rotation_chain(*a, partner, perms), (x, cos, sin))
    assert torch.autograd.gradcheck(lambda *a: rotation_chain(*a, partner), (x, cos, sin))


# -- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("build,match", [
    (lambda: HouseholderChain(4, 5), "m must be an integer in \\[1, 4\\]"),
    (lambda: HouseholderChain(4, 0), "m must be"),
    (lambda: ScaledCayley(4, 5), "rho must be an integer in \\[0, 4\\]"),
    (lambda: PackedGivens(5), "hidden_size must be even"),
    (lambda: PackedGivens(6, 6), "rotations must be an integer in \\[1, 5\\]"),
    (lambda: RotationPermutation(8, 7), "rotations must be an integer in \\[1, 6\\]"),
    (lambda: RotationPermutation(7), "hidden_size must be even"),
    (lambda: BoundedSingularValues(3, 1.0, 1.0), "r must be smaller than sigma_star"),
    (lambda: BoundedSingularValues(3, -0.1, 1.0), "r must be a number"),
    (lambda: FreeSingularValues(3, -1), "svd_lambda"),
])
def test_bad_options_raise_value_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_vprnn_rotation_limit_is_2_ceil_log2_n():
    assert RotationPermutation(128).rotations == 14  # the SGORNN paper's k = 14 at n = 128
    assert RotationPermutation(6).rotations == 2 * math.ceil(math.log2(6))
