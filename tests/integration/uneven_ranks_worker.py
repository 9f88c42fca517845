"""Run under torchrun: the trainer (`torchtitan.train.main` with the arguments after the first),
with one rank made slower or different than the others, as ranks of a real run are. The first
argument says how:

- `slow-export`: rank 0's part of the Hugging Face export (`last_save_in_hf`): its consolidation
  of the output files, while the others wait to gather the index.
- `slow-write`: rank 1's writes of its checkpoint shards.
- `slow-delete`: rank 0's folder deletions (pruning old checkpoints, replacing a folder).
- `rank-1-stops`: rank 1 alone is asked to stop before step 3, as by a SIGTERM only it got.
- `hub-with-one-document`: `training.dataset` streams, as from the hub, one document, which
  only rank 0's share of the stream holds.

Each slowness is `SLOW_SECONDS`; the tests set a training timeout of less than half that, and
long enough that a loaded machine's own delays between ranks stay under it.
"""

import json
import os
import shutil
import sys
import tempfile
import time

import datasets
from torch.distributed.checkpoint import FileSystemWriter

from torchtitan import train
from torchtitan.components import hf_distributed_export, stop

SLOW_SECONDS = 12


def _slowed(function):
    def slow(*args, **kwargs):
        time.sleep(SLOW_SECONDS)
        return function(*args, **kwargs)

    return slow


def _stop_before_step_3(check_stop_file):
    looks = []

    def check(requests):  # the third look comes before step 3
        looks.append(1)
        if len(looks) == 3:
            requests.requested, requests.reason = True, "SIGTERM"
        return check_stop_file(requests)

    return check


def _hub_with_one_document(*args, split=None, streaming=False, **kwargs):
    data = os.path.join(tempfile.mkdtemp(), "hub.jsonl")
    with open(data, "w") as f:
        f.write(json.dumps({"text": "the only document of this stream " * 20}) + "\n")
    return _load_dataset("json", data_files=data, split=split, streaming=streaming)


_load_dataset = datasets.load_dataset


def main(how: str, argv: list[str]) -> None:
    rank = int(os.environ["RANK"])
    if how == "slow-export" and rank == 0:
        consolidate = hf_distributed_export.consolidate_safetensors_files_on_every_rank
        hf_distributed_export.consolidate_safetensors_files_on_every_rank = _slowed(consolidate)
    elif how == "slow-write" and rank == 1:
        FileSystemWriter.write_data = _slowed(FileSystemWriter.write_data)
    elif how == "slow-delete" and rank == 0:
        shutil.rmtree = _slowed(shutil.rmtree)
    elif how == "rank-1-stops" and rank == 1:
        stop.StopRequests.check_stop_file = _stop_before_step_3(stop.StopRequests.check_stop_file)
    elif how == "hub-with-one-document":
        datasets.load_dataset = _hub_with_one_document
    train.main(argv)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
