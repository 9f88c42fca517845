"""Checks of a parsed `JobConfig`: ranges, keys whose feature is not built, and keys that
contradict each other. Each problem is a `ConfigError` naming the key, the value and the fix;
`validate` raises the first. The loader (`torchtitan.config.manager`) runs it on every config,
and the launchers' pre-flight check (`torchtitan.config.check`) runs the loader.
"""

import dataclasses
import importlib.util
import logging
import math
import os
from pathlib import Path

from torchtitan.config.custom import check_module_name, custom_import_error
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import (
    BUNDLED_DATASET_FILES,
    CHECKPOINT_STATE_KEYS,
    CONVERTERS,
    JobConfig,
    section_types,
)
from torchtitan.config.toml_writer import as_written
from torchtitan.config.upstream import UPSTREAM_BUNDLED_DATASETS

logger = logging.getLogger(__name__)


def _check_ranges(config: JobConfig) -> None:
    for section, cls in section_types(type(config)).items():
        for f in dataclasses.fields(cls):
            value = getattr(getattr(config, section), f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            # nan fails every comparison, so the bounds below would let it through.
            if not math.isfinite(value):
                raise ConfigError(
                    f"'{section}.{f.name}' = {value} is not a finite number; set it to a finite value."
                )
            lo, hi = f.metadata.get("min"), f.metadata.get("max")
            gt, lt = f.metadata.get("gt"), f.metadata.get("lt")
            bad = (lo is not None and value < lo) or (hi is not None and value > hi)
            bad = bad or (gt is not None and value <= gt) or (lt is not None and value >= lt)
            if bad:
                bounds = [f">= {lo}"] * (lo is not None) + [f"<= {hi}"] * (hi is not None)
                bounds += [f"> {gt}"] * (gt is not None) + [f"< {lt}"] * (lt is not None)
                raise ConfigError(
                    f"'{section}.{f.name}' = {value} is out of range: it must be {' and '.join(bounds)}."
                )


def attention_backend_conflict(mask_type: str, whose: str = "") -> ConfigError:
    """The error for a mask type other than causal with the sdpa attention backend; `whose`
    says where the backend came from when the config may not have set it."""
    return ConfigError(
        f"'model.attn_mask_type' = '{mask_type}' needs the flex attention backend, but "
        f"'model.attn_backend' is 'sdpa'{whose}, which is causal only. Set "
        'model.attn_backend = "flex", or model.attn_mask_type = "causal".'
    )


def split_documents_conflict(mask_type: str, backend: str | None, whose: str = "") -> ConfigError:
    """The error for `model.attn_split_documents` with a mask type it does not apply to; `whose`
    says where the mask type came from when the config may not have set it. The fix it names
    also sets the flex backend unless ``backend`` already is flex."""
    problem = (
        f"'model.attn_split_documents' = true, but 'model.attn_mask_type' is '{mask_type}'{whose}; "
        "the key splits sliding_window and chunked masks at EOS."
    )
    if mask_type == "block_causal":
        return ConfigError(f"{problem} block_causal always splits documents: drop the key.")
    flex = "" if backend == "flex" else 'model.attn_backend = "flex" and '
    return ConfigError(
        f"{problem} For causal attention split at documents set {flex}model.attn_mask_type = "
        '"block_causal" (which always splits), and drop the key.'
    )


def global_layers_conflict(every: int, mask_type: str | None, whose: str = "") -> ConfigError | None:
    """The error for `model.attn_global_every_n_layers` = `every` with `mask_type` (None: not
    known yet, the flavor's), or None when they go together; `whose` says where the mask type
    came from when the config may not have set it. Global layers interleave with local ones
    (sliding_window, chunked), and a global layer on every layer is causal attention."""
    key = f"'model.attn_global_every_n_layers' = {every}"
    if every and mask_type not in (None, "sliding_window", "chunked"):
        return ConfigError(
            f"{key}, but 'model.attn_mask_type' is '{mask_type}'{whose}: global layers interleave "
            "with local ones, which only sliding_window and chunked make; set model.attn_mask_type = "
            '"sliding_window" or "chunked", or drop the key.'
        )
    if every == 1:
        return ConfigError(
            f"{key} makes every layer global, which is causal attention (block_causal with "
            "attn_split_documents); set model.attn_mask_type to that and drop the key, or use 2 or more."
        )
    return None


def _check_checkpoint(config: JobConfig) -> None:
    c = config.checkpoint
    unknown = sorted(set(c.exclude_from_loading) - set(CHECKPOINT_STATE_KEYS))
    if unknown:
        raise ConfigError(
            f"'checkpoint.exclude_from_loading' = {c.exclude_from_loading} names {unknown}, which a "
            f"checkpoint does not hold; valid entries: {', '.join(CHECKPOINT_STATE_KEYS)}."
        )
    if not c.enable:
        _refuse_checkpoint_keys_without_enable(config)
    if c.load_only:
        _refuse_saving_keys_with_load_only(c)
    if c.initial_load_in_hf and not c.initial_load_model_only:
        raise ConfigError(
            "'checkpoint.initial_load_model_only' = false asks for the optimizer and training state, "
            "which a Hugging Face checkpoint (checkpoint.initial_load_in_hf = true) does not hold; "
            "set initial_load_model_only = true."
        )
    if c.last_save_in_hf and not c.last_save_model_only:
        raise ConfigError(
            "'checkpoint.last_save_in_hf' = true writes the model weights only, but "
            "checkpoint.last_save_model_only = false asks for a last checkpoint to resume from; set "
            "last_save_model_only = true, or last_save_in_hf = false (and convert a DCP checkpoint "
            "later with scripts/checkpoint_conversion/convert_to_hf.py)."
        )
    if c.initial_load_in_hf and not c.initial_load_path:
        raise ConfigError(
            "'checkpoint.initial_load_in_hf' = true needs 'checkpoint.initial_load_path', the folder "
            "with the Hugging Face safetensors."
        )


def _refuse_checkpoint_keys_without_enable(config: JobConfig) -> None:
    """Keys that act only with checkpoint.enable; ignoring them would train from scratch, or end
    with no export, without a word."""
    c, defaults = config.checkpoint, type(config.checkpoint)()
    set_keys = [
        f"'checkpoint.{key}' = {as_written(getattr(c, key))}"
        for key in ("initial_load_path", "load_step", "exclude_from_loading", "last_save_in_hf", "load_only")
        if getattr(c, key) != getattr(defaults, key)
    ]
    if set_keys:
        folder = Path(config.job.dump_folder) / c.folder
        raise ConfigError(
            f"{set_keys[0]} acts only with checkpoint.enable = true; set it (this run's checkpoint "
            f"folder is then '{folder}'), or remove the key."
        )


def _refuse_saving_keys_with_load_only(c) -> None:
    """Keys that ask for a save, which checkpoint.load_only rules out."""
    defaults = type(c)()
    set_keys = [
        f"'checkpoint.{key}' = {as_written(getattr(c, key))}"
        for key in ("create_seed_checkpoint", "enable_first_step_checkpoint", "last_save_in_hf", "async_mode")
        if getattr(c, key) != getattr(defaults, key)
    ]
    if set_keys:
        raise ConfigError(
            f"{set_keys[0]} asks for a checkpoint to be written, but checkpoint.load_only = true saves "
            "none; remove the key, or set load_only = false."
        )


def _check_custom_import(name: str) -> None:
    """Before the ranks start: a module name, whose top-level package can be found (finding
    more would import that package)."""
    if not name:
        return
    check_module_name(name, "job.custom_import")
    top = name.partition(".")[0]
    if importlib.util.find_spec(top) is None:
        raise custom_import_error(name, top)


def _check_profiling(p) -> None:
    if p.enable_profiling and p.profile_freq < p.profiler_warmup + p.profiler_active:
        raise ConfigError(
            f"'profiling.profile_freq' = {p.profile_freq} is shorter than profiler_warmup "
            f"({p.profiler_warmup}) + profiler_active ({p.profiler_active}); raise profile_freq."
        )


# Folder keys (all under job.dump_folder but itself): an empty value, usually an unset shell
# variable, would write into the current folder.
FOLDER_KEYS = ("job.dump_folder", "metrics.save_tb_folder", "checkpoint.folder",
               "profiling.save_traces_folder", "profiling.save_memory_snapshot_folder",
               "comm.save_traces_folder")  # fmt: skip


def _check_folders(config: JobConfig) -> None:
    for name in FOLDER_KEYS:
        section, _, key = name.partition(".")
        if not getattr(getattr(config, section), key).strip():
            raise ConfigError(
                f"'{name}' is empty, often an unset shell variable: the run would write into the "
                "current folder; give a folder."
            )
    dump = Path(config.job.dump_folder)
    # os.path.exists: Path.exists raises where a parent cannot be entered.
    existing = next(p for p in (dump, *dump.parents) if os.path.exists(p))
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return
    problem = "is not a folder" if not existing.is_dir() else "cannot be written"
    raise ConfigError(
        dump_folder_error(config.job.dump_folder, problem if existing == dump else f"{existing} {problem}")
    )


def dump_folder_error(dump_folder: str, problem: str) -> str:
    """The message for a `job.dump_folder` the run cannot write to."""
    return f"'job.dump_folder' = '{dump_folder}' cannot be used: {problem}; choose another folder."


def _check_consistency(config: JobConfig) -> None:
    t, p = config.training, config.parallelism
    _check_folders(config)
    _check_custom_import(config.job.custom_import)
    if p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        raise ConfigError(
            f"'parallelism.data_parallel_shard_degree' = {p.data_parallel_shard_degree} is "
            "invalid: use a positive degree or -1 for the ranks left over."
        )
    if t.global_batch_size != -1 and t.global_batch_size < 1:
        raise ConfigError(
            f"'training.global_batch_size' = {t.global_batch_size} is invalid: use a positive "
            "number of sequences or -1 for local_batch_size x data-parallel degree."
        )
    if t.dtype == "bfloat16" and t.mixed_precision_param == "float32":
        raise ConfigError(
            "'training.dtype' = 'bfloat16' with 'training.mixed_precision_param' = 'float32' "
            "would upcast bf16 weights; set mixed_precision_param to 'bfloat16'."
        )
    if t.deterministic_warn_only and not t.deterministic:
        raise ConfigError(
            "'training.deterministic_warn_only' = true acts only with training.deterministic = true; "
            "set deterministic = true too, or remove the key."
        )
    if config.optimizer.early_step_in_backward and t.max_norm > 0:
        raise ConfigError(
            f"'training.max_norm' = {t.max_norm} clips by the norm of all gradients, which "
            "'optimizer.early_step_in_backward' = true frees one by one as it steps; set "
            "training.max_norm = 0 (grad_norm is still logged) or early_step_in_backward = false."
        )
    m = config.model
    if m.attn_backend == "sdpa" and m.attn_mask_type not in (None, "causal"):
        raise attention_backend_conflict(m.attn_mask_type)
    if m.attn_split_documents and m.attn_mask_type in ("causal", "block_causal"):
        raise split_documents_conflict(m.attn_mask_type, m.attn_backend)
    if error := global_layers_conflict(m.attn_global_every_n_layers, m.attn_mask_type):
        raise error
    _check_expert_parallel(p)
    _check_sequence_shards(config)
    _check_converters(config)
    _check_upstream_datasets(config)
    _check_validation(config.validation, t)
    _check_loss_chunks(config)
    _check_checkpoint(config)
    _check_profiling(config.profiling)
    if config.compile.enable:
        unknown = sorted(set(config.compile.components) - {"model", "loss"})
        if unknown:
            raise ConfigError(
                f"'compile.components' = {config.compile.components} contains {unknown}; "
                "valid components are 'model' and 'loss'."
            )


def _check_converters(config: JobConfig) -> None:
    converters = config.model.converters
    unknown = [name for name in converters if name not in CONVERTERS]
    if unknown:
        raise ConfigError(
            f"'model.converters' = {converters} names {unknown}, which this trainer does not build; "
            "the converter here is float8 (also spelled 'quantize.linear.float8'). Remove the rest."
        )
    f8 = config.float8
    if "float8" in {CONVERTERS[name] for name in converters}:
        if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
            raise ConfigError(
                f"'float8.enable_fsdp_float8_all_gather' = true needs recipe_name 'tensorwise' (one scale "
                f"per weight), but recipe_name = '{f8.recipe_name}'; set recipe_name = 'tensorwise' or "
                "turn the float8 all-gather off."
            )
        if "auto_filter_small_kn" in f8.filter_fqns and f8.recipe_name == "rowwise_with_gw_hp":
            raise ConfigError(
                "'float8.filter_fqns' holds 'auto_filter_small_kn', which torchao has no size heuristic "
                "for under recipe_name 'rowwise_with_gw_hp'; remove the entry, or use 'tensorwise' or "
                "'rowwise'."
            )
        if f8.moe_fqns:
            raise ConfigError(
                f"'float8.moe_fqns' = {f8.moe_fqns} asks for float8 grouped experts, which this trainer "
                "does not build (float8 converts nn.Linear layers; the experts train in the "
                "high-precision dtype); set moe_fqns = [] or remove it."
            )
        if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
            raise ConfigError(
                "'float8.precompute_float8_dynamic_scale_for_fsdp' = true precomputes the scales of the "
                "float8 all-gather; set float8.enable_fsdp_float8_all_gather = true too, or turn it off."
            )
    elif f8 != type(f8)():
        logger.warning(
            "[float8] is set but has no effect: float8 training is on only when model.converters "
            'includes "float8". Add it, or remove the section to silence this warning.'
        )


def _check_upstream_datasets(config: JobConfig) -> None:
    """Upstream's bundled samples would otherwise be looked up on the hub, which fails (or hangs
    offline) only once the ranks have started."""
    for section in ("training", "validation") if config.validation.enable else ("training",):
        name = getattr(config, section).dataset
        if name in UPSTREAM_BUNDLED_DATASETS and getattr(config, section).dataset_path is None:
            streamed = "'c4' (streamed from the hub), " if section == "training" else ""
            raise ConfigError(
                f"'{section}.dataset' = '{name}' is upstream torchtitan's bundled C4 sample, which is "
                f"not shipped here; use '{UPSTREAM_BUNDLED_DATASETS[name]}' (the bundled corpus here), "
                f"{streamed}or set '{section}.dataset_path' to local files."
            )


def _check_validation(v, t) -> None:
    if v.enable and v.dataset_path is None and v.dataset not in BUNDLED_DATASET_FILES:
        raise ConfigError(
            f"'validation.dataset' = '{v.dataset}' would stream from the hub, but validation needs a "
            "finite split: set 'validation.dataset_path' to local files of a held-out split (or use "
            "'smoke_validation', the bundled one)."
        )
    if v.steps == 0 or v.steps < -1:
        raise ConfigError(
            f"'validation.steps' = {v.steps} is invalid: use a positive number of batches or -1 "
            "for every whole global batch of the split."
        )
    # Only an enabled validation runs the model at validation.seq_len, so a disabled section
    # may keep the 2048 default under a shorter training.seq_len.
    if v.enable and v.seq_len > t.seq_len:
        raise ConfigError(
            f"'validation.seq_len' = {v.seq_len} exceeds 'training.seq_len' = {t.seq_len}: the "
            f"model's RoPE table covers only training.seq_len positions. Set validation.seq_len "
            f"to at most {t.seq_len}."
        )


def _check_loss_chunks(config: JobConfig) -> None:
    """Every chunk of the output head needs a token: the chunks of one forward (a microbatch
    under pipeline parallelism, this rank's share of each sequence under context parallelism)."""
    t, p = config.training, config.parallelism
    pipelined = p.pipeline_parallel_degree > 1
    sequences = p.pipeline_parallel_microbatch_size if pipelined else t.local_batch_size
    tokens = sequences * t.seq_len // p.context_parallel_degree
    if t.loss_chunks > tokens:
        forward = "a pipeline microbatch" if pipelined else "one forward"
        cp_degree = p.context_parallel_degree
        cp = f" / context_parallel_degree {cp_degree}" if cp_degree > 1 else ""
        raise ConfigError(
            f"'training.loss_chunks' = {t.loss_chunks} exceeds the {tokens} tokens of {forward} "
            f"({sequences} sequence(s) x seq_len {t.seq_len}{cp}); set training.loss_chunks to at "
            f"most {tokens} (1 computes the whole logits at once)."
        )


def _check_sequence_shards(config: JobConfig) -> None:
    """Sequence parallelism splits every sequence into tensor_parallel_degree equal shards:
    the training one, and the validation one when validation runs."""
    tp = config.parallelism.tensor_parallel_degree
    lengths = [("training.seq_len", config.training.seq_len)]
    if config.validation.enable:
        lengths.append(("validation.seq_len", config.validation.seq_len))
    for key, length in lengths:
        if length % tp:
            raise ConfigError(
                f"'{key}' = {length} is not a multiple of 'parallelism.tensor_parallel_degree' = {tp}: "
                f"sequence parallelism splits each sequence into {tp} equal shards. Use a multiple "
                f"of {tp}, e.g. {length - length % tp or tp}."
            )


def _check_expert_parallel(p) -> None:
    """What can be told from the config alone; the resolved degrees are checked at parallelize."""
    ep = p.expert_parallel_degree
    etp, tp = p.expert_tensor_parallel_degree, p.tensor_parallel_degree
    if etp not in (1, tp):
        raise ConfigError(
            f"'parallelism.expert_tensor_parallel_degree' = {etp} must be 1 or the "
            f"tensor_parallel_degree ({tp}): under expert parallelism the experts are either spread over "
            "the TP ranks too (1) or sharded over TP."
        )
    conflict = expert_parallel_conflict(ep, tp, etp, p.data_parallel_shard_degree, p.context_parallel_degree)
    if conflict:
        raise ConfigError(conflict)


def expert_parallel_conflict(ep: int, tp: int, etp: int, dp_shard: int, cp: int = 1) -> str | None:
    """Why an EP group of `ep` ranks cannot be borrowed from the other degrees, or None.

    As in torchtitan, the group takes every context-parallel rank, every TP rank too with `etp`
    1 under TP, and the rest of its ranks from the FSDP shard group. Checked on the config
    (`dp_shard` -1, not resolved yet, is not checked) and again by `ParallelDims` on the
    resolved degrees.
    """
    if ep == 1:
        return None
    borrows_tp = tp > 1 and etp == 1
    taken = {"context_parallel_degree": cp, "tensor_parallel_degree": tp if borrows_tp else 1}
    taken = {key: degree for key, degree in taken.items() if degree > 1}
    whole = math.prod(taken.values())
    named = " x ".join(f"{key} {degree}" for key, degree in taken.items())
    if ep % whole:
        fix = f"choose a multiple of {whole}"
        if borrows_tp:
            fix += (
                f", or set parallelism.expert_tensor_parallel_degree = {tp} to shard the experts over "
                "TP instead"
            )
        return (
            f"'parallelism.expert_parallel_degree' = {ep} is not a multiple of {named}: the EP group "
            "takes all of those ranks and the rest from the FSDP shard group; " + fix + "."
        )
    from_shard = ep // whole
    if dp_shard != -1 and dp_shard % from_shard:
        borrowed = f" (ep {ep} / {named})" if taken else ""
        return (
            f"'parallelism.expert_parallel_degree' = {ep} takes {from_shard}{borrowed} ranks of the "
            f"FSDP shard group, which does not divide data_parallel_shard_degree {dp_shard}: expert "
            "parallelism borrows its ranks from that group; choose an expert_parallel_degree that fits it."
        )
    return None


def validate(config: JobConfig) -> JobConfig:
    """Range, not-built-yet and cross-key checks; raises ConfigError on the first problem."""
    _check_ranges(config)
    _check_consistency(config)
    return config
