"""The AC plan: `[activation_checkpoint]` and the run's facts become one typed plan, one class
per mode, and every refusal about AC is raised where it is built, once."""

import ast
from pathlib import Path

import pytest

from torchtitan.config import ActivationCheckpoint, ConfigError
from torchtitan.distributed import activation_checkpoint as ac_module
from torchtitan.distributed.activation_checkpoint import (
    ACFacts,
    EveryNthBlockAC,
    FullAC,
    MemoryBudgetAC,
    NoAC,
    OpSAC,
    plan_activation_checkpointing,
)

COMPILED = ACFacts(compile_enabled=True)


@pytest.mark.parametrize(
    "config, facts, plan",
    [(ActivationCheckpoint(mode="none"), ACFacts(), NoAC),
     (ActivationCheckpoint(mode="full"), ACFacts(), FullAC),
     (ActivationCheckpoint(mode="selective", selective_ac_option="3"), ACFacts(), EveryNthBlockAC),
     (ActivationCheckpoint(mode="selective", selective_ac_option="op"), ACFacts(), OpSAC),
     (ActivationCheckpoint(mode="memory_budget"), COMPILED, MemoryBudgetAC)],
    ids=["none", "full", "selective 3", "selective op", "memory_budget"],
)  # fmt: skip
def test_each_mode_is_a_plan_class_of_its_own(config, facts, plan):
    assert type(plan_activation_checkpointing(config, facts)) is plan


def test_every_nth_block_plan_knows_its_n():
    plan = plan_activation_checkpointing(
        ActivationCheckpoint(mode="selective", selective_ac_option="3"), ACFacts()
    )
    assert plan.every == 3


MOE_COMPILED_CAPTURING = ACFacts(compile_enabled=True, capture_scalar_outputs=True, has_moe=True)


@pytest.mark.parametrize("mode", ["full", "selective", "memory_budget"])
def test_capture_scalar_outputs_with_ac_on_moe_blocks_is_refused_before_torch_2_12(mode):
    config = ActivationCheckpoint(mode=mode)
    with pytest.raises(ConfigError, match=r"capture_scalar_outputs.*torch 2\.11\.0\+cu130.*torch >= 2\.12"):
        plan_activation_checkpointing(config, _with(MOE_COMPILED_CAPTURING, torch_version="2.11.0+cu130"))
    plan_activation_checkpointing(config, _with(MOE_COMPILED_CAPTURING, torch_version="2.12.0"))
    plan_activation_checkpointing(
        ActivationCheckpoint(mode="none"), _with(MOE_COMPILED_CAPTURING, torch_version="2.11.0")
    )


def _with(facts: ACFacts, **changes) -> ACFacts:
    from dataclasses import replace

    return replace(facts, **changes)


COMPILED_TP2 = ACFacts(compile_enabled=True, tensor_parallel=2)
EVERY_2ND = ActivationCheckpoint(mode="selective", selective_ac_option="2")


@pytest.mark.parametrize(
    "config", [ActivationCheckpoint(mode="full"), EVERY_2ND], ids=["full", "selective 2"]
)
def test_block_ac_of_compiled_tp_is_refused_where_compile_takes_device_meshes(config, monkeypatch):
    """torch 2.13 saves the TP mesh among the tensors for backward and fails in the first step;
    2.14.1 runs it (checked on the CPU, 2-rank TP: the same losses as eager)."""
    monkeypatch.setattr(ac_module, "compile_sees_device_meshes", lambda: True)
    for refusing in ("2.13.0+cpu", "2.14.0"):
        with pytest.raises(ConfigError, match=r"option = \"op\" \(both: the option.s default is \"2\"\)"):
            plan_activation_checkpointing(config, _with(COMPILED_TP2, torch_version=refusing))
    plan_activation_checkpointing(config, _with(COMPILED_TP2, torch_version="2.14.1+cu130"))
    # The memory estimator runs a compiled run's step eagerly: wrapped as compiled, not refused.
    plan_activation_checkpointing(config, _with(COMPILED_TP2, torch_version="2.13.0", compiles=False))
    monkeypatch.setattr(ac_module, "compile_sees_device_meshes", lambda: False)  # torch 2.11
    plan_activation_checkpointing(config, _with(COMPILED_TP2, torch_version="2.11.0"))


@pytest.mark.parametrize("mode", ["selective", "memory_budget", "none"])
def test_op_sac_memory_budget_and_no_ac_of_compiled_tp_are_accepted(mode, monkeypatch):
    monkeypatch.setattr(ac_module, "compile_sees_device_meshes", lambda: True)
    plan_activation_checkpointing(ActivationCheckpoint(mode=mode, selective_ac_option="op"), COMPILED_TP2)


def test_memory_budget_with_a_backend_that_ignores_it_is_refused():
    with pytest.raises(ConfigError, match="has no effect with 'compile.backend' = 'eager'"):
        plan_activation_checkpointing(
            ActivationCheckpoint(mode="memory_budget"), _with(COMPILED, compile_backend="eager")
        )


# ----- one module for every AC refusal -------------------------------------------------------

PACKAGE = Path(ac_module.__file__).resolve().parents[1]


def _config_error_messages(path: Path) -> list[str]:
    """The text of every string literal inside a `ConfigError(...)` call in `path`."""
    messages = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ConfigError":
            parts = [
                n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            ]
            messages.append("".join(parts))
    return messages


def test_no_module_outside_the_ac_module_raises_a_config_error_about_activation_checkpoint():
    elsewhere = {
        str(path.relative_to(PACKAGE)): message
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != Path(ac_module.__file__).resolve()
        for message in _config_error_messages(path)
        if "activation_checkpoint." in message
    }
    assert elsewhere == {}


def test_the_check_finds_the_ac_modules_own_refusals():
    """So the test above cannot pass by finding nothing anywhere."""
    messages = _config_error_messages(Path(ac_module.__file__))
    assert sum("activation_checkpoint." in m for m in messages) >= 6


# ----- forced recompute, by module ----------------------------------------------------------


def _moe_block_whose_gate_has_wqs_shape():
    """A 2-block Qwen3 MoE whose router gates (32 -> 64 experts) have the shape of attention.wq
    (32 -> 4 heads x 16)."""
    from tests.model_testing import tiny_qwen3
    from torchtitan.models.moe import MoEArgs

    model = tiny_qwen3(moe_args=MoEArgs(num_experts=64, top_k=2), moe_hidden_dim=16)
    block = model.layers["0"]
    assert block.moe.router.gate.weight.shape == block.attention.wq.weight.shape
    return model


def _recomputed_matmul_weights_and_backward_flops(entries: list[str]) -> tuple[set[str], int]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from tests.model_testing import SEQ_LEN, VOCAB

    model = _moe_block_whose_gate_has_wqs_shape()
    config = ActivationCheckpoint(mode="selective", selective_ac_option="op",
                                  per_op_sac_force_recompute_mm_shapes_by_fqns=entries)  # fmt: skip
    ac_module.apply_ac(model, config)
    weights = {
        p.data_ptr(): name.replace("._checkpoint_wrapped_module", "") for name, p in model.named_parameters()
    }
    read = set()

    class RecomputedMatmuls(TorchDispatchMode):  # grad mode is on in a recompute, off for gradients
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func == torch.ops.aten.mm.default and torch.is_grad_enabled():
                read.add(weights.get(args[1].data_ptr(), "?"))
            return func(*args, **(kwargs or {}))

    tokens = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    loss = model(tokens).square().mean()
    with FlopCounterMode(display=False) as flops, RecomputedMatmuls():
        loss.backward()
    return read, flops.get_total_flops()


DEFAULT_ENTRIES = ActivationCheckpoint().per_op_sac_force_recompute_mm_shapes_by_fqns


@pytest.mark.parametrize(
    "entries", [DEFAULT_ENTRIES, ["moe.router.gate"]], ids=["the default entry", "the user's entry"]
)
def test_forcing_the_gate_recomputes_its_matmul_and_not_attention_wq_of_the_same_shape(entries):
    read, flops = _recomputed_matmul_weights_and_backward_flops(entries)
    _, unforced_flops = _recomputed_matmul_weights_and_backward_flops(
        ["feed_forward.w2"]
    )  # matches nothing here
    assert "layers.0.moe.router.gate.weight" in read
    assert "layers.0.attention.wq.weight" not in read  # the first matmul: saved by the every-second rule
    tokens, blocks = 2 * 16, 2  # batch x seq
    assert flops - unforced_flops == blocks * 2 * tokens * 32 * 64  # the gates' matmuls alone, recomputed
