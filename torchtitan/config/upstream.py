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
    "parallelism.pipeline_parallel_layers_per_stage": UnbuiltKey("pipeline parallelism", ANY),
    "parallelism.pipeline_parallel_schedule": UnbuiltKey("pipeline parallelism", ANY),
    "parallelism.pipeline_parallel_schedule_csv": UnbuiltKey("pipeline parallelism", ANY),
    "parallelism.pipeline_parallel_microbatch_size": UnbuiltKey("pipeline parallelism", ANY),
    "float8.force_recompute_fp8_weight_in_bwd": UnbuiltKey(
        "a float8 option that torchao has deprecated", ANY
    ),
}

# Upstream's bundled dataset samples (in its tests/assets), and this trainer's bundled counterparts.
UPSTREAM_BUNDLED_DATASETS = {"c4_test": "smoke", "c4_validation": "smoke_validation"}
