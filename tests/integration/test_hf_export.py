"""The Hugging Face export from every rank (`last_save_in_hf`): in each layout, the same tensors,
bit for bit, as gathering the model on rank 0 and writing it there (the earlier path), and a
transformers model built from it gives the same logits."""

import json
import tempfile
from pathlib import Path

import pytest
import torch

from tests.conftest import PROJECT_ROOT, launch_ranks

pytestmark = pytest.mark.integration

WORKER = PROJECT_ROOT / "tests" / "integration" / "hf_export_worker.py"
_P = "--parallelism."
COMMON = [
    "--training.seq_len",
    "64",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
]
MOE = ["--config", "qwen3_debug_model_moe.toml", *COMMON]
DENSE = ["--config", "debug_model.toml", *COMMON]
# name: (processes, argv). The layouts the issue names; each rank writes its own shards.
LAYOUTS = {
    "FSDP 4": (4, [*DENSE, "--training.local_batch_size", "2"]),
    "FSDP 2 x TP 2": (4, [*DENSE, "--training.local_batch_size", "4", _P + "tensor_parallel_degree", "2"]),
    "FSDP 4 x EP 2": (4, [*MOE, "--training.local_batch_size", "2", _P + "expert_parallel_degree", "2"]),
    "PP 2": (2, [*DENSE, "--training.local_batch_size", "4", _P + "pipeline_parallel_degree", "2"]),
}
FULL = pytest.mark.full_matrix
# FSDP 4 x EP 2 in the default run: it has every way a tensor is written (shards as they are,
# RoPE rows permuted per rank, experts by their holder).
MARKS = {"FSDP 4": FULL, "FSDP 2 x TP 2": FULL, "PP 2": FULL}


def _export(layout: str, folder: Path) -> dict:
    nproc, argv = LAYOUTS[layout]
    proc = launch_ranks(
        ("script", str(WORKER)), [str(folder), "2", *argv, "--job.dump_folder", str(folder / "dump")], nproc
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((folder / "result.json").read_text())


@pytest.mark.parametrize("layout", [pytest.param(name, marks=MARKS.get(name, ())) for name in LAYOUTS])
def test_the_export_from_every_rank_holds_the_tensors_rank_0_would_write(layout):
    with tempfile.TemporaryDirectory() as tmp:
        result = _export(layout, Path(tmp))
        assert result["same"], result
        assert result["keys"] > 10
        transformers = pytest.importorskip("transformers", minversion="5.0")
        tokens = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
        logits = {}
        for name in ("all_ranks", "rank_0"):
            model = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / name)
            with torch.no_grad():
                logits[name] = model(tokens).logits
        assert torch.equal(logits["all_ranks"], logits["rank_0"])
