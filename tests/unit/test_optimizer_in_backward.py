"""`optimizer.early_step_in_backward`: each parameter steps inside backward and its gradient is
freed there. It trains exactly as stepping after backward, and its state is the usual one.

One process, fp32 on the CPU, the Llama 3 debug model cut to 2 blocks. (FSDP, which calls the
hooks on the sharded parameters: tests/integration/test_optimizer_in_backward.py.)
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from tests.model_testing import init_on_cpu
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.optimizer import OptimizerInBackward, build_optimizer, check_early_step_in_backward
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.distributed.grad_norm import clip_grad_norm_
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import get_train_spec

CPU = torch.device("cpu")
STEPS = 4
BASE = ["--activation_checkpoint.mode", "none", "--training.max_norm", "0", "--training.seq_len", "32",
        "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "2"]  # fmt: skip
EARLY = ["--optimizer.early_step_in_backward"]


def _config(argv=()):
    return parse_args(["--config", "debug_model.toml", *BASE, *argv], env={})


def _model() -> torch.nn.Module:
    cfg = _config()
    spec = get_train_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(replace(spec.flavors[cfg.model.flavor], n_layers=2))
    spec.parallelize_fn(model, ParallelDims(1, 1, 1, 1), cfg, CPU)
    return init_on_cpu(model)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(step))


def _backward(model: torch.nn.Module, step: int) -> None:
    tokens = _batch(step)
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()


def _train(model, optimizer, steps=range(STEPS), scheduler=None) -> list[float]:
    """Grad norms of `steps` steps on the lr schedule (a new one by default), stepping the
    usual way or inside backward."""
    scheduler = scheduler or build_lr_scheduler(optimizer, _config())
    norms = []
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        _backward(model, step)
        if isinstance(optimizer, OptimizerInBackward):
            norms.append(optimizer.grad_norm().item())
        else:
            norms.append(clip_grad_norm_(model.parameters(), 0.0).item())
            optimizer.step()
        scheduler.step()
    return norms


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_stepping_in_backward_trains_bit_for_bit_like_stepping_after_backward():
    after, during = _model(), _model()
    norms_after = _train(after, build_optimizer(after, _config(), CPU))
    norms_during = _train(during, build_optimizer(during, _config(EARLY), CPU))
    assert norms_during == norms_after
    for got, want in zip(_weights(during), _weights(after)):
        assert torch.equal(got, want)


def test_each_gradient_is_freed_as_soon_as_its_parameter_steps():
    model = _model()
    optimizer = build_optimizer(model, _config(EARLY), CPU)
    params = list(model.parameters())
    live = []
    for p in params:  # registered after the optimizer's hooks, so they run after them
        p.register_post_accumulate_grad_hook(lambda _: live.append(sum(q.grad is not None for q in params)))
    _backward(model, 0)
    assert len(live) == len(params)
    assert max(live) == 0
    assert optimizer.grad_norm().item() > 0


def test_its_state_dict_has_the_usual_optimizers_keys_and_values():
    after, during = _model(), _model()
    plain, early = build_optimizer(after, _config(), CPU), build_optimizer(during, _config(EARLY), CPU)
    _train(after, plain), _train(during, early)
    want, got = plain.state_dict(), early.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, moments in want["state"].items():
        for name, value in moments.items():
            assert torch.equal(got["state"][index][name], value), (index, name)


@pytest.mark.parametrize("saved_early", [False, True], ids=["usual_into_early", "early_into_usual"])
def test_a_state_saved_one_way_resumes_the_other_way(saved_early):
    """As the trainer resumes: weights, then the optimizer's state (whose param groups hold the
    lr of the next step), then the scheduler's."""
    reference = _model()
    _train(reference, build_optimizer(reference, _config(), CPU))
    first, second = (_config(EARLY), _config()) if saved_early else (_config(), _config(EARLY))
    model = _model()
    saved = build_optimizer(model, first, CPU)
    saved_scheduler = build_lr_scheduler(saved, first)
    _train(model, saved, range(2), saved_scheduler)
    resumed_model = _model()
    resumed_model.load_state_dict(model.state_dict())
    resumed = build_optimizer(resumed_model, second, CPU)
    scheduler = build_lr_scheduler(resumed, second)
    resumed.load_state_dict(saved.state_dict())
    scheduler.load_state_dict(saved_scheduler.state_dict())
    _train(resumed_model, resumed, range(2, STEPS), scheduler)
    for got, want in zip(_weights(resumed_model), _weights(reference)):
        assert torch.equal(got, want)


def test_distributed_state_dict_keys_match_the_usual_optimizers():
    after, during = _model(), _model()
    plain, early = build_optimizer(after, _config(), CPU), build_optimizer(during, _config(EARLY), CPU)
    # Before any step: DCP creates the state with a zero-gradient step of its own.
    want, got = get_optimizer_state_dict(after, plain), get_optimizer_state_dict(during, early)
    assert got["state"].keys() == want["state"].keys() and len(got["state"]) == len(list(during.parameters()))
    assert got["param_groups"] == want["param_groups"]
    for fqn in want["state"]:
        assert torch.equal(got["state"][fqn]["exp_avg_sq"], want["state"][fqn]["exp_avg_sq"])
    for got_p, want_p in zip(_weights(during), _weights(after)):
        assert torch.equal(got_p, want_p)


def test_gradient_clipping_with_early_step_is_refused_naming_the_fix():
    with pytest.raises(ConfigError) as info:
        _config([*EARLY, "--training.max_norm", "1.0"])
    assert "'training.max_norm' = 1.0" in str(info.value) and "set training.max_norm = 0" in str(info.value)


def test_gradient_accumulation_with_early_step_is_refused_naming_the_fix():
    cfg = _config([*EARLY, "--training.global_batch_size", "16"])
    with pytest.raises(ConfigError) as info:
        check_early_step_in_backward(cfg, ParallelDims(1, 1, 1, 1), accum_steps=2)
    assert "accumulates 2 micro-batches" in str(info.value) and "global_batch_size = -1" in str(info.value)


def test_ddp_with_early_step_is_refused_naming_the_fix():
    with pytest.raises(ConfigError) as info:
        check_early_step_in_backward(_config(EARLY), ParallelDims(2, 1, 1, 2), accum_steps=1)
    assert "DDP" in str(info.value) and "data_parallel_shard_degree > 1" in str(info.value)


def test_fsdp_and_hsdp_are_accepted_with_early_step():
    for dims in (ParallelDims(1, 2, 1, 2), ParallelDims(2, 2, 1, 4)):
        check_early_step_in_backward(_config(EARLY), dims, accum_steps=1)
