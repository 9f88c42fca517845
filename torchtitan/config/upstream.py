"""What upstream torchtitan's configs say that this trainer spells differently or lacks.

A torchtitan user's TOML file, from the current release or an earlier one, should either load
here or stop with a message that says exactly what to change. The manager consults these
tables only for sections and keys that are not this trainer's own.
"""

from dataclasses import dataclass

# Sections of upstream's config for converters not built here. Upstream files carry them
# switched off, so they are ignored with a warning; naming their converter is refused.
# (Upstream's [quantize.linear.float8] is read as [float8].)
CONVERTER_SECTIONS = {
    "mx": "MX (microscaling) training",
    "quantize": "quantized training",
}
QUANTIZE_FLOAT8 = ("linear", "float8")

# Sections of upstream's config with no counterpart here, and what they configure.
UPSTREAM_ONLY_SECTIONS = {
    "fault_tolerance": "TorchFT fault tolerance",
    "experimental": "experimental model modules",
    "memory_estimation": "memory estimation inside the trainer (use ./run_memory_estimation.sh instead)",
}

# Earlier upstream names of keys that mean the same here: read as the new key, with a warning.
RENAMED_KEYS = {
    "checkpoint.enable_checkpoint": "checkpoint.enable",
    "checkpoint.model_weights_only": "checkpoint.last_save_model_only",
    "training.batch_size": "training.local_batch_size",
    "training.compile": "compile.enable",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
    "validation.enabled": "validation.enable",
    "float8.moe_fqns_prototype": "float8.moe_fqns",
    "job.print_config": "job.print_args",
    "debug.seed": "training.seed",
    "debug.deterministic": "training.deterministic",
    "debug.deterministic_warn_only": "training.deterministic_warn_only",
    "debug.moe_force_load_balance": "model.moe_force_load_balance",
    "experimental.custom_import": "job.custom_import",
    "experimental.custom_args_module": "job.custom_config_module",
    "training.dataloader.num_workers": "training.dataloader_num_workers",
    "training.dataloader.pin_memory": "training.dataloader_pin_memory",
}
# Earlier names read as the new key only when the value names a folder, as the new key does:
# upstream's tokenizer_path held either such a folder or a tokenizer.model file (see below).
RENAMED_FOLDER_KEYS = {"model.tokenizer_path": "model.hf_assets_path"}


ANY = object()


@dataclass(frozen=True)
class UnbuiltKey:
    """An upstream key whose feature is not built here.

    `default` is upstream's default: the key is ignored (with a warning) at that value and
    refused at any other. `default=ANY` marks a key that has no effect on training whatever
    its value (a marker, a deprecated no-op, or an option of a feature refused elsewhere).
    `fix` replaces "remove the key" in the refusal.
    """

    feature: str
    default: object
    fix: str = ""


UNBUILT_KEYS = {
    "job.use_for_integration_test": UnbuiltKey("choosing its integration-test configs", ANY),
    "model.tokenizer_path": UnbuiltKey(
        "a tokenizer.model file (tiktoken or SentencePiece)",
        None,
        fix="set 'model.hf_assets_path' to the folder that holds the model's tokenizer.json "
        "(scripts/download_hf_assets.py fetches it) and remove the key",
    ),
    "model.norm_type": UnbuiltKey("the norm layer's type (fixed per model here)", "rmsnorm"),
    "metrics.rank_0_only": UnbuiltKey(
        "the metrics' ranks in earlier releases",
        True,
        fix="set 'metrics.save_for_all_ranks' = true instead",
    ),
    "float8.enable_float8_linear": UnbuiltKey(
        "turning float8 on in earlier releases",
        False,
        fix="add \"float8\" to 'model.converters' instead",
    ),
    "training.gc_debug": UnbuiltKey("a gc.collect() every step to find reference cycles", ANY),
    "parallelism.enable_compiled_autograd": UnbuiltKey("compiled autograd", False),
    "parallelism.context_parallel_rotate_method": UnbuiltKey("context parallelism", ANY),
    "parallelism.pipeline_parallel_split_points": UnbuiltKey("pipeline parallelism", ANY),
    "float8.force_recompute_fp8_weight_in_bwd": UnbuiltKey(
        "a float8 option that torchao has deprecated", ANY
    ),
    # Upstream's last TOML-era keys.
    "job.save_config_file": UnbuiltKey(
        "a copy of the resolved config",
        None,
        fix="the resolved config is always written to <job.dump_folder>/config.toml; remove the key",
    ),
    "comm.mode": UnbuiltKey(
        "dry runs on a fake or local-tensor backend",
        "default",
        fix="remove the key; for a dry run of a parallel layout, ./run_memory_estimation.sh --ngpu N "
        "with the same arguments builds and parallelizes the model for N ranks on a fake process "
        "group in one process and reports each rank's peak memory",
    ),
    "parallelism.pipeline_parallel_expert_parallel_overlap": UnbuiltKey("pipeline parallelism", ANY),
    "parallelism.expert_parallel_comm_backend": UnbuiltKey("DeepEP's all-to-all kernels", "standard"),
    "checkpoint.enable_ft_dataloader_checkpoints": UnbuiltKey("TorchFT fault tolerance", ANY),
    "checkpoint.initial_load_in_hf_quantized": UnbuiltKey(
        "quantized Hugging Face weights (block-scaled fp8 ones load dequantized with "
        "initial_load_in_hf alone here)",
        ANY,
    ),
    "training.dataloader.persistent_workers": UnbuiltKey(
        "keeping loader workers between passes (the training loader's workers live for the whole run)",
        ANY,
    ),
    **{
        f"validation.dataloader.{key}": UnbuiltKey(
            "validation loader workers (validation reads pre-tokenized local windows in the training "
            "process)",
            default,
        )
        for key, default in (("num_workers", 0), ("persistent_workers", False), ("pin_memory", False))
    },
    # Sections of features not built here, inert while switched off ("section.*": its other keys).
    "fault_tolerance.enable": UnbuiltKey("TorchFT fault tolerance", False),
    "fault_tolerance.*": UnbuiltKey("TorchFT fault tolerance", ANY),
    "memory_estimation.enable": UnbuiltKey(
        "memory estimation inside the trainer", False, fix="run ./run_memory_estimation.sh instead"
    ),
    "memory_estimation.*": UnbuiltKey("memory estimation inside the trainer", ANY),
}


def unbuilt_key(name: str) -> UnbuiltKey | None:
    """The entry for upstream key `name` ("section.key"), its section's "section.*" if it has one."""
    return UNBUILT_KEYS.get(name) or UNBUILT_KEYS.get(f"{name.partition('.')[0]}.*")


def upstream_keys_of(section: str) -> list[str]:
    """The upstream keys of [section] ("section.key") that are read or ignored here."""
    return [name for name in RENAMED_KEYS | UNBUILT_KEYS if name.startswith(f"{section}.")]


def has_upstream_keys(section: str) -> bool:
    """Whether upstream's [section] holds keys that are read or ignored here."""
    return bool(upstream_keys_of(section))


# Upstream's bundled dataset samples (in its tests/assets), and this trainer's bundled counterparts.
UPSTREAM_BUNDLED_DATASETS = {"c4_test": "smoke", "c4_validation": "smoke_validation"}
