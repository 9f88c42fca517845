"""The TOML schema as dataclasses: one dataclass per `[section]`, one field per key.

Names follow torchtitan's schema so that a torchtitan user's file runs unchanged where the
feature exists. Every field carries a one-line help text (shown by `--help`) through `opt`.
Sections whose feature is not built yet are declared so that files parse, and
`torchtitan.config.validation` rejects any non-default value that would need them.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Literal

# `model.converters` entries, upstream's newer spelling included, and the converter each names.
CONVERTERS = {"float8": "float8", "quantize.linear.float8": "float8"}


def opt(default, help: str, **checks):
    """A dataclass field with its `--help` line and optional range checks.

    Args:
        default: the default value (lists are copied per instance).
        help: one line for `--help`.
        checks: `min`, `max` (inclusive) or `gt`, `lt` (exclusive) bounds, checked by
            `torchtitan.config.validation`.
    """
    metadata = {"help": help, **checks}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Job:
    config_file: str = opt("", "TOML file to read; also --config NAME_OR_PATH or $CONFIG_FILE")
    dump_folder: str = opt("./outputs", "folder for logs, metrics, resolved config and outputs")
    description: str = opt("default job", "free-text description of the run")
    print_args: bool = opt(
        False, "log the whole resolved config at start (it is always written to dump_folder/config.toml)"
    )
    custom_import: str = opt(
        "",
        "module every rank imports first, e.g. one that registers a model of your own with "
        "torchtitan.protocols.register_train_spec; it must be importable there (installed, or on PYTHONPATH)",
    )
    custom_config_module: str = opt(
        "",
        "module whose JobConfig dataclass adds [sections] and keys of your own to this schema "
        "(see 'Keys of your own' in docs/configuration.md); set in the TOML file or on the command line",
    )


@dataclass
class Model:
    name: str = opt("llama3", "registered model name (see torchtitan/models)")
    flavor: str = opt("debugmodel", "model size preset of that model")
    hf_assets_path: str = opt(
        "torchtitan/assets/tokenizer", "folder with tokenizer.json (and HF config/weights)"
    )
    attn_backend: Literal["sdpa", "flex"] | None = opt(
        None, "attention backend; unset = the flavor's. sdpa is causal only, flex runs every mask type"
    )
    attn_mask_type: Literal["causal", "block_causal", "sliding_window", "chunked"] | None = opt(
        None,
        "attention mask of every layer (see attn_global_every_n_layers); unset = the flavor's; all but "
        "causal need flex (block_causal: documents split at EOS; sliding_window and chunked go by "
        "position unless attn_split_documents)",
    )
    attn_split_documents: bool = opt(
        False,
        "also split sliding_window and chunked masks at EOS, so that no query sees another packed "
        "document (block_causal always does)",
    )
    sliding_window: int = opt(
        4096, "keys a query sees (itself included) under attn_mask_type sliding_window", min=1
    )
    attn_chunk_size: int = opt(
        8192, "chunk length under attn_mask_type chunked (Llama 4's chunked mask)", min=1
    )
    attn_global_every_n_layers: int = opt(
        0,
        "with attn_mask_type sliding_window or chunked: every n-th layer (layers n-1, 2n-1, ...) sees every "
        "earlier token instead (causal; block_causal with attn_split_documents), as Llama 4's and gpt-oss' "
        "global layers do; 0 = none",
        min=0,
    )
    always_apply_yarn: bool = opt(
        False,
        "DeepSeek flavors: apply their YaRN at any training.seq_len, as Hugging Face runs the published "
        "weights (continuing from them); default: only past the original 4096 positions (pre-training)",
    )
    moe_force_load_balance: bool = opt(
        False,
        "MoE flavors: deal each token's top-k experts round-robin instead of by router score, so that "
        "every expert gets the same tokens (to benchmark MoE at perfect balance, not to train a "
        "model)",
    )
    converters: list[str] = opt(
        [], "model converters applied before parallelizing: float8 (torchao Float8Linear; see [float8])"
    )
    print_after_conversion: bool = opt(False, "log the model's modules after its converters run")


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = opt("AdamW", "optimizer class")
    lr: float = opt(8e-4, "peak learning rate", gt=0.0)
    beta1: float = opt(0.9, "Adam beta1", min=0.0, lt=1.0)
    beta2: float = opt(0.95, "Adam beta2", min=0.0, lt=1.0)
    eps: float = opt(1e-8, "Adam epsilon", gt=0.0)
    weight_decay: float = opt(0.1, "decoupled weight decay (AdamW) or L2 penalty (Adam)", min=0.0)
    implementation: Literal["fused", "foreach", "for-loop"] = opt(
        "fused", "optimizer kernel; fused falls back to foreach on devices torch has no fused one for"
    )
    early_step_in_backward: bool = opt(
        False,
        "step each parameter as soon as backward has its gradient, then free it (saves the "
        "gradients' memory); needs training.max_norm = 0, no gradient accumulation, and no DDP",
    )


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "linear warmup steps, reaching optimizer.lr at the last of them", min=0)
    total_steps: int | None = opt(
        None,
        "steps the schedule spans (decay_ratio is a fraction of them); unset = training.steps. "
        "Set it to stop a run early on the full run's lr curve",
        min=1,
    )
    decay_ratio: float | None = opt(
        None,
        "fraction of the schedule's steps spent decaying, at most those after warmup (as upstream); "
        "unset = all after warmup",
        min=0.0,
        max=1.0,
    )
    decay_type: Literal["linear", "sqrt", "cosine"] = opt("linear", "shape of the decay phase")
    min_lr_factor: float = opt(
        0.0, "lr the decay ends at, a step after the last, as a fraction of optimizer.lr", min=0.0, max=1.0
    )


# The datasets shipped in torchtitan/assets, by name: the file of each, relative to that folder.
BUNDLED_DATASET_FILES = {
    "smoke": "smoke_corpus/train.jsonl",
    "smoke_validation": "smoke_corpus/validation.jsonl",
}


@dataclass
class Training:
    dataset: str = opt("smoke", "dataset name: smoke (bundled), or a Hugging Face hub name")
    dataset_path: str | None = opt(
        None,
        "local file or folder instead of the hub: json/jsonl/parquet records with a 'text' field, "
        "or txt files, each file one document",
    )
    local_batch_size: int = opt(8, "sequences per rank per micro-batch", min=1)
    global_batch_size: int = opt(
        -1, "sequences per optimizer step over all ranks; -1 = local x dp (no accumulation)"
    )
    seq_len: int = opt(2048, "tokens per sequence", min=1)
    loss_chunks: int = opt(
        0,
        "token ranges the output head and loss run over, one at a time, each recomputed in "
        "backward, so the whole logits never exist; 0 = as many as keep each chunk's fp32 "
        "logits within 64 MiB per rank (1 for a small vocabulary); 1 = the whole logits at once",
        min=0,
    )
    max_norm: float = opt(1.0, "gradient clipping max global norm; 0 disables", min=0.0)
    steps: int = opt(10000, "optimizer steps to train", min=1)
    dtype: Literal["float32", "bfloat16"] = opt(
        "float32", "dtype of parameters, gradients and optimizer state"
    )
    mixed_precision_param: Literal["bfloat16", "float32"] = opt(
        "bfloat16", "compute dtype of parameters under FSDP (autocast without FSDP)"
    )
    mixed_precision_reduce: Literal["float32", "bfloat16"] = opt(
        "float32", "dtype of FSDP gradient reduction"
    )
    gc_freq: int = opt(50, "run gc.collect every this many steps", min=1)
    seed: int | None = opt(
        None, "random seed; unset = 0 for weights, fixed data order", min=-(2**63), max=2**64 - 1
    )  # the range torch.manual_seed takes
    deterministic: bool = opt(False, "use deterministic algorithms (slower)")
    deterministic_warn_only: bool = opt(
        False,
        "with deterministic: warn about an op that has no deterministic kernel instead of failing "
        "(that op then runs its nondeterministic kernel)",
    )
    enable_cpu_offload: bool = opt(
        False, "FSDP CPU offload of parameters and optimizer state (accelerator and FSDP only)"
    )
    dataloader_num_workers: int = opt(
        0,
        "processes that stream and tokenize a hub dataset ahead of the steps, at most one per file "
        "shard of a rank's part; 0 = in the training process (local data always is)",
        min=0,
    )
    dataloader_pin_memory: bool = opt(
        False, "page-lock each batch so its copy to the accelerator does not block the host"
    )


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, "replicas (HSDP outer dim)", min=1)
    data_parallel_shard_degree: int = opt(-1, "FSDP shard degree; -1 = the ranks left over")
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = opt(
        "default",
        "free gathered params after forward (default: all but the last block and the root; none under "
        "pipeline parallelism)",
    )
    tensor_parallel_degree: int = opt(1, "tensor parallel degree", min=1)
    disable_loss_parallel: bool = opt(False, "gather logits instead of vocab-parallel loss")
    enable_async_tensor_parallel: bool = opt(False, "overlap TP comms with compute (compile)")
    context_parallel_degree: int = opt(
        1, "context parallel degree: each sequence is split over this many ranks", min=1
    )
    context_parallel_method: Literal["allgather_kv", "ulysses"] = opt(
        "allgather_kv",
        "how attention sees the whole sequence: allgather_kv gathers every rank's keys and values; "
        "ulysses swaps the sequence split for a split of the heads (all-to-all), and needs the heads "
        "per TP rank divisible by the degree",
    )
    context_parallel_load_balancer: Literal["headtail", "none"] = opt(
        "headtail",
        "which tokens a rank holds: headtail gives rank r chunks r and 2*cp-1-r of 2*cp, so that causal "
        "attention costs every rank the same; none gives contiguous chunks",
    )
    pipeline_parallel_degree: int = opt(
        1, "pipeline parallel degree: stages are split over this many ranks", min=1
    )
    pipeline_parallel_schedule: str = opt(
        "1F1B",
        "torch.distributed.pipelining schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, "
        "InterleavedZeroBubble, ZBVZeroBubble or DualPipeV (the last four hold several stages per rank)",
    )
    pipeline_parallel_schedule_csv: str = opt(
        "", "a CSV of per-rank actions to run instead of a built-in schedule ('' = none)"
    )
    pipeline_parallel_microbatch_size: int = opt(
        1, "samples per pipeline microbatch; it must divide training.local_batch_size", min=1
    )
    pipeline_parallel_layers_per_stage: int = opt(
        0,
        "blocks per stage (0 = as many stages as the schedule holds per rank x degree, blocks "
        "spread evenly); the embedding and the output head count as one layer each",
        min=0,
    )
    pipeline_parallel_first_stage_less_layers: int = opt(
        1, "the first stage holds this many fewer blocks (its embedding counts as this many)", min=0
    )
    pipeline_parallel_last_stage_less_layers: int = opt(
        1, "the last stage holds this many fewer blocks (its norm, head and loss count as this many)", min=0
    )
    module_fqns_per_model_part: list[list[str]] = opt(
        [],
        'the modules of each stage, e.g. [["tok_embeddings", "layers.0"], ["layers.1", "norm", '
        '"output"]] (on the command line: "tok_embeddings,layers.0;layers.1,norm,output"); '
        "overrides the automatic split",
    )
    expert_parallel_degree: int = opt(
        1,
        "expert parallel degree; its ranks come from data_parallel_shard_degree (and from the TP "
        "ranks when expert_tensor_parallel_degree is 1)",
        min=1,
    )
    expert_tensor_parallel_degree: int = opt(
        1,
        "under EP and TP: 1 = EP also borrows the TP ranks (experts whole), tensor_parallel_degree = "
        "each EP rank's experts sharded over TP; without EP, TP always shards the experts",
        min=1,
    )


@dataclass
class Metrics:
    log_freq: int = opt(10, "log metrics every this many steps", min=1)
    enable_tensorboard: bool = opt(False, "write TensorBoard scalars")
    save_tb_folder: str = opt("tb", "TensorBoard folder under dump_folder")
    enable_wandb: bool = opt(False, "log to Weights & Biases")
    disable_color_printing: bool = opt(
        False, "accepted for upstream torchtitan files; has no effect, as log lines have no colors"
    )
    save_for_all_ranks: bool = opt(
        False, "write metrics from every rank (metrics_rank<N>.jsonl), not only rank 0"
    )


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective", "memory_budget", "auto"] = opt(
        "selective",
        'activation checkpointing mode; "auto" chooses per block none, cheap regions, op-SAC (every '
        "second or every matmul recomputed) or full AC, with or without offload, to fit auto_memory_gib "
        "with the least modelled added time",
    )
    selective_ac_option: str = opt("2", '"op" for per-op selective AC, or N to checkpoint every Nth block')
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = opt(
        ["moe.router.gate", "feed_forward.w2", "moe.shared_experts.w2"],
        "substrings of the names of Linears inside the blocks whose matmuls op-SAC always recomputes "
        "(the defaults: MoE routers, and each block's last matmul, which with early_stop is then never "
        "recomputed at all)",
    )
    early_stop: bool = opt(
        True,
        "stop recompute once the needed activations are rebuilt (torch's default; upstream torchtitan's "
        "is false): a block's last matmul and residual add, and under TP its last reduce-scatter, "
        "are then never recomputed",
    )
    full_ac_all_to_all: Literal["reissue", "replay"] = opt(
        "reissue",
        "full AC of MoE blocks: re-issue the expert all-to-alls in recompute (least memory) "
        "or replay their saved outputs (least communication)",
    )
    preserve_rng_state: bool = opt(False, "replay RNG in recompute (needed with dropout)")
    determinism_check: Literal["default", "none"] = opt(
        "default",
        'recompute check: "default" compares each recomputed tensor\'s shape, dtype and device '
        'with the original\'s and raises on a mismatch; "none" skips the check',
    )
    debug: bool = opt(False, "on a recompute error, print the operators of the forward and the recompute")
    memory_budget: float = opt(
        0.5,
        "memory_budget mode: 0 = keep only each block's inputs, 1 = compile's default choice",
        min=0.0,
        max=1.0,
    )
    visualize_memory_budget_pareto: bool = opt(False, "dump the partitioner's pareto plot")
    offload: Literal["none", "saved"] = opt(
        "none",
        '"saved": what each chosen block keeps for backward (under mode none every saved tensor, '
        "under full AC the block's input, under op-SAC its input and saved op outputs) waits in "
        "host memory, copied out as it is made and back one block ahead of backward",
    )
    offload_blocks: str = opt("all", 'the blocks that offload: "all", or indices and ranges such as "0-3,8"')
    offload_min_bytes: int = opt(
        2**20,
        "offload only tensors of at least this many bytes (smaller copies cost more than they free)",
        min=0,
    )
    auto_memory_gib: float = opt(
        0.0,
        'mode "auto": the per-device memory the estimated step peak must fit, in GiB; 0 takes the '
        "device's memory less auto_headroom_gib (an accelerator's; on the CPU give a budget)",
        min=0.0,
    )
    auto_headroom_gib: float = opt(
        6.0,
        'mode "auto" with auto_memory_gib = 0: memory left out of the budget for what the estimate does '
        "not model (the allocator's caching and fragmentation, CUDA and NCCL contexts)",
        min=0.0,
    )
    auto_tflops: float = opt(
        0.0,
        'mode "auto": the math throughput of recompute, TFLOP/s, that prices its matmuls and attention; '
        "0 takes 40% of the device's bf16 peak (400 where it is unknown)",
        min=0.0,
    )
    auto_memory_gbps: float = opt(
        0.0,
        'mode "auto": the memory throughput, GB/s, that prices recomputed element-wise work (norms, '
        "activations, RoPE); 0 takes 70% of the device's peak bandwidth (2000 where it is unknown)",
        min=0.0,
    )
    auto_host_us_per_op: float = opt(
        20.0,
        'mode "auto": host time, microseconds, per op that AC makes the host dispatch (each recomputed '
        "op, and each op through op-SAC's Python dispatch mode, in forward and in recompute)",
        min=0.0,
    )
    auto_host_us_per_rerun: float = opt(
        250.0,
        'mode "auto": host time, microseconds, per checkpointed region rerun in backward',
        min=0.0,
    )
    auto_offload: bool = opt(
        True,
        'mode "auto": the planner may offload what a block keeps (op-SAC or full AC with offload = '
        '"saved") where copies run beside compute: on an accelerator, with eager blocks, not under a '
        "zero-bubble schedule",
    )
    auto_offload_gbps: float = opt(
        50.0,
        'mode "auto": the host-device bandwidth per direction, GB/s, that prices offload copies (about 80% '
        "of PCIe Gen5 x16's 64)",
        gt=0.0,
    )
    auto_plan: str = opt(
        "",
        'mode "auto": the per-block plan, e.g. "none:0-3; op:4-27; full:28-31" (each block once); empty: '
        "plan at startup (or take the dump folder's saved plan when the layout is unchanged)",
    )


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile the components below")
    components: list[str] = opt(["model", "loss"], "what to compile: model, loss")
    backend: str = opt("inductor", "torch.compile backend")
    capture_scalar_outputs: bool = opt(
        False, "let dynamo trace .item()/.tolist() (MoE split sizes): bigger graphs, fewer breaks"
    )


@dataclass
class Float8:
    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = opt(
        "tensorwise",
        "float8 scales: one per tensor, one per row, or per row with the weight gradient in high precision",
    )
    enable_fsdp_float8_all_gather: bool = opt(
        False, "FSDP all-gathers the weights in float8 (tensorwise only; needs an NCCL-like backend)"
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "after each optimizer step, compute every weight scale in one all-reduce (float8 all-gather)"
    )
    filter_fqns: list[str] = opt(
        ["output"],
        "Linear FQN substrings kept in high precision; 'auto_filter_small_kn' also keeps the layers "
        "torchao's size heuristic finds too small to gain",
    )
    emulate: bool = opt(False, "run the float8 matmuls emulated in high precision (GPUs without float8)")
    moe_fqns: list[str] = opt(
        [], "MoE modules whose grouped experts train in float8 (not built: refused with float8 on)"
    )


# What a checkpoint holds, each loadable or not (`checkpoint.exclude_from_loading`).
CHECKPOINT_STATE_KEYS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "save and resume distributed checkpoints")
    folder: str = opt("checkpoint", "checkpoint folder under dump_folder")
    interval: int = opt(500, "save every this many steps", min=1)
    keep_latest_k: int = opt(
        10, "keep this many newest checkpoints (and always the newest resumable one); 0 keeps all", min=0
    )
    load_step: int = opt(-1, "resume from this step; -1 = newest", min=-1)
    exclude_from_loading: list[str] = opt([], "state keys not to load on resume")
    last_save_model_only: bool = opt(True, "final save holds the model only")
    export_dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "float32", "dtype of the model-only final save"
    )
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = opt(
        "disabled", "asynchronous checkpoint saving"
    )
    enable_first_step_checkpoint: bool = opt(False, "save right after step 1")
    create_seed_checkpoint: bool = opt(False, "write initial weights and exit (one process)")
    load_only: bool = opt(
        False,
        "resume (or read initial_load_path) as usual but save nothing, and leave the checkpoint "
        "folder as it is: for evaluation and debugging runs",
    )
    initial_load_path: str | None = opt(None, "checkpoint to start from when the folder is empty")
    initial_load_model_only: bool = opt(
        True,
        "initial load reads model weights only; false reads it as a training checkpoint (optimizer, "
        "lr schedule, data position and step, less exclude_from_loading)",
    )
    initial_load_in_hf: bool = opt(False, "initial_load_path holds HF safetensors")
    last_save_in_hf: bool = opt(False, "final save as HF safetensors")
    verify_checksums: bool = opt(
        True,
        "before a load, check each file of a DCP checkpoint against the checksums its save wrote; a "
        "damaged file is refused, naming it and the newest intact step",
    )


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "record torch.profiler traces")
    save_traces_folder: str = opt("profile_traces", "trace folder under dump_folder")
    profile_freq: int = opt(10, "profile every this many steps", min=1)
    profiler_warmup: int = opt(3, "profiler warmup steps", min=0)
    profiler_active: int = opt(1, "profiler active steps", min=1)
    enable_memory_snapshot: bool = opt(False, "dump CUDA memory snapshots")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "snapshot folder under dump_folder")


@dataclass
class Comm:
    init_timeout_seconds: int = opt(300, "collective timeout until the first step ends", min=1)
    train_timeout_seconds: int = opt(100, "collective timeout after the first step", min=1)
    trace_buf_size: int = opt(20000, "NCCL flight recorder entries per rank (0: off)", min=0)
    save_traces_folder: str = opt(
        "comm_traces", "where each rank's flight recorder is dumped on a collective timeout (in dump_folder)"
    )
    save_traces_file_prefix: str = opt("rank_", "name of each rank's trace file, before the rank number")


@dataclass
class Validation:
    enable: bool = opt(False, "evaluate on a held-out split")
    dataset: str = opt(
        "smoke_validation", "validation dataset name: smoke_validation (bundled), or set dataset_path"
    )
    dataset_path: str | None = opt(None, "local validation file or folder, as training.dataset_path")
    local_batch_size: int = opt(8, "validation sequences per rank", min=1)
    seq_len: int = opt(2048, "validation tokens per sequence; at most training.seq_len", min=1)
    freq: int = opt(500, "validate after step 1, every this many steps, and after the last", min=1)
    steps: int = opt(-1, "validation batches per run (>= 1); -1 = every whole global batch of the split")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    metrics: Metrics = field(default_factory=Metrics)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    validation: Validation = field(default_factory=Validation)

    def to_dict(self) -> dict:
        """The config as nested plain dicts, as it would be written to TOML."""
        return dataclasses.asdict(self)


def section_types(schema: type = JobConfig) -> dict[str, type]:
    """Each `[section]` name and the dataclass that holds its keys, in `schema` (this trainer's
    `JobConfig`, or one that `job.custom_config_module` extends)."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def describe_type(tp) -> str:
    """A key's type as messages and `--help` say it ("one of 'sdpa', 'flex' or none")."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {describe_type(typing.get_args(tp)[0])}"
    return "none" if tp is type(None) else getattr(tp, "__name__", str(tp))


def model_compile_enabled(job_config: JobConfig) -> bool:
    """Whether the run compiles the model's blocks (`compile.enable` with "model" in components)."""
    return job_config.compile.enable and "model" in job_config.compile.components
