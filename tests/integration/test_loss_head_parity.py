"""The chunked head (`training.loss_chunks` 16) trains as the whole logits do, in each layout
that changes how the head runs: FSDP 2 (the root gathers the output weight once), TP 2 with
loss parallel (vocabulary-sharded chunks) and without it (gathered chunks), and PP 2 (the last
stage computes the loss). Every gradient after step 1 and both losses agree within 1e-6
relative per tensor (tests/unit/test_loss_head.py says why); the parameters after step 2
within tests/parity.py's PARAM_RTOL. Both runs use the same layout, so the only difference is
the chunking.
"""

import pytest

from tests.parity import assert_parity, train_for_parity

pytestmark = [pytest.mark.integration, pytest.mark.full_matrix]

RTOL = 1e-6
COMMON = ["--training.seq_len", "64", "--training.mixed_precision_param", "float32",
          "--training.global_batch_size", "4"]  # fmt: skip
CONFIGS = {
    "llama3": "debug_model.toml",
    "qwen3 moe": "qwen3_debug_model_moe.toml",
    "deepseek_v3": "deepseek_v3_debug_model.toml",
}
_P = "--parallelism."
TP2 = [_P + "tensor_parallel_degree", "2", _P + "expert_tensor_parallel_degree", "2"]
LAYOUTS = {
    "FSDP 2": (2, []),
    "TP 2": (4, TP2),
    "TP 2 without loss parallel": (4, [*TP2, _P + "disable_loss_parallel"]),
    "PP 2, 1F1B": (4, [_P + "pipeline_parallel_degree", "2", _P + "pipeline_parallel_schedule", "1F1B"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", CONFIGS)
def test_the_chunked_head_gives_the_whole_logits_gradients(model, layout):
    local_batch, argv = LAYOUTS[layout]
    run = ["--config", CONFIGS[model], *COMMON, "--training.local_batch_size", str(local_batch), *argv]
    whole = train_for_parity([*run, "--training.loss_chunks", "1"], nproc=2)
    chunked = train_for_parity([*run, "--training.loss_chunks", "16"], nproc=2)
    # Parameters after step 2 keep the usual PARAM_RTOL: Adam's first step moves an element whose
    # gradient is zero up to rounding by lr either way (tests/parity.py).
    assert_parity(chunked, whole, rtol=RTOL)
