"""Ops for the recurrence and the rotation chains; pure-PyTorch reference versions."""

from .reference import rnn_scan, rnn_scan_steps
from .rotations import rotation_chain

__all__ = ["rnn_scan", "rnn_scan_steps", "rotation_chain"]
