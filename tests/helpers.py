"""Independent references the tests compare against, and the command line as a user
runs it."""

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def orthornn(*args, code: int | None = None, timeout: float = 300
             ) -> subprocess.CompletedProcess:
    """`python -m orthornn ARGS` in a process of its own, from the checkout; with
    ``code``, its exit status must be that (the output's tail says why not)."""
    result = subprocess.run([sys.executable, "-m", "orthornn", *map(str, args)], cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    return _exited(result, code)


def _exited(result: subprocess.CompletedProcess, code: int | None
            ) -> subprocess.CompletedProcess:
    """RESULT, whose exit status must be CODE when one is given (the output's tail says
    why not)."""
    if code is not None:
        assert result.returncode == code, result.stderr[-3000:]
    return result


def orthornn_here(*args, code: int | None = None) -> subprocess.CompletedProcess:
    """`orthornn ARGS` as ``orthornn`` above, run by the command's own ``main`` in this
    process (the unit tests' way: the same parser, handlers and messages, without a
    Python start and torch's import for each case)."""
    from orthornn.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            returncode = main([str(a) for a in args])
        except SystemExit as exit:  # argparse's usage errors
            returncode = exit.code if isinstance(exit.code, int) else 1
    return _exited(subprocess.CompletedProcess(args, returncode, out.getvalue(),
                                               err.getvalue()), code)


def spectral_error(w: torch.Tensor) -> float:
    """||W^T W - I||_2."""
    eye = torch.eye(w.shape[1], dtype=w.dtype)
    return torch.linalg.matrix_norm(w.T @ w - eye, ord=2).item()


def householder_qr_vectors(a: torch.Tensor) -> torch.Tensor:
    """Householder QR of a [n, k] with orthonormal columns (Spectral-RNN Prop. 1): Y [n, k]
    with column i zero above row i such that (H(y_0) ... H(y_{k-1}))[:, :k] = a. Each
    reflector maps the working column to +||x|| e_1 (v = x - ||x|| e_1, v = 0 when x is
    already there), so R has a positive diagonal and equals I."""
    n, k = a.shape
    r = a.clone()
    y = torch.zeros(n, k, dtype=a.dtype)
    for i in range(k):
        x = r[i:, i]
        v = x.clone()
        v[0] -= torch.linalg.vector_norm(x)
        if torch.linalg.vector_norm(v) > 1e-12:
            r[i:, :] -= 2 * torch.outer(v, v @ r[i:, :]) / (v @ v)
            y[i:, i] = v
    return y


def givens_dense(n: int, pairs, angles) -> torch.Tensor:
    """One packed rotation as an explicit dense matrix (DizzyRNN 4.1): (a, a) = (b, b) = cos,
    (a, b) = sin, (b, a) = -sin."""
    g = torch.eye(n, dtype=angles.dtype)
    for (a, b), t in zip(pairs, angles, strict=True):
        g[a, a] = g[b, b] = torch.cos(t)
        g[a, b] = torch.sin(t)
        g[b, a] = -torch.sin(t)
    return g


def loop_rnn(model, x, h0=None):
    """A plain step-by-step RNN using model.recurrent_weight() and the layer's modules,
    written independently of models.ops: the reference for the fast scan."""
    layer = model.layer
    w = model.recurrent_weight()
    inputs = model.embedding(x) if model.embedding is not None else x
    h = torch.zeros(x.shape[0], w.shape[0], dtype=w.dtype) if h0 is None else h0
    states = []
    for t in range(inputs.shape[1]):
        z = inputs[:, t] @ layer.input.weight.T + layer.input.bias + h @ w.T
        new = layer.activation(z)
        if layer.gates is not None:
            a, b2 = layer.gates()
            new = a * new + b2 * h
        h = new
        states.append(h)
    return torch.stack(states, 1), h
