"""A torchrun worker for tests/integration/test_distributed.py: trains every case of a JSON file
({name: TrainConfig fields}) in one process group, and saves what this rank's model
holds after training (its parameters and the transition matrix W the forward pass uses)
to OUT/<name>-rank<r>.pt, so the test can check every rank, not only rank 0's run
directory.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/distributed_worker.py CASES.json OUT
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from orthornn.training.config import TrainConfig
from orthornn.training.trainer import run_training


def main(cases: Path, out: Path) -> None:
    dist.init_process_group("gloo")  # once for every case: run_training leaves it as it is
    rank = dist.get_rank()
    for name, options in json.loads(cases.read_text()).items():
        _, model = run_training(TrainConfig(**options), progress=False)
        weight = model.recurrent_weight()
        torch.save({"state": model.state_dict(),
                    "w": None if weight is None else weight.detach()},
                   out / f"{name}-rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
