"""Run under torchrun: the trainer (`torchtitan.train.main` with this script's arguments), with
rank 0's Hugging Face export made `SLOW_EXPORT_SECONDS` slower, as writing a large model is,
while the other ranks wait for it."""

import sys
import time

from torchtitan.components import checkpoint
from torchtitan.train import main

SLOW_EXPORT_SECONDS = 5
_save_hf = checkpoint.save_hf


def _slow_save_hf(*args, **kwargs):
    time.sleep(SLOW_EXPORT_SECONDS)
    return _save_hf(*args, **kwargs)


if __name__ == "__main__":
    checkpoint.save_hf = _slow_save_hf
    main(sys.argv[1:])
