"""Run under torchrun (or the tests' forked launcher): train a few steps, then export the model to
Hugging Face safetensors twice, from every rank (`write_hf_export_from_all_ranks`, what
`last_save_in_hf` writes) and through rank 0 (`whole_model_state` + `write_hf_export`, the
earlier path), and write on rank 0 whether the two hold the same tensors, bit for bit.

    hf_export_worker.py OUT_FOLDER STEPS [the trainer's arguments]

OUT_FOLDER gets `all_ranks/`, `rank_0/` and `result.json` ({"same": bool, "keys": n,
"different": [keys]}).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.integration.workers import shut_down
from torchtitan.components.checkpoint_hf_export import whole_model_state, write_hf_export
from torchtitan.components.hf_distributed_export import write_hf_export_from_all_ranks
from torchtitan.components.hf_io import load_hf
from torchtitan.config.manager import parse_args
from torchtitan.tools.logging import init_logger
from torchtitan.train import Trainer


def main(out: str, steps: int, argv: list[str]) -> None:
    init_logger()
    out_folder = Path(out)
    trainer = Trainer(parse_args(argv))
    data = iter(trainer.dataloader)
    for step in range(1, steps + 1):
        trainer.step = step
        trainer.train_step(data)
    manager = trainer.checkpointer
    adapter, dtype = manager.hf_adapter, "float32"
    write_hf_export_from_all_ranks(
        out_folder / "all_ranks", manager.model, adapter, dtype, manager.whole_model_shapes
    )
    whole = whole_model_state(manager.model, dtype, manager.pp_group)
    if trainer.rank == 0:
        write_hf_export(out_folder / "rank_0", whole, adapter, dtype)
        got, want = load_hf(out_folder / "all_ranks"), load_hf(out_folder / "rank_0")
        different = sorted(
            k
            for k in want.keys() | got.keys()
            if k not in got or k not in want or not torch.equal(got[k], want[k])
        )
        result = {"same": not different, "keys": len(want), "different": different[:10]}
        (out_folder / "result.json").write_text(json.dumps(result))
    trainer.close()
    trainer = None
    if dist.is_initialized():
        shut_down()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
