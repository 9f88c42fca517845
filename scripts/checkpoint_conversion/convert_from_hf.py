"""Convert a Hugging Face transformers checkpoint (safetensors) into a DCP checkpoint to train from.

The DCP holds ``{"model": {FQN: tensor}}``, model weights only, under the top-level key the
trainer's checkpoints use for them. Parameters are stored in ``--dtype`` (default float32, the
trainer's parameter dtype); buffers (MoE ``expert_bias``) keep the model's dtype for them.
Runs in one process, without a process group. Block-scaled fp8 weights, as the published
DeepSeek-V3 stores them, are dequantized on the way. It holds the whole model in host memory
(in float32 after dequantizing: 2.7 TB for DeepSeek-V3 671B); for the largest models, load the
HF folder with the trainer's `checkpoint.initial_load_in_hf` instead, which reads a layer at a
time and, under expert parallelism, only each rank's experts.

Bad input (a missing or unreadable folder, an unknown model or flavor, a checkpoint whose keys
or shapes are not the flavor's, quantized weights other than block-scaled fp8, an output folder
that is a file or not empty) ends with exit code 2 and a one-paragraph message on stderr. A
config.json whose RoPE, norm, activation or routing constants are not the flavor's is warned
about (the weights then compute something else), as the trainer's `initial_load_in_hf` does.
The output appears whole or not at all.

Usage:
    python scripts/checkpoint_conversion/convert_from_hf.py --model llama3 --flavor 8B \\
        --hf ./assets/hf/Llama-3.1-8B --out ./outputs/llama3_8b_from_hf [--dtype float32] \
        [--custom_import my_project.models]   # a model registered outside this repository
"""

import argparse
import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from torchtitan.components.hf_io import (
    CONFIG_FILE,
    HFQuantizationError,
    dequantize_fp8,
    fp8_block_size,
    load_hf_tensors,
    read_hf_layout,
)
from torchtitan.config.errors import ConfigError
from torchtitan.models import build_state_dict_adapter, get_train_spec
from torchtitan.protocols.state_dict_adapter import (
    StateDictMismatchError,
    config_differences_from_folder,
    describe_mismatch,
)
from torchtitan.protocols.train_spec import import_custom_module
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.exit_codes import EXIT_BAD_INPUT
from torchtitan.tools.folders import check_new_folder, written_whole

logger = logging.getLogger("convert_from_hf")

BAD_INPUT_ERRORS = (
    ConfigError,
    StateDictMismatchError,
    HFQuantizationError,
    FileNotFoundError,
    FileExistsError,
)


def convert_from_hf(model: str, flavor: str, hf: str | Path, out: str | Path, dtype: torch.dtype) -> None:
    """Read the HF checkpoint in `hf`, convert it to `model`'s `flavor`, and save it as DCP in `out`.

    Raises:
        ConfigError: unknown model or flavor.
        FileNotFoundError: `hf` is missing or holds no readable safetensors checkpoint.
        FileExistsError: `out` is a file, or a folder that is not empty.
        StateDictMismatchError: the checkpoint's keys or shapes are not the flavor's.
        HFQuantizationError: quantized weights other than block-scaled fp8, or inconsistent ones.

    Block-scaled fp8 weights (the published DeepSeek-V3's) are dequantized; tensors the
    adapter ignores (DeepSeek-V3's multi-token-prediction layer) are not read.
    """
    out = check_new_folder(out)
    adapter = build_state_dict_adapter(model, flavor)
    template = get_train_spec(model).build_meta_model(adapter.model_args, dtype).state_dict()
    not_this_flavor = f"'{hf}' is not a {model} {flavor} Hugging Face checkpoint"
    try:
        layout = read_hf_layout(hf)
        wanted = [key for key in layout if not adapter.ignores_hf_key(key)]
        state_dict = adapter.from_hf(dequantize_fp8(load_hf_tensors(layout, wanted), fp8_block_size(hf)))
    except StateDictMismatchError as error:
        raise StateDictMismatchError(f"{not_this_flavor}: {error}") from None
    if mismatch := describe_mismatch(_shapes(template), _shapes(state_dict)):
        raise StateDictMismatchError(f"{not_this_flavor}: {mismatch}")
    # Only for a checkpoint whose tensors fit: another model's would differ in everything.
    if differences := config_differences_from_folder(adapter, hf):
        logger.warning(
            f"{Path(hf) / CONFIG_FILE} differs from {model} {flavor} in what no tensor shape shows: "
            f"{'; '.join(differences)}. The weights convert, but compute differently than in Hugging "
            "Face; choose the matching --flavor if one exists."
        )
    state_dict = {key: state_dict[key].to(template[key].dtype) for key in template}
    with warnings.catch_warnings():
        # One process on purpose; DCP's warning that no process group is set says nothing new.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with written_whole(out) as partial:
            dcp.save({"model": state_dict}, checkpoint_id=str(partial))


def _shapes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Size]:
    return {key: tensor.shape for key, tensor in state_dict.items()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description="Convert a Hugging Face checkpoint to DCP.")
    parser.add_argument("--model", required=True, help="registered model name, e.g. llama3")
    parser.add_argument(
        "--custom_import", default="", help="module that registers --model, as the run's job.custom_import"
    )
    parser.add_argument("--flavor", required=True, help="the model's flavor, e.g. 8B")
    parser.add_argument("--hf", required=True, help="folder of the HF checkpoint (safetensors)")
    parser.add_argument("--out", required=True, help="DCP checkpoint folder to create")
    parser.add_argument("--dtype", choices=list(TORCH_DTYPES), default="float32", help="parameter dtype")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 bad input)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        import_custom_module(args.custom_import, key="--custom_import")
        convert_from_hf(args.model, args.flavor, args.hf, args.out, TORCH_DTYPES[args.dtype])
    except BAD_INPUT_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
