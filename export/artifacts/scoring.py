"""How a package's outputs are scored, once for the two places that score them: the
export's evaluation (perplexity, the gate's numbers) and the service (the log-likelihood
and next-token probabilities of /predict). Numpy only, in float64."""

from __future__ import annotations

import numpy as np


def softmax(x: np.ndarray) -> np.ndarray:
    """Probabilities over the last axis (float64)."""
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return np.asarray(z / z.sum(axis=-1, keepdims=True), dtype=np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in float64 (as the evaluation's perplexity
    and the service's log-likelihood are reported)."""
    shifted = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    return np.asarray(shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True)))
