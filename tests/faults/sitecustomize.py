"""Fault injection for tests/integration/test_distributed.py, outside the package: a
process started with this folder on PYTHONPATH and ORTHORNN_TEST_KILL_RANK_AT_STEP=RANK:STEP
that is torchrun's worker RANK, on the group's first attempt (TORCHELASTIC_RESTART_COUNT 0),
SIGKILLs itself as it starts training step STEP (1-based: as the trainer takes the data of
step index STEP - 1), as a worker killed from outside would die."""

import os
import signal

_SPEC = os.environ.get("ORTHORNN_TEST_KILL_RANK_AT_STEP")
if _SPEC and os.environ.get("RANK") is not None and \
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    _rank, _, _at = _SPEC.partition(":")
    if int(_rank) == int(os.environ["RANK"]):
        from orthornn.training.data import EpochSampler, TokenStream

        def _killing(take):
            def at_step(self, step):
                if step + 1 == int(_at):
                    os.kill(os.getpid(), signal.SIGKILL)
                return take(self, step)
            return at_step

        # the trainer takes each step's data by its index: a fixed split's batch, or a
        # language model's window
        EpochSampler.batch = _killing(EpochSampler.batch)
        TokenStream.window = _killing(TokenStream.window)
