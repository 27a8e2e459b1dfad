"""The two-sample statistics of the drift tests, in numpy (the serving image has no room
for scipy; the unit tests check them against scipy's): Kolmogorov-Smirnov with its
asymptotic p-value, chi-squared on counts, and the Gaussian-kernel MMD^2. Every function
takes R draws at once along a leading axis, so that the calibration's null windows cost
one call."""

from __future__ import annotations

import math

import numpy as np

MAX_MLOG10P = 300.0  # -log10(p) beyond it counts as it (p below 1e-300)


def kernel_mean(x: np.ndarray, y: np.ndarray, bandwidth: float) -> float:
    d2 = (x * x).sum(1)[:, None] + (y * y).sum(1)[None, :] - 2 * x @ y.T
    return float(np.exp(-np.maximum(d2, 0.0) / (2 * bandwidth * bandwidth)).mean())


def kernel_matrix(x: np.ndarray, bandwidth: float) -> np.ndarray:
    """The Gaussian kernel between every two rows of X: [n, n]."""
    d2 = (x * x).sum(1)[:, None] + (x * x).sum(1)[None, :] - 2 * x @ x.T
    return np.exp(-np.maximum(d2, 0.0) / (2 * bandwidth * bandwidth))


def median_distance(x: np.ndarray) -> float:
    """The median pairwise distance of X's rows (the kernel's bandwidth; 1 when 0)."""
    d2 = (x * x).sum(1)[:, None] + (x * x).sum(1)[None, :] - 2 * x @ x.T
    upper = np.sqrt(np.maximum(d2[np.triu_indices(len(x), 1)], 0.0))
    value = float(np.median(upper)) if upper.size else 0.0
    return value if value > 0 else 1.0


def ks_statistic(reference: np.ndarray, window: np.ndarray) -> np.ndarray:
    """The two-sample KS statistic D (the largest distance between the two empirical CDFs)
    along axis 1: [R, a, ...] against [R, w, ...] -> [R, ...]; ties are compared after
    their last member, as scipy's ks_2samp does."""
    shape = reference.shape[2:]
    a = reference.reshape(reference.shape[0], reference.shape[1], -1)
    b = window.reshape(window.shape[0], window.shape[1], -1)
    n, m = a.shape[1], b.shape[1]
    values = np.concatenate([a, b], 1)
    order = np.argsort(values, axis=1, kind="stable")
    ordered = np.take_along_axis(values, order, 1)
    distance = np.abs(np.cumsum(np.where(order < n, 1.0 / n, -1.0 / m), 1))
    last = np.ones(ordered.shape, dtype=bool)  # the last of each run of equal values
    last[:, :-1] = ordered[:, 1:] != ordered[:, :-1]
    return np.where(last, distance, 0.0).max(1).reshape(reference.shape[0], *shape)


def kolmogorov_mlog10(lam: np.ndarray) -> np.ndarray:
    """-log10 of the Kolmogorov distribution's survival function at LAM (its two series:
    the alternating one above 1, the theta-function one below)."""
    lam = np.asarray(lam, dtype=np.float64)
    k = np.arange(1, 101, dtype=np.float64)
    big = np.maximum(lam, 1.0)[..., None]
    # Q = 2 exp(-2 lam^2) sum_k (-1)^(k-1) exp(-2 (k^2 - 1) lam^2), in logs (no underflow)
    tail = (np.where(k % 2 == 1, 1.0, -1.0) * np.exp(-2 * (k * k - 1) * big * big)).sum(-1)
    log_high = math.log(2) - 2 * big[..., 0] ** 2 + np.log(tail)
    small = np.clip(lam, 1e-3, 1.0)[..., None]
    cdf = math.sqrt(2 * math.pi) / small[..., 0] * np.exp(
        -((2 * k - 1) ** 2) * math.pi ** 2 / (8 * small * small)).sum(-1)
    log_low = np.log1p(-np.minimum(cdf, 1 - 1e-16))
    return -np.where(lam >= 1.0, log_high, log_low) / math.log(10)


def ks_mlog10p(reference: np.ndarray, window: np.ndarray) -> np.ndarray:
    """-log10 of the two-sample KS test's p-value along axis 1 ([R, a, ...] against [R, w,
    ...] -> [R, ...]): the asymptotic Kolmogorov distribution at Stephens' (1970)
    small-sample scaling, sqrt(en) + 0.12 + 0.11 / sqrt(en), en = a w / (a + w). A single
    window (R = 1) of one column leaves out non-finite values (a language model's
    one-token sequences have no NLL)."""
    if reference.shape[0] == 1 and reference.ndim == 2:
        a, b = reference[0], window[0]
        a, b = a[np.isfinite(a)], b[np.isfinite(b)]
        if not len(a) or not len(b):
            return np.zeros(1)
        reference, window = a[None], b[None]
    en = math.sqrt(reference.shape[1] * window.shape[1]
                   / (reference.shape[1] + window.shape[1]))
    return kolmogorov_mlog10((en + 0.12 + 0.11 / en) * ks_statistic(reference, window))


def _log_gamma_q(a: float, x: float) -> float:
    """log of the regularized upper incomplete gamma function Q(a, x): the series of P
    below x = a + 1, Lentz's continued fraction of Q above (Numerical Recipes' gammq)."""
    if x <= 0:
        return 0.0
    front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return math.log1p(-min(math.exp(front) * total, 1 - 1e-16))
    tiny = 1e-300
    b, c, d = x + 1 - a, 1 / tiny, 1 / (x + 1 - a)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return front + math.log(h)


def chi2_mlog10_sf(stat: np.ndarray, dof: np.ndarray) -> np.ndarray:
    """-log10 of the chi-squared distribution's survival function (element-wise)."""
    out = [-_log_gamma_q(d / 2, s / 2) / math.log(10)
           for s, d in zip(np.ravel(stat).tolist(), np.ravel(dof).tolist(), strict=True)]
    return np.array(out, dtype=np.float64).reshape(np.shape(stat))


def chi2_mlog10p(reference: np.ndarray, window: np.ndarray) -> np.ndarray:
    """-log10 of the p-value of Pearson's chi-squared test of homogeneity of two count
    vectors per draw ([R, K] each: the 2 x K table without its empty columns; what scipy's
    chi2_contingency computes without the continuity correction) -> [R]."""
    table = np.stack([reference, window], 1).astype(np.float64)  # [R, 2, K]
    columns = table.sum(1, keepdims=True)
    rows = table.sum(2, keepdims=True)
    expected = rows * columns / np.maximum(table.sum((1, 2), keepdims=True), 1)
    used = np.broadcast_to(columns > 0, table.shape)
    stat = np.where(used, (table - expected) ** 2 / np.where(used, expected, 1), 0).sum((1, 2))
    dof = (columns[:, 0] > 0).sum(1) - 1
    out = chi2_mlog10_sf(stat, np.maximum(dof, 1))
    return np.where((dof < 1) | (rows.min((1, 2)) == 0), 0.0, out)


def counts(classes: np.ndarray, num_classes: int) -> np.ndarray:
    """Per draw [R, n] of class indices, the count of each class [R, num_classes] (also
    how often each reference row is drawn: rows as classes)."""
    offsets = classes + num_classes * np.arange(len(classes))[:, None]
    return np.bincount(offsets.ravel(), minlength=len(classes) * num_classes
                       ).reshape(len(classes), num_classes)


def mmd2(window: np.ndarray, reference: np.ndarray, bandwidth: float,
         reference_kernel: float | None = None) -> float:
    """The biased MMD^2 of two sets of projected states with a Gaussian kernel.
    REFERENCE_KERNEL: the reference's mean kernel value, when known."""
    kyy = (kernel_mean(reference, reference, bandwidth) if reference_kernel is None
           else reference_kernel)
    return max(0.0, kernel_mean(window, window, bandwidth) + kyy
               - 2 * kernel_mean(window, reference, bandwidth))
