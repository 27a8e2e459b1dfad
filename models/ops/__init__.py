"""Custom ops for the recurrence and the factored transitions (``torch.ops.orthornn``):
a pure-PyTorch reference on the CPU, Triton kernels on the GPU (``dispatch``)."""

from .householder import householder_apply, householder_matrix
from .reference import rnn_scan_steps
from .rotations import givens_apply, rotation_chain
from .scan import rnn_scan

__all__ = ["givens_apply", "householder_apply", "householder_matrix", "rnn_scan",
           "rnn_scan_steps", "rotation_chain"]
