"""Run under torchrun: the trainer (`torchtitan.train.main` with the arguments after the first),
with one rank made slower or different than the others, as ranks of a real run are. The first
argument says how:

- `slow-export`: rank 0's Hugging Face export (`last_save_in_hf`), which it writes alone.
- `slow-write`: rank 1's writes of its checkpoint shards.
- `slow-delete`: rank 0's folder deletions (pruning old checkpoints, replacing a folder).
- `rank-1-stops`: rank 1 alone is asked to stop before step 3, as by a SIGTERM only it got.

Each slowness is `SLOW_SECONDS`; the tests set a shorter training timeout.
"""

import os
import shutil
import sys
import time

from torch.distributed.checkpoint import FileSystemWriter

from torchtitan import train
from torchtitan.components import checkpoint

SLOW_SECONDS = 5


def _slowed(function):
    def slow(*args, **kwargs):
        time.sleep(SLOW_SECONDS)
        return function(*args, **kwargs)

    return slow


def _stop_before_step_3(check_stop_file):
    def check(trainer):
        if trainer.step == 2:
            trainer.stop_requested, trainer.stop_reason = True, "SIGTERM"
        return check_stop_file(trainer)

    return check


def main(how: str, argv: list[str]) -> None:
    rank = int(os.environ["RANK"])
    if how == "slow-export":
        checkpoint.save_hf = _slowed(checkpoint.save_hf)
    elif how == "slow-write" and rank == 1:
        FileSystemWriter.write_data = _slowed(FileSystemWriter.write_data)
    elif how == "slow-delete" and rank == 0:
        shutil.rmtree = _slowed(shutil.rmtree)
    elif how == "rank-1-stops" and rank == 1:
        train.Trainer._check_stop_file = _stop_before_step_3(train.Trainer._check_stop_file)
    train.main(argv)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
