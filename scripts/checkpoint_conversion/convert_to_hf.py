"""Convert a DCP checkpoint's model weights into a Hugging Face transformers checkpoint.

Reads ``{"model": {FQN: tensor}}`` from the DCP (other entries, such as optimizer state, are
left unread), so a trainer checkpoint converts as it is. Writes safetensors shards, their index
and config.json, loadable with ``transformers.AutoModelForCausalLM.from_pretrained(OUT)``.
Parameters are written in ``--dtype`` (default float32); buffers keep the model's dtype for them
(MoE ``expert_bias`` stays float32, as in published DeepSeek-V3 checkpoints). With
``--hf_assets``, config.json takes its token ids from that folder's config.json. ``--seq_len``
is the run's ``training.seq_len``: config.json says what the trained model computes, which for
DeepSeek-V3 flavors trained past 4096 tokens includes YaRN (``rope_scaling``); without it the
flavor's published context is assumed. ``--run_config DUMP/config.toml`` (the config every run
writes to its dump folder) instead takes the model, flavor, seq_len, tokenizer folder and every
`[model]` key from the run, ``model.always_apply_yarn`` and attention overrides included, as
the trainer's own export does (and imports its ``job.custom_import``; ``--custom_import MODULE``
does so without it, for a model registered outside this repository). Tokenizer files are not
copied. The output appears whole or not at all.

In one process it holds the whole model in CPU memory. Under `torchrun --nproc-per-node N` every
rank reads (from the DCP) and writes (through DCP's HuggingFaceStorageWriter) the layers it is
given, one in N, so each holds 1/N of the model; the ranks then consolidate the output files in
turns (see `torchtitan/components/hf_distributed_export.py`).

Bad input (a missing or unreadable folder, an unknown model or flavor, a checkpoint whose keys
or shapes are not the flavor's, a flavor Hugging Face cannot express, an output folder that is
a file or not empty) ends with exit code 2 and a one-paragraph message on stderr.

Usage:
    python scripts/checkpoint_conversion/convert_to_hf.py --model llama3 --flavor 8B \\
        --dcp ./outputs/checkpoint/step-1000 --out ./outputs/llama3_8b_hf [--dtype bfloat16] \\
        [--seq_len 8192]
    torchrun --nproc-per-node 8 scripts/checkpoint_conversion/convert_to_hf.py --model llama3 \\
        --flavor 405B --dcp ./outputs/checkpoint/step-1000 --out ./outputs/llama3_405b_hf
    python scripts/checkpoint_conversion/convert_to_hf.py --run_config ./outputs/config.toml \\
        --dcp ./outputs/checkpoint/step-1000 --out ./outputs/llama3_8b_hf
"""

import argparse
import contextlib
import json
import os
import shutil
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan.components.checkpoint_folders import is_dcp, load_from, saved_shapes
from torchtitan.components.hf_distributed_export import (
    file_of_each_key,
    layer_groups,
    write_hf_tensors_from_all_ranks,
)
from torchtitan.components.hf_io import CONFIG_FILE
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args as parse_run_config
from torchtitan.models import build_run_state_dict_adapter, build_state_dict_adapter, get_train_spec
from torchtitan.protocols.state_dict_adapter import (
    HFConfigError,
    StateDictAdapter,
    StateDictMismatchError,
    describe_mismatch,
)
from torchtitan.protocols.train_spec import import_custom_module
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.exit_codes import EXIT_BAD_INPUT
from torchtitan.tools.folders import check_new_folder, written_whole

BAD_INPUT_ERRORS = (ConfigError, HFConfigError, StateDictMismatchError, FileNotFoundError, FileExistsError)
MODEL_KEY = "model"
DCP_KEY = "--dcp"  # names the argument in the error for an unreadable checkpoint


def convert_to_hf(
    model: str,
    flavor: str,
    dcp_dir: str | Path,
    out: str | Path,
    dtype: torch.dtype,
    hf_assets: str | Path | None = None,
    seq_len: int | None = None,
    adapter: StateDictAdapter | None = None,
) -> None:
    """Load the model weights of the DCP in `dcp_dir` as `model`'s `flavor` and write them to
    `out` as an HF checkpoint; `seq_len` is the training.seq_len it was trained at (see
    `with_trained_seq_len`). A given `adapter` (a run's: `build_run_state_dict_adapter`)
    replaces the one built from `flavor`, `hf_assets` and `seq_len`.

    Raises:
        ConfigError: unknown model or flavor.
        HFConfigError: the flavor has no Hugging Face equivalent.
        FileNotFoundError: `dcp_dir` is not a readable DCP checkpoint.
        FileExistsError: `out` is a file, or a folder that is not empty.
        StateDictMismatchError: the checkpoint's model keys or shapes are not the flavor's.
    """
    out = check_new_folder(out)
    adapter = adapter or build_state_dict_adapter(model, flavor, hf_assets, seq_len)
    config = adapter.hf_config(dtype)
    template = get_train_spec(model).build_meta_model(adapter.model_args, dtype).state_dict()
    expected = {key: tensor.shape for key, tensor in template.items()}
    if mismatch := describe_mismatch(expected, _stored_model_shapes(dcp_dir)):
        raise StateDictMismatchError(f"'{dcp_dir}' does not hold a {model} {flavor} model: {mismatch}")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    writers = _writer_of_each_key(template, world)
    mine = {key: torch.empty_like(t, device="cpu") for key, t in template.items() if writers[key] == rank}
    with warnings.catch_warnings():
        # One process on purpose; DCP's warning that no process group is set says nothing new.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_from(Path(dcp_dir), {MODEL_KEY: mine}, DCP_KEY)
    with _written_whole_by_every_rank(out, rank) as partial:
        write_hf_tensors_from_all_ranks(partial, adapter.to_hf(mine), file_of_each_key(adapter, expected))
        if rank == 0:
            (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def _writer_of_each_key(template: dict, world: int) -> dict[str, int]:
    """The rank that reads and writes each key: a layer's keys go together, the layers and the
    tensors outside them (one group each) round the ranks."""
    return {key: group % world for key, group in layer_groups(template).items()}


@contextlib.contextmanager
def _written_whole_by_every_rank(out: Path, rank: int):
    """`written_whole`, shared by the ranks: rank 0 makes the partial folder and publishes it
    once every rank has written its part."""
    if not dist.is_initialized():
        with written_whole(out) as partial:
            yield partial
        return
    partial = out.with_name(out.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    try:
        yield partial
    except BaseException:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    dist.barrier()
    if rank == 0:
        if out.exists():
            out.rmdir()
        partial.rename(out)


def _run_adapter(run_config: str, model: str | None, flavor: str | None) -> tuple[StateDictAdapter, str, str]:
    """The adapter of the run whose config.toml is `run_config`, with its model and flavor;
    `model` and `flavor`, when given too, must be the run's."""
    job_config = parse_run_config(["--config", run_config], env={})
    import_custom_module(job_config.job.custom_import)
    m = job_config.model
    for option, given, runs in (("--model", model, m.name), ("--flavor", flavor, m.flavor)):
        if given is not None and given != runs:
            raise ConfigError(f"{option} {given} is not the run's ({runs}, in {run_config}); leave it out")
    adapter = build_run_state_dict_adapter(job_config)
    if adapter is None:
        raise ConfigError(f"model '{m.name}' has no Hugging Face state-dict adapter")
    try:
        tokenizer = build_hf_tokenizer(job_config)
    except ConfigError:  # the run's tokenizer is gone: config.json gets the assets' ids, if any
        pass
    else:
        adapter.use_tokenizer_ids(tokenizer.bos_id, tokenizer.eos_id)
    return adapter, m.name, m.flavor


def _stored_model_shapes(dcp_dir: str | Path) -> dict[str, torch.Size]:
    """{FQN: shape} of the tensors the DCP in `dcp_dir` stores under the "model" key."""
    if not is_dcp(Path(dcp_dir)):
        raise FileNotFoundError(f"'{dcp_dir}' is not a DCP checkpoint folder (it has no .metadata file)")
    return saved_shapes(Path(dcp_dir), MODEL_KEY, DCP_KEY)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description="Convert a DCP checkpoint to Hugging Face safetensors.")
    parser.add_argument("--model", help="registered model name, e.g. llama3 (or from --run_config)")
    parser.add_argument(
        "--custom_import", default="", help="module that registers --model, as the run's job.custom_import"
    )
    parser.add_argument("--flavor", help="the model's flavor, e.g. 8B (or from --run_config)")
    parser.add_argument(
        "--run_config", default=None, help="the run's DUMP/config.toml: model, flavor, [model] keys"
    )
    parser.add_argument("--dcp", required=True, help="DCP checkpoint folder (model weights under 'model')")
    parser.add_argument("--out", required=True, help="HF checkpoint folder to create")
    parser.add_argument("--dtype", choices=list(TORCH_DTYPES), default="float32", help="parameter dtype")
    parser.add_argument("--hf_assets", default=None, help="HF asset folder whose config.json has token ids")
    parser.add_argument(
        "--seq_len", type=int, default=None, help="the run's training.seq_len (DeepSeek-V3 past 4096: YaRN)"
    )
    args = parser.parse_args(argv)
    if args.run_config is None and (args.model is None or args.flavor is None):
        parser.error("give --model and --flavor, or --run_config")
    if args.run_config is not None and (args.seq_len is not None or args.hf_assets is not None):
        parser.error("--seq_len and --hf_assets come from --run_config; leave them out")
    if args.seq_len is not None and args.seq_len < 1:
        parser.error(f"--seq_len {args.seq_len} must be a positive number of tokens")
    if args.hf_assets is not None and not (Path(args.hf_assets) / "config.json").is_file():
        parser.error(f"--hf_assets {args.hf_assets} holds no config.json to take the token ids from")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 bad input)."""
    args = parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")  # under torchrun: the ranks share the work
    try:
        dtype = TORCH_DTYPES[args.dtype]
        import_custom_module(args.custom_import, key="--custom_import")
        model, flavor, adapter = args.model, args.flavor, None
        if args.run_config is not None:
            adapter, model, flavor = _run_adapter(args.run_config, model, flavor)
        convert_to_hf(model, flavor, args.dcp, args.out, dtype, args.hf_assets, args.seq_len, adapter)
    except BAD_INPUT_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
