"""Check a run before any of its processes starts: the config, and the layout on N ranks.

    python -m torchtitan.preflight [--errors-only] [--world-size N] [the trainer's arguments]

First the config is parsed and validated, as `torchtitan.config.check` does. With
`--world-size N`, the model is then built as every rank of an N-rank run builds it: on the
meta device, in a fake process group of N ranks in this one process, through the model's own
converters and `parallelize_fn` (TP, EP, AC, compile, FSDP). So every refusal that needs only
the config, the world size and this torch (degrees that do not fit, a batch that does not
divide, a TP degree that does not divide the heads, AC with compiled TP on a torch that cannot
run it) comes here, once, as one line and exit code 2, instead of once per rank under torchrun.
Nothing is allocated and no weight is initialized; it takes a few seconds, most of them
importing torch.

Not checked here: what only a rank can see (its data files, the tokenizer, a checkpoint).

`--errors-only` hides the config's warnings and the closing line, as the launchers want: rank 0
logs the same warnings when training starts.
"""

import contextlib
import dataclasses
import logging
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.components.ac_auto import planned_choices, with_rates_of
from torchtitan.components.model_converter import build_model_converters
from torchtitan.components.optimizer import check_early_step_in_backward
from torchtitan.components.training_step import gradient_accumulation_steps
from torchtitan.config import check
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import wants_help
from torchtitan.distributed.activation_checkpoint import auto_budget, fixed_mode
from torchtitan.distributed.context_parallel import check_context_parallel
from torchtitan.distributed.device import device_type
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import Pipeline, PipelinePlan, build_stages, merged_model
from torchtitan.models import get_train_spec
from torchtitan.protocols.train_spec import import_custom_module
from torchtitan.tools.dtypes import TORCH_DTYPES

USAGE = "usage: python -m torchtitan.preflight [--errors-only] [--world-size N] [the trainer's arguments]"


class _KeptWorld:
    """The fake world `reusing_fake_worlds` keeps up between `fake_world` blocks."""

    reusing = False
    key: tuple[int, int] | None = None


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A fake process group of `world_size` ranks in this process, as `rank`; destroyed on exit,
    unless inside `reusing_fake_worlds`.

    Pitfall: the process must not be in a process group already (other than one this function
    keeps under `reusing_fake_worlds`)."""
    if not _KeptWorld.reusing:
        _start_world(world_size, rank)
        try:
            yield
        finally:
            _end_world()
        return
    if _KeptWorld.key != (world_size, rank):
        if _KeptWorld.key is not None:
            _end_world()
        _KeptWorld.key = None
        _start_world(world_size, rank)
        _KeptWorld.key = (world_size, rank)
    yield


@contextlib.contextmanager
def reusing_fake_worlds():
    """Within it, `fake_world` leaves its world up when its block ends; a later `fake_world` of
    the same size and rank runs in it again, and one of another size or rank replaces it. The
    kept world ends with this block.

    Why: DTensor caches its sharding decisions by mesh layout. In one world they stay valid, so
    a later estimate of the same layout skips making them. For Llama 3 70B on 64 ranks, making
    them took 23 s of a 69 s first estimate under cProfile, 15 s of that for the optimizer's
    fused update over every parameter."""
    _KeptWorld.reusing = True
    try:
        yield
    finally:
        _KeptWorld.reusing = False
        if _KeptWorld.key is not None:
            _KeptWorld.key = None
            _end_world()


def _start_world(world_size: int, rank: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def _end_world() -> None:
    dist.destroy_process_group()
    _forget_sharding_of_meshes_gone()


def _forget_sharding_of_meshes_gone() -> None:
    """Empty DTensor's cache of sharding decisions. Its keys compare meshes by their layout, not
    by their process groups: a later world of the same layout would get the specs of this one,
    with meshes whose groups are destroyed ("Could not resolve the process group")."""
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


def build_meta_model(cfg: JobConfig, parallel_dims: ParallelDims, device: torch.device):
    """The spec's model in `training.dtype` on the meta device, with the run's converters
    applied; returns (its model args, the model)."""
    spec = get_train_spec(cfg.model.name)
    model_args = spec.get_flavor(cfg.model.flavor).update_from_config(cfg)
    if parallel_dims.cp_enabled:
        check_context_parallel(cfg, model_args, parallel_dims)
    model = spec.build_meta_model(model_args, TORCH_DTYPES[cfg.training.dtype])
    build_model_converters(cfg, parallel_dims, device).convert(model)
    return model_args, model


def build_pipeline_stages(
    cfg: JobConfig, parallel_dims: ParallelDims, device: torch.device, **options
) -> tuple[PipelinePlan, list[nn.Module]]:
    """This rank's pipeline stages, built as `build_parallelized_model` builds a model; returns
    (the `PipelinePlan`, the parallelized stage modules in `plan.stage_ids` order)."""
    spec = get_train_spec(cfg.model.name)
    model_args, model = build_meta_model(cfg, parallel_dims, device)
    parallelize = lambda part: spec.parallelize_fn(part, parallel_dims, cfg, device, **options)  # noqa: E731
    return build_stages(model, cfg, model_args, parallel_dims, parallelize)


def build_parallelized_model(
    cfg: JobConfig, parallel_dims: ParallelDims, device: torch.device, **options
) -> nn.Module:
    """The spec's model built in `training.dtype` on the meta device, converted and parallelized
    as the trainer builds it; no storage, no initialized weights. `options` go to the model's
    `parallelize_fn` (see `parallelize_decoder`). Under pipeline parallelism: this rank's
    stages, under one module (`merged_model`)."""
    if not parallel_dims.pp_enabled:
        _, model = build_meta_model(cfg, parallel_dims, device)
        return get_train_spec(cfg.model.name).parallelize_fn(model, parallel_dims, cfg, device, **options)
    # The split itself, checked here, is the same on every rank.
    plan, stages = build_pipeline_stages(cfg, parallel_dims, device, **options)
    # The schedule checks its microbatch count against the stages when it is built.
    Pipeline(
        plan, stages, loss_fn=None, pp_group=parallel_dims.submesh("pp").get_group(), device=device, scale=1
    )
    return merged_model(stages)


def check_layout(cfg: JobConfig, world_size: int, device: torch.device | None = None) -> None:
    """Build the run's model for `world_size` ranks as they would (see the module's docstring).

    Raises:
        ConfigError: the first refusal a rank would raise while building.
    """
    device = device or torch.device(device_type())
    import_custom_module(cfg.job.custom_import)
    with fake_world(world_size):
        parallel_dims = ParallelDims.from_config(cfg.parallelism, world_size)
        accum_steps = gradient_accumulation_steps(cfg, parallel_dims.dp_degree)
        check_early_step_in_backward(cfg, parallel_dims, accum_steps)
        parallel_dims.build_mesh(device.type)
        for candidate in _as_built(cfg, device):
            build_parallelized_model(candidate, parallel_dims, device)


def _as_built(cfg: JobConfig, device: torch.device) -> list[JobConfig]:
    """The configs the ranks may build: mode "auto" without a plan is planned at startup, so
    each choice that wraps a block and that the layout plans with is checked, on every block."""
    ac = cfg.activation_checkpoint
    if ac.mode != "auto" or ac.auto_plan.strip():
        return [cfg]
    if device.type == "cpu":
        auto_budget(ac, capacity=None)  # the CPU has no memory size to plan within
    wrapping = [choice for choice in planned_choices(with_rates_of(cfg, device)) if choice != "none"]
    return [dataclasses.replace(cfg, activation_checkpoint=fixed_mode(ac, choice)) for choice in wrapping]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    errors_only = argv[:1] == ["--errors-only"]
    rest = argv[1:] if errors_only else argv
    if rest[:1] != ["--world-size"]:
        return check.main(argv)
    if len(rest) < 2 or not rest[1].isdecimal() or int(rest[1]) < 1:
        print(f"error: --world-size takes a positive number of ranks.\n{USAGE}", file=sys.stderr)
        return 2
    world_size, rest = int(rest[1]), rest[2:]
    if wants_help(rest):
        return check.main(["--errors-only", *rest] if errors_only else rest)
    try:
        config = check.checked_config(rest, errors_only)
        quiet = logging.getLogger("torchtitan")
        level = quiet.level
        if errors_only:
            quiet.setLevel(logging.ERROR)
        try:
            check_layout(config, world_size)
        finally:
            quiet.setLevel(level)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not errors_only:
        m = config.model
        print(
            f"preflight OK: {m.name} {m.flavor}, {config.training.steps} steps on {world_size} ranks",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
