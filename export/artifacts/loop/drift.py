"""The drift reference a package records at export (``reference.npz``) and the tests that
judge a window of served sequences against it (docs/drift.md). Torch-free: the exporter
computes the reference through the exported graph, and the service (``service.loop.drift``) and
``orthornn monitor`` compute the very same summaries on what was served.

Per sequence (``summarize``): its inputs' length and per-channel mean and variance (float
inputs) or its counts of the reference's most frequent tokens (token inputs); the predicted
class and the entropy of the predicted distribution (classify) or the mean next-token NLL
(lm); the final state projected by a fixed seeded matrix to ``PROJECTION`` dimensions.

Per window (``Reference.scores``), each test's statistic over its calibrated threshold
(>= 1 alarms; the statistics themselves: ``drift_statistics``): ``inputs`` (KS per
summary column, Bonferroni over the columns; chi-squared on the token counts),
``classes`` (chi-squared on the predicted classes), ``entropy`` and ``nll`` (KS),
``state`` (the Gaussian-kernel MMD^2 of the projected states). The thresholds
(``calibrate``) come from held-out reference data: the validation split cut in random
halves, a window drawn from one half tested against the other, many times; each test's
threshold is the 1 - alpha/tests quantile of those null statistics (never below the
nominal one), so a window of unshifted data alarms on any test with probability at most
about alpha.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..scoring import log_softmax
from .drift_statistics import (
    MAX_MLOG10P,
    chi2_mlog10p,
    counts,
    kernel_matrix,
    kernel_mean,
    ks_mlog10p,
    median_distance,
    mmd2,
)

FORMAT = "orthornn-drift/1"
FILE = "reference.npz"  # the file's name in a package
WINDOW = 200  # sequences per window the thresholds are calibrated for
ALPHA = 0.01  # the bound on a window's false-alarm probability, over all its tests
ROUNDS = 1000  # null windows drawn for the calibration
MMD_ROUNDS = 200  # of them, those the MMD's null is measured on (its tail: a gamma fit)
SEED = 43  # the projection and the calibration's draws
PROJECTION = 8  # dimensions of the projected final state
TOKEN_BINS = 31  # token inputs: the most frequent tokens counted one by one, + "other"
#: a window holds the sequences of at least this many requests: one request gives at most
#: ``per_request(window)`` of its sequences (two requests of 200 out-of-distribution
#: sequences each made a window drift and the retraining trigger fire)
MIN_REQUESTS = 10


def per_request(window: int) -> int:
    """The most sequences one request adds to a window of WINDOW sequences."""
    return max(1, window // MIN_REQUESTS)


MAX_REFERENCE = 2000  # reference sequences kept (a seeded subsample beyond)
MAX_KERNEL = 600  # reference states the MMD compares with (a seeded subsample beyond)
MIN_REFERENCE = 40  # fewer validation sequences: no reference (drift off)

P_TESTS = ("inputs", "classes", "entropy", "nll")  # scored as -log10(p)


def tests_for(task: str) -> tuple[str, ...]:
    """The tests of a task's windows, in the order they are reported."""
    if task == "classify":
        return ("inputs", "classes", "entropy", "state")
    if task == "lm":
        return ("inputs", "nll", "state")
    return ("inputs", "state")


def projection_matrix(state_size: int, seed: int = SEED) -> np.ndarray:
    """The fixed random projection of final states [state_size, PROJECTION]."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((state_size, PROJECTION)) / math.sqrt(PROJECTION)


def input_columns(feature_size: int) -> list[str]:
    """The names of the float-input summary columns."""
    return (["length"] + [f"mean_{c}" for c in range(feature_size)]
            + [f"var_{c}" for c in range(feature_size)])


def next_tokens(tokens: np.ndarray, log_probabilities: np.ndarray) -> np.ndarray:
    """A language model's answer to a sequence of TOKENS [T] as far as its summary needs
    it: the log-probability [T - 1] it gave each next token (position t predicts token
    t + 1), read from LOG_PROBABILITIES [T, V]."""
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    return np.asarray(log_probabilities, dtype=np.float64)[np.arange(len(tokens) - 1),
                                                            tokens[1:]]


def summarize(task: str, sequences: list[np.ndarray], outputs: list[np.ndarray],
              states: np.ndarray, projection: np.ndarray,
              token_ids: np.ndarray | None = None,
              gathered: bool = False) -> dict[str, np.ndarray]:
    """The per-sequence summaries of N answered sequences: SEQUENCES (float [T, d] or token
    ids [T], as the model saw them), OUTPUTS (the graph's prediction per sequence: logits
    [C], lm logits [T, V], ...), STATES [N, S] (the graph's final ``state``). TOKEN_IDS:
    the reference's counted tokens (token inputs). GATHERED: a language model's OUTPUTS are
    ``next_tokens`` already (what the service keeps of its logits)."""
    n = len(sequences)
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    out: dict[str, np.ndarray] = {}
    if token_ids is None:  # float inputs: length, per-channel mean and variance
        x = np.concatenate([np.asarray(s, dtype=np.float64).reshape(len(s), -1)
                            for s in sequences])
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        sums = np.add.reduceat(x, starts, axis=0)
        squares = np.add.reduceat(x * x, starts, axis=0)
        mean = sums / lengths[:, None]
        var = np.maximum(squares / lengths[:, None] - mean * mean, 0.0)
        out["inputs"] = np.concatenate([lengths[:, None].astype(np.float64), mean, var], 1)
    else:  # token inputs: per sequence, the count of each counted token and of the rest
        bins = len(token_ids) + 1
        tokens = np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences])
        lookup = np.full(max(int(tokens.max(initial=0)), int(token_ids.max(initial=0))) + 1,
                         bins - 1, dtype=np.int64)
        lookup[token_ids] = np.arange(len(token_ids))
        rows = np.repeat(np.arange(n), lengths)
        out["tokens"] = np.bincount(rows * bins + lookup[tokens],
                                    minlength=n * bins).reshape(n, bins).astype(np.float64)
    if task == "classify":
        logp = log_softmax(np.stack([np.asarray(o).reshape(-1) for o in outputs]))
        out["classes"] = logp.argmax(-1).astype(np.int64)
        out["entropy"] = -(np.exp(logp) * logp).sum(-1)
    elif task == "lm":
        nll = np.full(n, np.nan)
        for i, (seq, logits) in enumerate(zip(sequences, outputs, strict=True)):
            tokens = np.asarray(seq, dtype=np.int64).reshape(-1)
            if len(tokens) > 1:
                nll[i] = -(logits if gathered else next_tokens(
                    tokens, log_softmax(np.asarray(logits)[: len(tokens) - 1]))).mean()
        out["nll"] = nll
    out["projected"] = np.asarray(states, dtype=np.float64).reshape(n, -1) @ projection
    return out


def run_graph(sess: Any, output_name: str, sequences: list[np.ndarray], batch: int = 256
              ) -> tuple[list[np.ndarray], np.ndarray]:
    """(The prediction output per sequence, the final states [N, S]) of SEQUENCES (float
    [T, d] or token ids [T]) run through a full graph's onnxruntime session SESS in padded
    batches, each from the zero state: what the service's batcher hands over."""
    outputs: list[np.ndarray] = []
    states = []
    for start in range(0, len(sequences), batch):
        chunk = sequences[start:start + batch]
        lengths = np.array([len(s) for s in chunk], dtype=np.int64)
        steps = int(lengths.max())
        if chunk[0].ndim == 1:
            x = np.zeros((len(chunk), steps), np.int64)
            feed = "tokens"
        else:
            x = np.zeros((len(chunk), steps, chunk[0].shape[1]), np.float32)
            feed = "x"
        for i, s in enumerate(chunk):
            x[i, : len(s)] = s
        pred, state = sess.run([output_name, "state"], {feed: x, "lengths": lengths})
        per_step = pred.ndim == 3
        outputs.extend(pred[i, : n] if per_step else pred[i]
                       for i, n in enumerate(lengths.tolist()))
        states.append(state)
    return outputs, np.concatenate(states)


def take(summaries: dict[str, np.ndarray], index: np.ndarray) -> dict[str, np.ndarray]:
    """The summaries of the sequences INDEX ([n], or [R, n] for R draws at once)."""
    return {k: v[index] for k, v in summaries.items()}



def p_statistics(tests: tuple[str, ...], reference: dict[str, np.ndarray],
                 window: dict[str, np.ndarray], num_classes: int) -> dict[str, np.ndarray]:
    """-log10(p) of each p-value test, for R draws at once: every summary with a leading
    draw axis ([R, a, ...] reference, [R, w, ...] window)."""
    stats = {}
    for test in tests:
        if test == "inputs" and "tokens" in reference:
            value = chi2_mlog10p(reference["tokens"].sum(1), window["tokens"].sum(1))
        elif test == "inputs":  # every column at once, Bonferroni over them: k min(p)
            columns = reference["inputs"].shape[2]
            value = (ks_mlog10p(reference["inputs"], window["inputs"]).max(1)
                     - math.log10(columns))
        elif test == "classes":
            value = chi2_mlog10p(counts(reference["classes"], num_classes),
                                 counts(window["classes"], num_classes))
        elif test in ("entropy", "nll"):
            value = ks_mlog10p(reference[test], window[test])
        else:
            continue
        stats[test] = np.clip(np.nan_to_num(value, nan=0.0), 0.0, MAX_MLOG10P)
    return stats



def calibrate(tests: tuple[str, ...], summaries: dict[str, np.ndarray], bandwidth: float,
              num_classes: int, window: int = WINDOW, alpha: float = ALPHA,
              rounds: int = ROUNDS, seed: int = SEED) -> dict[str, Any]:
    """The thresholds of TESTS from held-out reference data: ROUNDS times, the N
    reference sequences cut in random halves A and B, a WINDOW drawn from B (with
    replacement) tested against A; each threshold is the 1 - alpha / len(tests) quantile
    of its null statistics, and for a p-value test at least the nominal -log10(alpha /
    len(tests)) and the same quantile of the exponential distribution with the null's
    mean; the MMD's from MMD_ROUNDS draws, at least the quantile of the gamma
    distribution with their mean and variance. Half-size references and a window from a
    finite half make the null wider than the deployed test's (the whole reference, a
    window of fresh data), so the thresholds err on the side of fewer false alarms."""
    rng = np.random.default_rng(seed)
    n = len(summaries["projected"])
    half = n // 2
    orders = np.stack([rng.permutation(n) for _ in range(rounds)])
    a, b = orders[:, :half], orders[:, half:]
    drawn = np.take_along_axis(b, rng.integers(n - half, size=(rounds, window)), 1)
    null = {t: list(v) for t, v in p_statistics(tests, take(summaries, a),
                                                 take(summaries, drawn), num_classes).items()}
    if "state" in tests:  # the MMD's null: mmd2 of each draw, from one kernel matrix
        # (a draw's kernel mean over rows X and Y is cx' K cy / (|X| |Y|) with cx, cy the
        # rows' counts: every pair's kernel computed once, not once per draw)
        r = min(rounds, MMD_ROUNDS)
        k = kernel_matrix(summaries["projected"], bandwidth)
        cx, cy = counts(drawn[:r], n), counts(a[:r, :MAX_KERNEL], n)
        w, m = drawn.shape[1], min(half, MAX_KERNEL)
        cx, cy = cx.astype(np.float64), cy.astype(np.float64)
        kx, ky = cx @ k, cy @ k
        kxx, kyy = (kx * cx).sum(1) / (w * w), (ky * cy).sum(1) / (m * m)
        kxy = (kx * cy).sum(1) / (w * m)
        null["state"] = np.maximum(kxx + kyy - 2 * kxy, 0.0).tolist()
    level = 1 - alpha / len(tests)
    thresholds = {}
    for test in tests:
        values = np.array(null[test])
        q = float(np.quantile(values, level, method="higher"))
        if test in P_TESTS:  # and the exponential tail with the null's mean (-ln p of an
            # exact test is Exp(1); an inflated null's tail, so estimated, is smoother than
            # its empirical quantile this far out)
            q = max(q, -math.log10(alpha / len(tests)),
                    float(values.mean()) * math.log(len(tests) / alpha))
        elif values.var() > 0:  # MMD^2: and the gamma with the null's mean and variance
            # (Gretton et al. 2009's approximation of it); scipy at export only, where
            # the train extra brings it (scikit-learn's dependency): never in the service.
            # The quantile is scale x gammaincinv (gamma.ppf's own formula): scipy.special
            # imports in a third of scipy.stats' time, which every export paid
            from scipy.special import gammaincinv

            shape = values.mean() ** 2 / values.var()
            q = max(q, float(values.mean() / shape * gammaincinv(shape, level)))
        thresholds[test] = q if q > 0 else 1e-12
    return {"thresholds": thresholds, "window": window, "alpha": alpha, "rounds": rounds,
            "seed": seed, "half": half,
            "null_quantiles": {t: [float(np.quantile(null[t], q)) for q in (0.5, 0.9, 0.99)]
                               for t in tests}}


@dataclass
class Reference:
    """A package's drift reference (``reference.npz``): the per-sequence summaries of its
    validation split, the projection, and the calibrated thresholds."""

    task: str
    tests: tuple[str, ...]
    summaries: dict[str, np.ndarray]
    projection: np.ndarray
    bandwidth: float
    num_classes: int
    thresholds: dict[str, float]
    window: int  # the window the thresholds were calibrated for
    half: int  # the calibration's reference size (half the validation sequences)
    token_ids: np.ndarray | None = None
    meta: dict = field(default_factory=dict)
    _kernel: float | None = None

    def __post_init__(self) -> None:
        if "state" in self.tests:
            y = self.summaries["projected"][:MAX_KERNEL]
            self._kernel = kernel_mean(y, y, self.bandwidth)

    @property
    def size(self) -> int:
        return len(self.summaries["projected"])

    def thresholds_for(self, window: int) -> dict[str, float]:
        """The thresholds for windows of WINDOW sequences. The p-value tests' hold at any
        size; the MMD's null shrinks with the window as 1/window + 3/half (the window's
        noise and, from the calibration's halves, the reference's twice and the held-out
        half's): scaled by that ratio from the calibrated window."""
        out = dict(self.thresholds)
        if "state" in out and window != self.window:
            out["state"] *= (1 / window + 3 / self.half) / (1 / self.window + 3 / self.half)
        return out

    def summarize(self, sequences: list[np.ndarray], outputs: list[np.ndarray],
                  states: np.ndarray, gathered: bool = False) -> dict[str, np.ndarray]:
        return summarize(self.task, sequences, outputs, states, self.projection, self.token_ids,
                         gathered)

    def window_scores(self, sequences: list[np.ndarray], outputs: list[np.ndarray],
                      states: np.ndarray, gathered: bool = False) -> dict[str, float]:
        """The scores of one window (its sequences, their prediction outputs and final
        states): what the service computes when a live window fills and what ``orthornn
        monitor`` computes from the captures."""
        return self.scores(self.summarize(sequences, outputs, states, gathered))

    def statistics(self, window: dict[str, np.ndarray]) -> dict[str, float]:
        """Each test's statistic of one window: -log10(p), or MMD^2 for ``state``."""
        batch = {k: v[None] for k, v in window.items()}
        ref = {k: v[None] for k, v in self.summaries.items()}
        stats = {t: float(v[0]) for t, v in
                 p_statistics(self.tests, ref, batch, self.num_classes).items()}
        if "state" in self.tests:
            stats["state"] = mmd2(window["projected"],
                                  self.summaries["projected"][:MAX_KERNEL], self.bandwidth,
                                  self._kernel)
        return {t: stats[t] for t in self.tests}

    def scores(self, window: dict[str, np.ndarray]) -> dict[str, float]:
        """Each test's statistic over its threshold for this window's size (>= 1 alarms)."""
        size = len(window["projected"])
        thresholds = self.thresholds_for(size)
        return {t: v / thresholds[t] for t, v in self.statistics(window).items()}


def build(task: str, summaries: dict[str, np.ndarray], projection: np.ndarray,
          num_classes: int, token_ids: np.ndarray | None = None, *, split: str = "validation",
          window: int = WINDOW, alpha: float = ALPHA, rounds: int = ROUNDS,
          seed: int = SEED) -> Reference:
    """The reference of a split's summaries (at most MAX_REFERENCE sequences kept: a seeded
    subsample), with its calibration."""
    n = len(summaries["projected"])
    if n < MIN_REFERENCE:
        raise ValueError(f"drift reference: {n} {split} sequences; at least {MIN_REFERENCE} "
                         f"are needed")
    if n > MAX_REFERENCE:
        keep = np.sort(np.random.default_rng(seed).permutation(n)[:MAX_REFERENCE])
        summaries, n = take(summaries, keep), MAX_REFERENCE
    tests = tests_for(task)
    bandwidth = median_distance(summaries["projected"][:MAX_KERNEL])
    calibration = calibrate(tests, summaries, bandwidth, num_classes, window, alpha, rounds,
                            seed)
    meta = {"format": FORMAT, "task": task, "split": split, "sequences": n,
            "tests": list(tests), "bandwidth": bandwidth, "num_classes": num_classes,
            "projection": PROJECTION, **calibration}
    if "inputs" in summaries:
        meta["columns"] = input_columns((summaries["inputs"].shape[1] - 1) // 2)
    return Reference(task, tests, summaries, projection, bandwidth, num_classes,
                     calibration["thresholds"], window, calibration["half"], token_ids, meta)


def write(reference: Reference, path: str | Path) -> None:
    arrays = {f"summary/{k}": v for k, v in reference.summaries.items()}
    arrays["projection"] = reference.projection
    if reference.token_ids is not None:
        arrays["token_ids"] = reference.token_ids
    arrays["meta"] = np.array(json.dumps(reference.meta, sort_keys=True))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # stub: allow_pickle
    Path(path).write_bytes(buffer.getvalue())


def read(path: str | Path) -> Reference:
    """A reference file; ValueError when it is not one this code reads."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
        meta = json.loads(str(arrays.pop("meta")))
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"drift reference {str(path)!r} cannot be read: {error}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"drift reference {str(path)!r}: format {meta.get('format')!r}, "
                         f"expected {FORMAT!r}")
    summaries = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("summary/")}
    tests = tuple(meta["tests"])
    thresholds = {t: float(meta["thresholds"][t]) for t in tests}
    return Reference(meta["task"], tests, summaries, arrays["projection"],
                     float(meta["bandwidth"]), int(meta["num_classes"]), thresholds,
                     int(meta["window"]), int(meta["half"]), arrays.get("token_ids"), meta)
