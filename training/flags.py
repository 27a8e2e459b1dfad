"""Flags more than one command takes (``orthornn train``, ``orthornn export``), defined once;
no dependency beyond the standard library, so that a command's parser builds (and a missing
extra is reported in one line) before anything heavy is imported."""

from __future__ import annotations

import argparse


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    """--no-progress, for every command with long work (``training.progress``)."""
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress report (default: a bar on a terminal, a line every "
                             "few seconds in a log: ORTHORNN_PROGRESS_INTERVAL_S)")
