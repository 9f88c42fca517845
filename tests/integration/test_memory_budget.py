"""memory_budget AC: torch.compile's min-cut partitioner chooses what each compiled block saves
for backward within `activation_checkpoint.memory_budget`. A lower budget saves fewer bytes;
no budget changes the loss or the gradients.

One process, fp32 on the CPU. The default tests compile with backend aot_eager_decomp_partition,
inductor's partitioner without inductor's code generation (seconds per compile instead of most
of a minute); `full_matrix` repeats the check with inductor. The partitioner counts a block's
weights among what it may save, so the activations must outweigh them for a budget between 0
and 1 to change anything: seq_len 512 x batch 4 on the debug models' dim 256 (at seq_len 64
every such budget saves what 1.0 saves).
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.model_testing import init_on_cpu
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import get_train_spec
from torchtitan.models.moe import pop_aux_loss
from torchtitan.tools.activation_memory import bytes_saved_for_backward

pytestmark = pytest.mark.integration

STEPS, SEQ_LEN, BATCH = 3, 512, 4
FAST_BACKEND = "aot_eager_decomp_partition"
CONFIGS = {"llama3": "debug_model.toml", "qwen3 moe": "qwen3_debug_model_moe.toml"}


def _build(model: str, argv: list[str]) -> torch.nn.Module:
    cfg = parse_args(["--config", CONFIGS[model], "--training.seq_len", str(SEQ_LEN)] + argv, env={})
    spec = get_train_spec(cfg.model.name)
    args = replace(spec.flavors[cfg.model.flavor], n_layers=2).update_from_config(cfg)
    with torch.device("meta"):
        module = spec.model_cls(args)
    spec.parallelize_fn(module, ParallelDims(1, 1, 1, 1), cfg, torch.device("cpu"))
    return init_on_cpu(module)


def _budget_argv(budget: float, backend: str) -> list[str]:
    ac = "--activation_checkpoint"
    compile_model = ["--compile.enable", "--compile.components", "model", "--compile.backend", backend]
    return [f"{ac}.mode", "memory_budget", f"{ac}.memory_budget", str(budget)] + compile_model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 2048, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))


def _train(module: torch.nn.Module) -> tuple[list[float], list[torch.Tensor]]:
    """Losses of STEPS AdamW steps on one batch, and the first step's gradients."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    tokens = _tokens()
    losses, first_grads = [], None
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(module(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        aux = pop_aux_loss(module)
        (loss if aux is None else loss + aux).backward()
        if first_grads is None:
            first_grads = [p.grad.clone() for p in module.parameters()]
        optimizer.step()
        losses.append(loss.item())
    return losses, first_grads


def _saved_bytes(module: torch.nn.Module) -> int:
    saved = bytes_saved_for_backward(module, _tokens()[:, :-1])
    pop_aux_loss(module)
    return saved


@pytest.fixture(autouse=True, scope="module")
def restore_partitioner_budget():
    """memory_budget AC sets the partitioner's process-wide budget; later tests compile too."""
    with torch._functorch.config.patch(activation_memory_budget=1.0):
        yield


@pytest.fixture(scope="module")
def eager():
    return {model: _train(_build(model, ["--activation_checkpoint.mode", "none"])) for model in CONFIGS}


@pytest.fixture(scope="module")
def saved_by_budget():
    """Bytes the compiled Llama 3 debug model saves for backward, per budget."""
    saved = {}
    for budget in (1.0, 0.5, 0.0):
        torch._dynamo.reset()
        saved[budget] = _saved_bytes(_build("llama3", _budget_argv(budget, FAST_BACKEND)))
    return saved


def test_a_lower_memory_budget_saves_fewer_bytes_for_backward(saved_by_budget):
    full, half, zero = saved_by_budget[1.0], saved_by_budget[0.5], saved_by_budget[0.0]
    assert zero < half < full, saved_by_budget
    # Measured 82.3, 54.1 and 18.0 MiB; the margins leave room for other torch releases.
    assert half < 0.8 * full and zero < 0.4 * full, saved_by_budget


@pytest.mark.parametrize("model", list(CONFIGS))
def test_memory_budget_trains_like_eager_without_ac(eager, model):
    torch._dynamo.reset()
    losses, grads = _train(_build(model, _budget_argv(0.5, FAST_BACKEND)))
    want_losses, want_grads = eager[model]
    assert losses[-1] < losses[0]
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=0)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.full_matrix
def test_inductor_applies_the_memory_budget_and_trains_like_eager(eager):
    torch._dynamo.reset()
    full = _saved_bytes(_build("llama3", _budget_argv(1.0, "inductor")))
    torch._dynamo.reset()
    module = _build("llama3", _budget_argv(0.5, "inductor"))
    half = _saved_bytes(module)
    assert half < 0.8 * full, (half, full)
    losses, _ = _train(module)
    torch.testing.assert_close(losses, eager["llama3"][0], rtol=1e-4, atol=0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager_default_partitioner"])
def test_memory_budget_with_a_backend_that_ignores_it_is_refused(backend):
    with pytest.raises(ConfigError, match=rf"memory_budget.*'compile.backend' = '{backend}'.*inductor"):
        _build("llama3", _budget_argv(0.5, backend))


def test_an_unknown_compile_backend_is_refused_before_compiling():
    argv = ["--compile.enable", "--compile.backend", "inductr"]
    with pytest.raises(ConfigError, match=r"'compile.backend' = 'inductr' is not a torch.compile backend"):
        _build("llama3", argv)
