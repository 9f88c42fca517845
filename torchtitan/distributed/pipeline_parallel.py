"""Pipeline parallelism on `torch.distributed.pipelining`: the split of a decoder into stages,
the stages this rank holds, and the schedule that runs them.

A decoder is split by module name: the embedding, the blocks (`layers.N`), and the final norm
with the output head. Every model family shares `split_module_names`; a stage is a pruned
copy of the meta model (`prune_to_stage`), so each rank materializes only its own stages.
"""

import copy
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _PipelineScheduleRuntime,
    get_schedule_class,
)

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.context_parallel import ContextParallel, sharded_or_whole
from torchtitan.distributed.tensor_helpers import plain_tensor

KEY = "parallelism.pipeline_parallel_schedule"
EMBEDDING, HEAD = ["tok_embeddings"], ["norm", "output"]
SPLIT_BACKWARD_SCHEDULES = (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)
# A CSV action computing input (I) or weight (W) gradients alone, e.g. "3I1", "0W2".
SPLIT_ACTION = re.compile(r"\b\d+[IW]\d+\b")


def schedule_class(name: str) -> type:
    """The torch schedule named `name` (case-insensitive).

    Raises:
        ConfigError: for a name torch does not provide.
    """
    try:
        return get_schedule_class(name)
    except ValueError:
        choices = "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV"
        raise ConfigError(f"'{KEY}' = '{name}' is not a schedule; use one of {choices}.") from None


def is_v_schedule(cls: type) -> bool:
    """Whether `cls` places a rank's two stages at both ends of a V (rank r: r and 2pp-1-r)."""
    return issubclass(cls, (ScheduleZBVZeroBubble, ScheduleDualPipeV))


def splits_backward(job_config: JobConfig) -> bool:
    """Whether the run's pipeline schedule computes a stage's input and weight gradients in two
    backward passes: the zero-bubble schedules, and a CSV schedule with input (I) or weight (W)
    actions."""
    p = job_config.parallelism
    if p.pipeline_parallel_degree == 1:
        return False
    if p.pipeline_parallel_schedule_csv:
        return bool(SPLIT_ACTION.search(read_schedule_csv(p.pipeline_parallel_schedule_csv)))
    return issubclass(schedule_class(p.pipeline_parallel_schedule), SPLIT_BACKWARD_SCHEDULES)


def read_schedule_csv(path: str) -> str:
    """The text of `parallelism.pipeline_parallel_schedule_csv`.

    Raises:
        ConfigError: when the file cannot be read.
    """
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ConfigError(
            f"'parallelism.pipeline_parallel_schedule_csv' = '{path}' cannot be read ({e.strerror or e}); "
            "give the path of a CSV of per-rank actions, or '' for the built-in schedule."
        ) from None


def split_module_names(
    n_layers: int, num_stages: int, first_stage_less_layers: int, last_stage_less_layers: int
) -> list[list[str]]:
    """The module names of each of `num_stages` stages, blocks spread as evenly as possible.

    The embedding counts as `first_stage_less_layers` blocks and the norm with the head as
    `last_stage_less_layers`, so the first and last stages hold that many fewer blocks. A
    remainder goes to the middle stages first.

    Raises:
        ConfigError: when a stage would hold nothing at all.
    """
    units = n_layers + first_stage_less_layers + last_stage_less_layers
    base, extra = divmod(units, num_stages)
    middle_first = list(range(1, num_stages - 1)) + [0, num_stages - 1]
    sizes = [base] * num_stages
    for stage in middle_first[:extra]:
        sizes[stage] += 1
    sizes[0] -= first_stage_less_layers
    sizes[-1] -= last_stage_less_layers
    if min(sizes) < 0 or (num_stages > 1 and min(sizes[1:-1], default=1) < 1):
        raise ConfigError(
            f"{n_layers} blocks cannot fill {num_stages} pipeline stages (the embedding counting as "
            f"{first_stage_less_layers} and the head as {last_stage_less_layers}): a stage would hold no "
            "block; use fewer stages (parallelism.pipeline_parallel_layers_per_stage, _degree) or "
            "lower pipeline_parallel_first/last_stage_less_layers."
        )
    names, layer = [], 0
    for stage, size in enumerate(sizes):
        blocks = [f"layers.{i}" for i in range(layer, layer + size)]
        layer += size
        names.append((EMBEDDING if stage == 0 else []) + blocks + (HEAD if stage == num_stages - 1 else []))
    return names


@dataclass(frozen=True)
class PipelinePlan:
    """Which modules each stage holds and which stages this rank runs.

    Built from `[parallelism]` by `PipelinePlan.from_config`; every rank builds the same plan.
    """

    schedule: type
    modules_per_stage: list[list[str]]
    stage_ids: tuple[int, ...]  # this rank's stages, in the order the schedule takes them
    n_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.modules_per_stage)

    @property
    def single_stage(self) -> bool:
        return issubclass(self.schedule, PipelineScheduleSingle)

    @classmethod
    def from_config(cls, job_config: JobConfig, n_layers: int, pp: int, pp_rank: int) -> "PipelinePlan":
        """The plan of rank `pp_rank` of `pp` for a model of `n_layers` blocks.

        Raises:
            ConfigError: naming the key to change, for a schedule torch does not have, a
                microbatch size that does not divide the local batch, stage counts the schedule
                cannot run, a stage with nothing in it, or module names that do not cover the
                model exactly once.
        """
        p = job_config.parallelism
        cls_ = schedule_class(p.pipeline_parallel_schedule)
        single = issubclass(cls_, PipelineScheduleSingle)
        if p.pipeline_parallel_schedule_csv:
            read_schedule_csv(p.pipeline_parallel_schedule_csv)
            cls_ = _PipelineScheduleRuntime
        modules = cls._modules_per_stage(p, n_layers, pp, single)
        num_stages = len(modules)
        _check_stage_count(p.pipeline_parallel_schedule, cls_, single, num_stages, pp)
        if is_v_schedule(cls_):
            stage_ids = (pp_rank, 2 * pp - 1 - pp_rank)
        else:
            stage_ids = tuple(range(pp_rank, num_stages, pp))
        return cls(cls_, modules, stage_ids, _microbatches(job_config))

    @staticmethod
    def _modules_per_stage(p, n_layers: int, pp: int, single: bool) -> list[list[str]]:
        if p.module_fqns_per_model_part:
            return _checked_module_names(p.module_fqns_per_model_part, n_layers)
        first, last = p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers
        if p.pipeline_parallel_layers_per_stage:
            units = n_layers + first + last
            num_stages = math.ceil(units / p.pipeline_parallel_layers_per_stage)
        else:
            num_stages = pp if single else 2 * pp
        return split_module_names(n_layers, num_stages, first, last)

    def build_stage_models(self, whole: nn.Module) -> list[nn.Module]:
        """One pruned deep copy of `whole` (on the meta device) per stage of this rank."""
        return [prune_to_stage(copy.deepcopy(whole), self.modules_per_stage[s]) for s in self.stage_ids]


def _check_stage_count(name: str, cls_: type, single: bool, num_stages: int, pp: int) -> None:
    per_rank, rest = divmod(num_stages, pp)
    if rest:
        raise ConfigError(
            f"{num_stages} pipeline stages do not divide over parallelism.pipeline_parallel_degree {pp}; "
            "choose parallelism.pipeline_parallel_layers_per_stage (or module_fqns_per_model_part) so "
            "that the number of stages is a multiple of the degree."
        )
    if single and per_rank != 1:
        raise ConfigError(
            f"'{KEY}' = '{name}' runs one stage per rank, but the split makes {per_rank}; use a "
            "multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, "
            "DualPipeV) or make as many stages as pipeline_parallel_degree."
        )
    if not single and per_rank < 2:
        raise ConfigError(
            f"'{KEY}' = '{name}' runs several stages per rank, but the split makes {per_rank}; lower "
            "parallelism.pipeline_parallel_layers_per_stage, or use 1F1B or GPipe."
        )
    if is_v_schedule(cls_) and per_rank != 2:
        raise ConfigError(
            f"'{KEY}' = '{name}' is a V schedule and needs exactly 2 stages per rank, but the split "
            f"makes {per_rank}; set parallelism.pipeline_parallel_layers_per_stage so that there are "
            f"{2 * pp} stages."
        )


def _microbatches(job_config: JobConfig) -> int:
    local = job_config.training.local_batch_size
    size = job_config.parallelism.pipeline_parallel_microbatch_size
    if local % size:
        raise ConfigError(
            f"'parallelism.pipeline_parallel_microbatch_size' = {size} does not divide "
            f"'training.local_batch_size' = {local}; choose a divisor of the local batch."
        )
    return local // size


def _checked_module_names(parts: list[list[str]], n_layers: int) -> list[list[str]]:
    known = EMBEDDING + [f"layers.{i}" for i in range(n_layers)] + HEAD
    named = [name for part in parts for name in part]
    problems = [f"'{n}' is not a module of the model" for n in named if n not in known]
    problems += [f"'{n}' is in more than one stage" for n in set(named) if named.count(n) > 1]
    problems += [f"'{n}' is in no stage" for n in known if n not in named]
    problems += [f"stage {i} is empty" for i, part in enumerate(parts) if not part]
    if problems:
        raise ConfigError(
            f"'parallelism.module_fqns_per_model_part': {'; '.join(problems)}; list each of "
            f"tok_embeddings, layers.0 ... layers.{n_layers - 1}, norm and output in exactly one stage."
        )
    return [list(part) for part in parts]


def prune_to_stage(model: nn.Module, module_names: list[str]) -> nn.Module:
    """Remove from `model`, in place, every part not in `module_names`: blocks are deleted from
    `model.layers` (the others keep their index as key), other top-level modules set to None.

    The model's forward then runs just its stage (see the models' `forward`). Returns `model`.
    """
    keep = set(module_names)
    for name, child in list(model.named_children()):
        if name == "layers":
            for key in list(child.keys()):
                if f"layers.{key}" not in keep:
                    del child[key]
        elif name not in keep:
            setattr(model, name, None)
    return model


def merged_model(stage_models: list[nn.Module]) -> nn.Module:
    """One module over this rank's stages, with the whole model's parameter names: what the
    optimizer, the checkpoint and the grad norm see. It holds the stages' own modules (shared,
    not copied) and is never run; the schedule runs the stages."""
    merged = nn.Module()
    merged.layers = nn.ModuleDict()
    for part in stage_models:
        for name, child in part.named_children():
            if name == "layers":
                merged.layers.update(child)
            elif child is not None:
                merged.add_module(name, child)
    return merged


class Pipeline:
    """This rank's stages and the schedule that runs one batch through all stages.

    Args:
        plan: the split (`PipelinePlan`).
        stage_models: this rank's parallelized stage modules, in `plan.stage_ids` order.
        loss_fn: the `ChunkedLoss` with which the last stage's model computes each
            microbatch's loss in its forward (so that a chunked head never holds the whole
            logits); the schedule divides that loss by `scale` (microbatches x accumulation
            steps) so that the gradients are the mean's.
        pp_group: the process group of the pipeline's ranks.
        csv_path: a schedule CSV (`parallelism.pipeline_parallel_schedule_csv`), or "".
        stage_io: per stage, an example (input, output) of one microbatch. Given, the stages
            take their shapes from it and never exchange them with their peers, which is what
            a single process simulating one rank (the memory estimator) needs. Left out, torch
            infers the shapes at the first step by running each stage once.
        context_parallel: the run's `ContextParallel`, or None. Each batch, training and
            validation alike, runs as this rank's share of its sequences: the stages' shapes
            are fixed at the first step.
    """

    def __init__(self, plan: PipelinePlan, stage_models, loss_fn: Callable, pp_group, device,
                 scale: int, csv_path: str = "", stage_io: list[tuple] | None = None,
                 context_parallel: ContextParallel | None = None):  # fmt: skip
        self.plan, self.scale, self.pp_group = plan, scale, pp_group
        self.context_parallel = context_parallel
        io = stage_io or [(None, None)] * len(stage_models)
        self.stages = [
            PipelineStage(
                model,
                stage_id,
                plan.num_stages,
                device,
                input_args=inputs,
                output_args=outputs,
                group=pp_group,
            )  # fmt: skip
            for model, stage_id, (inputs, outputs) in zip(stage_models, plan.stage_ids, io)
        ]
        if stage_io is None:  # torch's shape inference runs a forward that must leave no trace
            for model in stage_models:
                _undo_buffer_changes_of_first_forward(model)
        self.has_first_stage = 0 in plan.stage_ids
        self.has_last_stage = plan.num_stages - 1 in plan.stage_ids
        self.loss_fn = loss_fn
        scaled = lambda loss, _labels: loss / scale  # noqa: E731
        stages = self.stages[0] if plan.single_stage and not csv_path else self.stages
        try:
            self.schedule = plan.schedule(stages, n_microbatches=plan.n_microbatches, loss_fn=scaled,
                                          scale_grads=False)  # fmt: skip
        except ValueError as e:  # torch's own rules, e.g. too few microbatches for the stages
            name, reason = plan.schedule.__name__.removeprefix("Schedule"), str(e).rstrip(".")
            raise ConfigError(
                f"{KEY} '{name}' with {plan.n_microbatches} microbatches (training.local_batch_size / "
                f"parallelism.pipeline_parallel_microbatch_size) and {plan.num_stages} stages: {reason}; "
                "change the microbatch count or the schedule."
            ) from None
        if csv_path:
            self.schedule._load_csv(csv_path)
        if stage_io is not None:
            self.schedule._warmup_p2p = _use_given_shapes

    def _run(self, run, inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """`run` (the schedule's `step` or `eval`) on one batch: the first stage takes the inputs,
        the last the labels; returns the last stage's microbatch losses ([] elsewhere)."""
        losses: list[torch.Tensor] = []
        with sharded_or_whole(self.context_parallel, inputs, labels) as (inputs, labels):
            # The last stage's forward computes the loss: it takes each microbatch's labels, and
            # the ChunkedLoss, as keyword arguments, which the schedule hands to every stage.
            loss_kwargs = {"labels": labels, "loss": self.loss_fn} if self.has_last_stage else {}
            target = labels if self.has_last_stage else None
            # The last stage would otherwise keep every microbatch's loss output until the end.
            run(*((inputs,) if self.has_first_stage else ()), target=target, losses=losses,
                return_outputs=False, **loss_kwargs)  # fmt: skip
        return losses

    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean loss of one batch, forward only, on every rank of the pipeline (the last
        stage computes it; the others receive it)."""
        losses = self._run(self.schedule.eval, inputs, labels)
        # The schedule's loss is divided by `scale`; the batch's mean is over its microbatches.
        total = torch.stack([plain_tensor(loss) for loss in losses]).sum() if losses else None
        loss = (
            total * self.scale / self.plan.n_microbatches if losses else torch.zeros((), device=inputs.device)
        )
        dist.all_reduce(loss, group=self.pp_group)
        return loss

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch through every stage; returns this batch's scaled
        loss on the last stage (a zero elsewhere), detached."""
        losses = self._run(self.schedule.step, inputs, labels)
        if not losses:
            return torch.zeros((), device=inputs.device)
        return torch.stack([plain_tensor(loss.detach()) for loss in losses]).sum()


def _use_given_shapes(stages, has_backward: bool, p2p_done: bool) -> None:
    """Stands in for the schedule's first-step vote, in which the stages agree, by messages to
    their peers, whether every one was given its shapes: here each one was, and no peer answers."""
    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


def _undo_buffer_changes_of_first_forward(model: nn.Module) -> None:
    """Put `model`'s buffers back, after its first forward, to what they were before it.

    Why: at the first step torch's stage infers the shapes it will send by running one forward
    and backward of the stage, on the first microbatch at the first stage and on uninitialized
    tensors elsewhere. A forward that updates buffers (an MoE layer counting the tokens per
    expert for load balancing) would count that run too, and the balancing would differ from
    one process's. The buffers are copied when that forward starts, after any checkpoint load,
    and put back when the next one starts: right after the first, its backward, still to run,
    may read them.
    """
    saved: dict[str, torch.Tensor] = {}
    calls = []

    def around_the_first(module, _args):
        calls.append(None)
        if len(calls) == 1:
            saved.update({name: buffer.clone() for name, buffer in module.named_buffers()})
            return
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                buffer.copy_(saved[name])
        saved.clear()
        handle.remove()

    handle = model.register_forward_pre_hook(around_the_first)


def check_pipeline_supported(job_config: JobConfig, model_args, ddp: bool) -> None:
    """Refuse what pipeline parallelism does not run with yet.

    Raises:
        ConfigError: naming the key to change.
    """
    pp = job_config.parallelism.pipeline_parallel_degree
    moe_args = getattr(model_args, "moe_args", None)
    refusals = [
        (model_args.tie_word_embeddings, "a flavor that ties its embeddings (the first and last stages "
         "would share a weight)", "choose a flavor without tied embeddings"),
        (model_args.attn_backend == "flex", "the flex attention backend (its masks are built from the "
         "token ids, which only the first stage has)", "set model.attn_backend = 'sdpa'"),
        (moe_args is not None and moe_args.seq_aux_loss_coeff > 0, "a sequence-level MoE balance loss "
         "(each stage's would be left out of backward)", "use a flavor with seq_aux_loss_coeff = 0"),
        (ddp, "DDP (data_parallel_replicate_degree > 1 with data_parallel_shard_degree 1)",
         "shard instead: set data_parallel_shard_degree"),
        (splits_backward(job_config) and job_config.parallelism.fsdp_reshard_after_forward == "always"
         and job_config.parallelism.data_parallel_shard_degree != 1,
         f"{KEY} '{job_config.parallelism.pipeline_parallel_schedule}' (a split backward) with "
         "parallelism.fsdp_reshard_after_forward = 'always' (FSDP frees the weights that the weight-gradient "
         "pass still reads: wrong gradients)", "set fsdp_reshard_after_forward = 'default' (never under PP)"),
        (job_config.optimizer.early_step_in_backward, "optimizer.early_step_in_backward",
         "set optimizer.early_step_in_backward = false"),
    ]  # fmt: skip
    for refused, what, fix in refusals:
        if refused:
            raise ConfigError(
                f"parallelism.pipeline_parallel_degree = {pp} does not run with {what} yet; {fix}, "
                "or set pipeline_parallel_degree = 1."
            )


def build_stages(whole: nn.Module, job_config: JobConfig, model_args, parallel_dims, parallelize: Callable):
    """Split `whole` (a meta model) into this rank's stages and `parallelize` each one.

    Returns (the `PipelinePlan`, the parallelized stage modules in `plan.stage_ids` order).

    Raises:
        ConfigError: for a pipeline layout that cannot work (see `PipelinePlan.from_config`)
            or a feature that does not run with it yet (`check_pipeline_supported`).
    """
    check_pipeline_supported(job_config, model_args, parallel_dims.ddp_enabled)
    plan = PipelinePlan.from_config(
        job_config, model_args.n_layers, parallel_dims.pp, parallel_dims.pp_rank()
    )
    return plan, [parallelize(part) for part in plan.build_stage_models(whole)]


def largest_over_stages(metrics: dict[str, float], pp_group) -> dict[str, float]:
    """The largest value of each of the model's step metrics over the pipeline's ranks.

    A model's step metrics are worst-over-layers figures (an MoE model's load imbalance), and
    each stage measures its own layers; a stage with none of the layers (DeepSeek-V3's dense
    first blocks) has none of the keys. Called on log steps only: it waits for every rank.
    """
    stages: list[dict[str, float]] = [{} for _ in range(dist.get_world_size(pp_group))]
    dist.all_gather_object(stages, metrics, group=pp_group)
    merged: dict[str, float] = {}
    for stage in stages:
        for name, value in stage.items():
            merged[name] = max(value, merged.get(name, value))
    return merged


def describe_pipeline(plan: PipelinePlan, pp_rank: int) -> str:
    """The startup log line: the schedule, the microbatches, and this rank's stages with their
    modules, e.g. "Pipeline: Schedule1F1B, 4 microbatches, 2 stages; rank 0 runs stage 0
    (tok_embeddings, layers.0-2)"."""
    held = "; ".join(f"stage {s} ({_compact(plan.modules_per_stage[s])})" for s in plan.stage_ids)
    return (
        f"Pipeline: {plan.schedule.__name__}, {plan.n_microbatches} microbatches, {plan.num_stages} "
        f"stages; pipeline rank {pp_rank} runs {held}"
    )


def _compact(names: list[str]) -> str:
    blocks = [int(n.split(".")[1]) for n in names if n.startswith("layers.")]
    others = [n for n in names if not n.startswith("layers.")]
    span = []
    if blocks:
        span = [f"layers.{blocks[0]}" + (f"-{blocks[-1]}" if len(blocks) > 1 else "")]
    head = [n for n in others if n in EMBEDDING] + span + [n for n in others if n not in EMBEDDING]
    return ", ".join(head)
