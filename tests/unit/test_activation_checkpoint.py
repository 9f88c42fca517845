"""apply_ac: numerics, wrapping, recompute accounting, memory held, and refused settings."""

import ast
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from tests.model_testing import init_on_cpu, next_token_loss_and_grads
from torchtitan.config import ActivationCheckpoint, ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.distributed import activation_checkpoint as ac_module
from torchtitan.distributed.activation_checkpoint import (
    DEFAULT_SAVE_LIST,
    MOE_ONLY_OPS,
    TP_ALL_GATHER_OPS,
    apply_ac,
    save_list,
)
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import get_train_spec
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import Transformer, TransformerBlock
from torchtitan.models.llama3.parallelize import LLAMA3_SAVE_LIST
from torchtitan.models.rope import precompute_rope_cache
from torchtitan.protocols.train_spec import _REGISTRY
from torchtitan.tools.activation_memory import bytes_held_for_backward
from torchtitan.tools.fqn import clean_fqn
from torchtitan.tools.op_counter import BACKWARD, OpCounter, collectives, ops

NONE = ActivationCheckpoint(mode="none")
FULL = ActivationCheckpoint(mode="full")
OP_SAC = ActivationCheckpoint(mode="selective", selective_ac_option="op")
MODES = {
    "none": NONE,
    "full": FULL,
    "selective 1": ActivationCheckpoint(mode="selective", selective_ac_option="1"),
    "selective 2": ActivationCheckpoint(mode="selective", selective_ac_option="2"),
    "selective op": OP_SAC,
}
DEBUG_ARGS = replace(llama3_flavors["debugmodel"], max_seq_len=64)


def _debug_model(ac: ActivationCheckpoint = NONE) -> Transformer:
    with torch.device("meta"):
        model = Transformer(DEBUG_ARGS)
    apply_ac(model, ac, op_sac_save_list=LLAMA3_SAVE_LIST)
    return init_on_cpu(model)


def _loss_and_grads(model):
    tokens = torch.randint(0, DEBUG_ARGS.vocab_size, (2, 65), generator=torch.Generator().manual_seed(1))
    return next_token_loss_and_grads(model, tokens)


def _is_checkpointed(module) -> bool:
    return "Checkpoint" in type(module).__name__


def _wrapped(model) -> list[str]:
    """Blocks checkpointed whole, or through their submodules or residual branches (flex
    attention under op-SAC)."""
    return [
        name
        for name, block in model.layers.named_children()
        if _is_checkpointed(block)
        or any(_is_checkpointed(child) for child in block.children())
        or "attention_branch" in vars(block)
    ]


@pytest.fixture(scope="module")
def reference():
    return _loss_and_grads(_debug_model())


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_leaves_loss_and_every_gradient_unchanged(mode, reference):
    ref_loss, ref_grads = reference
    loss, grads = _loss_and_grads(_debug_model(MODES[mode]))
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert torch.equal(grads[name], grad), name  # CPU kernels are deterministic: bit for bit


@pytest.mark.parametrize(
    "mode, wrapped",
    [("none", []), ("full", ["0", "1", "2", "3", "4", "5"]), ("selective 1", ["0", "1", "2", "3", "4", "5"]),
     ("selective 2", ["0", "2", "4"]), ("selective op", ["0", "1", "2", "3", "4", "5"])],
)  # fmt: skip
def test_mode_wraps_the_expected_blocks(mode, wrapped):
    assert _wrapped(_debug_model(MODES[mode])) == wrapped


def test_clean_names_of_a_checkpointed_and_compiled_model_are_the_plain_models():
    plain = [n for n, _ in _debug_model().named_parameters()]
    wrapped = _debug_model(MODES["full"])
    for name, block in wrapped.layers.named_children():
        wrapped.layers.register_module(name, torch.compile(block))  # compiles lazily: nothing runs

    raw = [n for n, _ in wrapped.named_parameters()]

    assert raw[1].startswith("layers.0._orig_mod._checkpoint_wrapped_module.")
    assert [clean_fqn(n) for n in raw] == plain


def test_layer_selective_count_belongs_to_each_model():
    every_4 = ActivationCheckpoint(mode="selective", selective_ac_option="4")
    assert _wrapped(_debug_model(every_4)) == _wrapped(_debug_model(every_4)) == ["0", "4"]


def test_log_names_the_mode_and_the_blocks_once(caplog):
    with caplog.at_level(logging.INFO):
        _debug_model(MODES["selective 2"])
    lines = [r.message for r in caplog.records if "Activation checkpointing" in r.message]
    assert lines == [
        "Activation checkpointing: mode selective (2), full AC on one block in 2 on 3/6 blocks: 0, 2, 4"
    ]


# ----- refused settings --------------------------------------------------------------------


@pytest.mark.parametrize("option", ["0", "-1", "every", "1.5", "", "²"])
def test_invalid_selective_option_is_refused(option):
    with pytest.raises(ConfigError, match="selective_ac_option"):
        _debug_model(ActivationCheckpoint(mode="selective", selective_ac_option=option))


def test_unknown_mode_is_refused():
    with pytest.raises(ConfigError, match="'activation_checkpoint.mode' = 'some'"):
        _debug_model(ActivationCheckpoint(mode="some"))


@pytest.mark.parametrize("budget", [-0.1, 1.5])
def test_memory_budget_outside_unit_interval_is_refused(budget):
    with pytest.raises(ConfigError, match="outside \\[0, 1\\]"):
        apply_ac(
            _second_meta_model(),
            ActivationCheckpoint(mode="memory_budget", memory_budget=budget),
            model_compile_enabled=True,
        )


def test_memory_budget_without_compile_is_refused():
    with pytest.raises(ConfigError, match="compile.enable"):
        _debug_model(ActivationCheckpoint(mode="memory_budget"))


def test_memory_budget_sets_the_partitioner_budget_and_wraps_nothing(tmp_path):
    # The config's own patch() restores the settings after; pytest's monkeypatch deleted them
    # from torch 2.11's config module on undo, which broke every later compile in the session.
    defaults = {"activation_memory_budget": 1.0, "visualize_memory_budget_pareto": False,
                "memory_budget_pareto_dir": None}  # fmt: skip
    model = _second_meta_model()
    cfg = ActivationCheckpoint(mode="memory_budget", memory_budget=0.3, visualize_memory_budget_pareto=True)
    with torch._functorch.config.patch(defaults):
        apply_ac(model, cfg, model_compile_enabled=True, base_folder=str(tmp_path))
        assert torch._functorch.config.activation_memory_budget == 0.3
        assert torch._functorch.config.memory_budget_pareto_dir == str(tmp_path)
        assert _wrapped(model) == []
    assert torch._functorch.config.activation_memory_budget == 1.0


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_every_other_mode_clears_a_previous_models_memory_budget(mode):
    # Left at 0, the partitioner keeps only graph inputs and compiled op-SAC recomputes all.
    model = _second_meta_model()
    with torch._functorch.config.patch(activation_memory_budget=1.0):
        zero_budget = ActivationCheckpoint(mode="memory_budget", memory_budget=0.0)
        apply_ac(model, zero_budget, model_compile_enabled=True)
        assert torch._functorch.config.activation_memory_budget == 0.0
        apply_ac(_second_meta_model(), ActivationCheckpoint(mode=mode, selective_ac_option="op"))
        assert torch._functorch.config.activation_memory_budget == 1.0


def test_force_recompute_fqn_on_non_linear_is_refused():
    cfg = replace(OP_SAC, per_op_sac_force_recompute_mm_shapes_by_fqns=["attention_norm"])
    with pytest.raises(ConfigError, match="not an nn.Linear"):
        _debug_model(cfg)


@pytest.mark.parametrize(
    "entry, refusal",
    [("attention", r"matches layers\.0\.attention\S* \(\w+\), not an nn.Linear"),
     ("", "empty entry, which would match every module"),
     ("output", "matches only output, outside the transformer blocks AC wraps")],
    ids=["a module holding Linears", "empty", "outside the blocks"],
)  # fmt: skip
def test_force_recompute_entry_that_would_force_more_or_nothing_is_refused(entry, refusal):
    with pytest.raises(ConfigError, match=refusal):
        _debug_model(replace(OP_SAC, per_op_sac_force_recompute_mm_shapes_by_fqns=[entry]))


def test_force_recompute_fqn_matching_nothing_is_refused_unless_it_is_a_default():
    with pytest.raises(ConfigError, match="matches no module"):
        _debug_model(replace(OP_SAC, per_op_sac_force_recompute_mm_shapes_by_fqns=["moe.rooter"]))
    assert len(_wrapped(_debug_model(OP_SAC))) == 6  # default "moe.router.gate" on a dense model


def test_mode_from_the_command_line_is_checked_before_training():
    with pytest.raises(ConfigError, match="activation_checkpoint.mode"):
        parse_args(["--activation_checkpoint.mode", "partial"], env={})


@pytest.mark.parametrize(
    "argv, named",
    [(["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "x"],
      "'activation_checkpoint.selective_ac_option' = 'x'"),
     (["--activation_checkpoint.mode", "memory_budget"], "set compile.enable = true")],
    ids=["ac-option", "memory-budget-uncompiled"],
)  # fmt: skip
def test_ac_mistakes_are_refused_by_the_launchers_preflight_in_one_line(argv, named, capsys):
    from torchtitan.preflight import main as preflight

    assert preflight(["--world-size", "1", *argv]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, conflict",
    [(["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
      "per-op selective AC"),
     (["--activation_checkpoint.mode", "full", "--compile.enable"], "compiled blocks")],
    ids=["op-SAC", "compile"],
)  # fmt: skip
def test_debug_that_torch_cannot_trace_is_refused_by_the_launchers_preflight(argv, conflict, capsys):
    """So the launchers stop it in one line, before torchrun starts any rank."""
    from torchtitan.preflight import main as preflight

    assert preflight(["--world-size", "1", *argv, "--activation_checkpoint.debug"]) == 2
    assert f"'activation_checkpoint.debug' = true cannot trace {conflict}" in capsys.readouterr().err


# ----- save lists --------------------------------------------------------------------------


def test_default_save_list_covers_matmuls_every_attention_kernel_collectives_and_routing():
    aten = torch.ops.aten
    sdpa_kernels = ("flash_attention", "efficient_attention", "cudnn_attention", "flash_attention_for_cpu")
    c10d = torch.ops._c10d_functional
    expected = {getattr(aten, f"_scaled_dot_product_{k}").default for k in sdpa_kernels} | {
        aten.mm.default, aten.max.default, aten.topk.default,
        c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default,
    }  # fmt: skip
    assert expected <= DEFAULT_SAVE_LIST
    assert any("flex_attention" in str(op) for op in DEFAULT_SAVE_LIST)


def test_default_save_list_names_no_composite_op_which_the_policy_would_never_see():
    def composite(op) -> bool:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")

    assert [op for op in DEFAULT_SAVE_LIST if isinstance(op, torch._ops.OpOverload) and composite(op)] == []


def test_default_save_list_recomputes_the_sequence_parallel_all_gathers():
    # Their full-sequence outputs cost tp times their input's memory; re-gathering is cheap.
    assert not TP_ALL_GATHER_OPS & DEFAULT_SAVE_LIST


def test_model_save_list_is_default_plus_additions_minus_drops():
    extra = torch.ops.aten.addmm.default
    built = save_list(add=[extra], drop=[torch.ops.aten.max.default])
    assert built == (DEFAULT_SAVE_LIST | {extra}) - {torch.ops.aten.max.default}


def test_dense_llama_list_drops_moe_routing_ops():
    assert LLAMA3_SAVE_LIST == DEFAULT_SAVE_LIST - MOE_ONLY_OPS


# ----- recompute accounting on one block ---------------------------------------------------

BLOCK_ARGS = replace(llama3_flavors["debugmodel"], max_seq_len=128)


def _block(
    ac: ActivationCheckpoint, op_sac_save_list: frozenset = LLAMA3_SAVE_LIST, use_flex_attn: bool = False
) -> nn.Module:
    torch.manual_seed(0)
    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": TransformerBlock(0, BLOCK_ARGS)})
    apply_ac(holder, ac, op_sac_save_list=op_sac_save_list, use_flex_attn=use_flex_attn)
    return holder.layers["0"]


def _block_inputs():
    x = torch.randn(2, 128, BLOCK_ARGS.dim, requires_grad=True, generator=torch.Generator().manual_seed(2))
    return x, precompute_rope_cache(BLOCK_ARGS.head_dim, 128, BLOCK_ARGS.rope_theta)


def _forward_and_backward_flops(ac: ActivationCheckpoint) -> tuple[int, int]:
    block, (x, rope) = _block(ac), _block_inputs()
    with FlopCounterMode(display=False) as counter:
        out = block(x, rope)
        forward = counter.get_total_flops()
        out.sum().backward()
    return forward, counter.get_total_flops() - forward


def test_backward_flops_grow_with_recompute():
    forced = replace(
        OP_SAC, per_op_sac_force_recompute_mm_shapes_by_fqns=["feed_forward.w1", "feed_forward.w3"]
    )
    _, none = _forward_and_backward_flops(NONE)
    _, op_sac = _forward_and_backward_flops(OP_SAC)
    _, op_sac_forced = _forward_and_backward_flops(forced)
    _, full = _forward_and_backward_flops(FULL)
    assert none < op_sac < op_sac_forced < full


def test_full_ac_recomputes_one_forward_without_early_stop():
    forward, none = _forward_and_backward_flops(NONE)
    _, full = _forward_and_backward_flops(replace(FULL, early_stop=False))
    assert full - none == forward


def test_full_ac_with_early_stop_never_recomputes_the_last_matmul():
    """Backward reads nothing the block's last matmul (w2) or residual add produce, so early stop
    (the default) ends the recompute before them."""
    forward, none = _forward_and_backward_flops(NONE)
    _, full = _forward_and_backward_flops(FULL)
    tokens, w2 = 2 * 128, _block(NONE).feed_forward.w2.weight
    assert FULL.early_stop
    assert full - none == forward - 2 * tokens * w2.numel()


@pytest.mark.parametrize("mode, reruns", [("selective op", 0), ("full", 1), ("none", 0)])
def test_attention_kernel_is_not_rerun_in_backward_under_op_sac(mode, reruns):
    block, (x, rope) = _block(MODES[mode]), _block_inputs()
    with OpCounter(ops(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)) as counter:
        out = block(x, rope)
        counter.start_backward()
        out.sum().backward()
    assert counter.count(phase=BACKWARD) == reruns


# ----- memory held for backward ------------------------------------------------------------


def _held_by_block(ac: ActivationCheckpoint) -> tuple[int, int]:
    block, (x, rope) = _block(ac), _block_inputs()
    return bytes_held_for_backward(block, x, rope), x.numel() * x.element_size()


def test_full_ac_holds_only_the_block_input():
    held, block_input = _held_by_block(FULL)
    assert block_input <= held <= 1.05 * block_input


def test_op_sac_with_an_empty_save_list_holds_only_the_block_input_as_full_ac_does():
    block, (x, rope) = _block(OP_SAC, op_sac_save_list=frozenset()), _block_inputs()
    assert bytes_held_for_backward(block, x, rope) == _held_by_block(FULL)[0]


def test_op_sac_holds_under_half_of_no_ac():
    assert _held_by_block(OP_SAC)[0] <= 0.45 * _held_by_block(NONE)[0]


def test_op_sac_keeps_no_output_of_the_blocks_last_matmul_and_never_recomputes_it():
    """w2's output feeds only the residual add, whose backward reads nothing: saving it was
    memory for nothing, and with early stop the recompute ends before reaching it."""
    saving_w2 = replace(OP_SAC, per_op_sac_force_recompute_mm_shapes_by_fqns=["moe.router.gate"])
    w2_output = 2 * 128 * BLOCK_ARGS.dim * 4  # batch x seq x dim, fp32
    assert _held_by_block(saving_w2)[0] - _held_by_block(OP_SAC)[0] == w2_output
    assert _forward_and_backward_flops(saving_w2) == _forward_and_backward_flops(OP_SAC)


def _tp2_held_and_backward_collectives(
    *ac_args: str, model_name: str = "llama3", flavor: str = "debugmodel"
) -> tuple[int, dict[str, int]]:
    """Bytes a 2-block debug model under TP 2 (a fake process group, one process) holds for
    backward, and the collectives its backward issues."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    seq, tp = 256, 2
    cfg = parse_args(
        ["--model.name", model_name, "--model.flavor", flavor, "--training.seq_len", str(seq)]
        + ["--parallelism.tensor_parallel_degree", str(tp), "--parallelism.data_parallel_shard_degree", "1"]
        + list(ac_args),
        env={},
    )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        dims = ParallelDims.from_config(cfg.parallelism, tp)
        dims.build_mesh("cpu")
        spec = get_train_spec(model_name)
        with torch.device("meta"):
            model = spec.model_cls(replace(spec.get_flavor(flavor).update_from_config(cfg), n_layers=2))
        spec.parallelize_fn(model, dims, cfg, torch.device("cpu"))
        init_on_cpu(model)
        tokens = torch.randint(0, 2000, (2, seq), generator=torch.Generator().manual_seed(0))
        held = bytes_held_for_backward(model, tokens)
        with OpCounter(collectives) as counter:
            logits = model(tokens)
            counter.start_backward()
            logits.to_local().sum().backward()
        return held, counter.counts_by_name(phase=BACKWARD)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "model_name, flavor",
    [("llama3", "debugmodel"), ("qwen3", "debugmodel_moe"), ("deepseek_v3", "debugmodel")],
    ids=["dense w2", "MoE without shared experts", "dense block then MoE with shared experts"],
)
def test_op_sac_under_tp_holds_no_block_ending_reduce_scatter_and_never_reissues_one(model_name, flavor):
    """The reduce-scatter that ends a block (of w2's output, or of the MoE's) feeds only the
    residual add: with early stop (the default) it is neither held nor re-issued; without,
    recompute re-issues it, so it is saved."""
    op_sac = [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ]
    model = {"model_name": model_name, "flavor": flavor}
    held, issued = _tp2_held_and_backward_collectives(*op_sac, **model)
    held_without_early_stop, _ = _tp2_held_and_backward_collectives(
        *op_sac, "--activation_checkpoint.early_stop", "false", **model
    )
    _, without_ac = _tp2_held_and_backward_collectives(**model)
    dim = get_train_spec(model_name).get_flavor(flavor).dim
    block_output_shard = 2 * (256 // 2) * dim * 4  # batch x seq/tp x dim, fp32
    assert held_without_early_stop - held == 2 * block_output_shard  # one per block
    assert issued["reduce_scatter_tensor"] == without_ac["reduce_scatter_tensor"]


def test_forcing_wo_under_tp_keeps_its_reduce_scatter_which_backward_needs():
    """Unlike w2's, wo's reduce-scatter feeds the next norm's input, which recompute rebuilds."""
    ac = "--activation_checkpoint."
    forced = ["moe.router.gate", "feed_forward.w2", "moe.shared_experts.w2", "attention.wo"]
    op_sac = [ac + "mode", "selective", ac + "selective_ac_option", "op"]
    _, issued = _tp2_held_and_backward_collectives(
        *op_sac, ac + "per_op_sac_force_recompute_mm_shapes_by_fqns", ",".join(forced)
    )
    _, without_ac = _tp2_held_and_backward_collectives()
    assert issued["reduce_scatter_tensor"] == without_ac["reduce_scatter_tensor"]


def test_a_force_recompute_entry_forces_exactly_the_linears_it_names_default_or_not():
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpoint as AC
    from torchtitan.distributed.activation_checkpoint import forced_recompute_linears

    model = _second_meta_model()
    w2s = {block.feed_forward.w2 for block in model.layers.children()}
    default = AC().per_op_sac_force_recompute_mm_shapes_by_fqns  # "moe..." entries match nothing here
    assert forced_recompute_linears(model, default) == w2s
    assert forced_recompute_linears(model, ["feed_forward.w2"]) == w2s  # the same string, the user's
    assert forced_recompute_linears(model, ["layers.3.attention.wo"]) == {model.layers["3"].attention.wo}


def _held_by_8b_block(ac: ActivationCheckpoint) -> tuple[int, int]:
    args = replace(llama3_flavors["8B"], max_seq_len=8192)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with FakeTensorMode():
            holder = nn.Module()
            holder.layers = nn.ModuleDict({"0": TransformerBlock(0, args)})
            apply_ac(holder, ac, op_sac_save_list=LLAMA3_SAVE_LIST)
            x = torch.randn(1, 8192, args.dim, requires_grad=True)
            rope = precompute_rope_cache(args.head_dim, 8192, args.rope_theta)
            return bytes_held_for_backward(holder.layers["0"], x, rope), x.numel() * 2
    finally:
        torch.set_default_dtype(previous)


def test_8b_block_full_ac_holds_exactly_its_input_and_op_sac_under_30_percent():
    none, block_input = _held_by_8b_block(NONE)
    full, _ = _held_by_8b_block(FULL)
    op_sac, _ = _held_by_8b_block(OP_SAC)
    assert full == block_input == 64 * 2**20
    assert op_sac <= 0.30 * none


# ----- flex_attention and compile rules ----------------------------------------------------


def test_flex_with_op_sac_and_no_compile_checkpoints_each_residual_branch_norm_included(caplog, monkeypatch):
    monkeypatch.setattr(ac_module, "_warned", set())
    with torch.device("meta"):
        model = Transformer(DEBUG_ARGS)
    keys = model.state_dict().keys()
    with caplog.at_level(logging.WARNING):
        apply_ac(model, OP_SAC, use_flex_attn=True)
        apply_ac(_second_meta_model(), OP_SAC, use_flex_attn=True)
    block = model.layers["0"]
    # The branches are checkpointed as methods: no module is wrapped, no parameter renamed.
    assert not any("Checkpoint" in type(m).__name__ for m in model.modules())
    assert {"attention_branch", "mlp_branch"} <= vars(block).keys()
    assert model.state_dict().keys() == keys
    warnings = [r.message for r in caplog.records if "flex_attention" in r.message]
    assert len(warnings) == 1 and "compile off" in warnings[0]


def test_flex_rule_holds_no_norm_tensors_between_its_regions():
    """With each norm inside its branch's region, the flex rule (attention branch full AC, the
    MLP branch op-SAC) holds no more than op-SAC over the whole block; with the norms outside,
    as the rule first had them, it held 1.37 times as much."""
    block, (x, rope) = _block(OP_SAC, use_flex_attn=True), _block_inputs()
    assert bytes_held_for_backward(block, x, rope) <= _held_by_block(OP_SAC)[0]


def _second_meta_model():
    with torch.device("meta"):
        return Transformer(DEBUG_ARGS)


class _Block(nn.Module):
    """A block with the interface the AC plan asks blocks for (`DecoderBlock`'s), and an MoE
    or a dense MLP that are single Linears."""

    def __init__(self, moe: bool = False):
        super().__init__()
        self.attention = nn.Linear(4, 4)
        self.mlp_name, self.is_moe = ("moe" if moe else "feed_forward"), moe
        self.register_module(self.mlp_name, nn.Linear(4, 4))

    @property
    def mlp(self):
        return getattr(self, self.mlp_name)

    def end_linears(self):
        return [self.mlp]

    def forward(self, x):
        return self.mlp(self.attention(x))


class _MoEBlock(_Block):
    def __init__(self):
        super().__init__(moe=True)


def test_flex_with_compile_and_moe_blocks_wraps_attention_and_moe_separately(monkeypatch):
    monkeypatch.setattr(ac_module, "_warned", set())
    model = nn.Module()
    model.layers = nn.ModuleList([_MoEBlock(), _MoEBlock()])
    apply_ac(model, OP_SAC, use_flex_attn=True, model_compile_enabled=True)
    for block in model.layers:
        assert isinstance(block, _MoEBlock)
        assert "Checkpoint" in type(block.attention).__name__ and "Checkpoint" in type(block.moe).__name__


def test_flex_with_compile_and_dense_blocks_wraps_whole_blocks():
    with torch.device("meta"):
        model = Transformer(DEBUG_ARGS)
    apply_ac(model, OP_SAC, use_flex_attn=True, model_compile_enabled=True)
    blocks = list(model.layers.values())
    assert len(blocks) == 6 and all(_is_checkpointed(block) for block in blocks)
    assert all("context_fn" in block.checkpoint_fn.keywords for block in blocks)


# ----- recompute checks: determinism_check and debug ---------------------------------------


class _RecomputesOtherShape(nn.Module):
    """A block whose recompute differs from its forward (it keeps half the features the second
    time), as a block with hidden state or a data-dependent branch might."""

    is_moe = False

    def __init__(self):
        super().__init__()
        self.proj, self.calls = nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1
        y = self.proj(x)
        return (y if self.calls == 1 else y[:, :2]).sin().sum()


def _backward_error(ac: ActivationCheckpoint) -> Exception:
    model = nn.Module()
    model.layers = nn.ModuleList([_RecomputesOtherShape()])
    apply_ac(model, ac)
    with pytest.raises(Exception) as info:
        model.layers[0](torch.randn(3, 4, requires_grad=True)).backward()
    return info.value


def test_default_determinism_check_names_the_mismatching_recomputed_tensor():
    error = _backward_error(FULL)
    assert type(error).__name__ == "CheckpointError"
    assert "different metadata" in str(error) and "torch.Size([3, 2])" in str(error)


def test_determinism_check_none_skips_the_recompute_check():
    error = _backward_error(replace(FULL, determinism_check="none"))
    assert type(error).__name__ != "CheckpointError"  # autograd's own shape error, later


def test_debug_adds_the_operators_of_forward_and_recompute_to_the_error():
    error = _backward_error(replace(FULL, debug=True))
    assert "Stack traces of the operators that ran in the original forward" in str(error)
    assert "Stack traces of the operators" not in str(_backward_error(FULL))


def test_log_says_when_the_recompute_check_is_off_or_debug_is_on(caplog):
    with torch.device("meta"):
        model = Transformer(DEBUG_ARGS)
    with caplog.at_level(logging.INFO):
        apply_ac(model, replace(FULL, determinism_check="none", debug=True))
    line = next(r.message for r in caplog.records if r.message.startswith("Activation checkpointing"))
    assert line.endswith("5, recompute check off, debug traces on (slower)")


@pytest.mark.parametrize("mode", ["selective 2", "full"])
def test_determinism_check_and_debug_reach_every_wrapped_block(mode):
    ac = replace(MODES[mode], determinism_check="none", debug=True)
    with torch.device("meta"):
        model = Transformer(DEBUG_ARGS)
    apply_ac(model, ac)
    wrapped = [block for block in model.layers.values() if _is_checkpointed(block)]
    assert len(wrapped) == (3 if mode == "selective 2" else 6)
    for block in wrapped:
        assert block.checkpoint_fn.keywords["determinism_check"] == "none"
        assert block.checkpoint_fn.keywords["debug"] is True


@pytest.mark.parametrize(
    "ac, moe, compiled, expected",
    [(OP_SAC, False, False, "per-op selective AC"),
     (FULL, True, False, "MoE blocks"),
     (ActivationCheckpoint(mode="selective", selective_ac_option="2"), True, False, "MoE blocks"),
     (FULL, False, True, "compiled blocks")],
    ids=["op-SAC", "full AC of MoE blocks", "selective 2 of MoE blocks", "compiled blocks"],
)  # fmt: skip
def test_debug_where_torch_cannot_trace_is_refused_with_the_way_that_works(ac, moe, compiled, expected):
    model = nn.Module()
    model.layers = nn.ModuleList([_Block(moe) for _ in range(2)])
    with pytest.raises(ConfigError) as info:
        apply_ac(model, replace(ac, debug=True), model_compile_enabled=compiled)
    assert expected in str(info.value) and 'mode "full"' in str(info.value)


# ----- every model, and the one-module rule ------------------------------------------------


DEBUG_FLAVORS = [
    (name, flavor)
    for name, spec in sorted(_REGISTRY.items())
    for flavor in spec.flavors
    if flavor.startswith("debug")
]


def test_every_registered_model_has_a_debug_flavor():
    assert {name for name, _ in DEBUG_FLAVORS} == set(_REGISTRY) >= {"llama3", "qwen3"}


@pytest.mark.parametrize("mode, every", [("none", 0), ("full", 1), ("selective 2", 2), ("selective op", 1)])
@pytest.mark.parametrize("model_name, flavor", DEBUG_FLAVORS)
def test_every_registered_model_wraps_blocks_through_its_parallelize(model_name, flavor, mode, every):
    spec = get_train_spec(model_name)
    cfg = parse_args(["--model.name", model_name, "--model.flavor", flavor], env={})
    cfg.activation_checkpoint = MODES[mode]
    with torch.device("meta"):
        model = spec.model_cls(spec.flavors[flavor])
    spec.parallelize_fn(model, ParallelDims(1, 1, 1, 1), cfg, torch.device("cpu"))
    names = [name for name, _ in model.layers.named_children()]
    expected = [n for i, n in enumerate(names) if every and i % every == 0]
    assert _wrapped(model) == expected


CHECKPOINT_MODULES = ("torch.utils.checkpoint", "torch.distributed.algorithms._checkpoint")
CHECKPOINT_NAMES = {
    "checkpoint",
    "checkpoint_wrapper",
    "create_selective_checkpoint_contexts",
    "CheckpointPolicy",
}


def _uses_checkpoint_api(source: str) -> bool:
    if any(module in source for module in CHECKPOINT_MODULES):
        return True
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in (
            "torch.utils",
            "torch.distributed.algorithms",
        ):
            if {a.name for a in node.names} & (CHECKPOINT_NAMES | {"_checkpoint"}):
                return True
    return False


def test_only_the_ac_module_uses_checkpoint_apis():
    package = Path(ac_module.__file__).resolve().parents[1]
    users = [
        str(p.relative_to(package)) for p in package.rglob("*.py") if _uses_checkpoint_api(p.read_text())
    ]
    assert users == ["distributed/activation_checkpoint.py"]


def test_checkpoint_api_detector_catches_each_import_style():
    assert _uses_checkpoint_api("from torch.utils.checkpoint import checkpoint")
    assert _uses_checkpoint_api("from torch.utils import checkpoint")
    assert _uses_checkpoint_api("import torch.utils.checkpoint as cp")
    assert _uses_checkpoint_api("from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import x")
    assert not _uses_checkpoint_api("from torchtitan.distributed.activation_checkpoint import apply_ac")


def _qwen3_moe_held_under_op_sac(grouped_experts: bool) -> int:
    cfg = parse_args(["--config", "qwen3_debug_model_moe.toml", "--training.seq_len", "64",
                      "--training.mixed_precision_param", "float32", "--activation_checkpoint.mode",
                      "selective", "--activation_checkpoint.selective_ac_option", "op"], env={})  # fmt: skip
    spec = get_train_spec("qwen3")
    args = spec.get_flavor("debugmodel_moe").update_from_config(cfg)
    args = replace(args, moe_args=replace(args.moe_args, use_grouped_mm=grouped_experts))
    with torch.device("meta"):
        model = spec.model_cls(args)
    spec.parallelize_fn(model, ParallelDims(1, 1, 1, 1), cfg, torch.device("cpu"))
    init_on_cpu(model)
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    return bytes_held_for_backward(model, tokens)


def test_op_sac_recomputes_looped_experts_matmuls_as_it_does_grouped_ones():
    """Where grouped mm cannot run (fp32 compiled, unaligned rows, or `use_grouped_mm = false`,
    as here) the experts loop over plain matmuls; op-SAC counted them in its
    every-second-matmul rule and held half of their outputs (7.2 MiB here vs 4.9 grouped)."""
    assert _qwen3_moe_held_under_op_sac(grouped_experts=False) == _qwen3_moe_held_under_op_sac(True)


def test_held_bytes_leave_out_the_local_shard_of_a_dtensor_parameter():
    """Experts under TP compute on their weights' local shards; those are parameters, not
    activations (Qwen3 MoE at TP 2 under full AC counted 6.6 MiB held for 0.6 MiB)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    class UsesItsShard(nn.Module):
        def __init__(self, mesh):
            super().__init__()
            self.weight = nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))

        def forward(self, x):
            return x @ self.weight.to_local().t()

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        module = UsesItsShard(init_device_mesh("cpu", (2,)))
        x = torch.randn(3, 4, requires_grad=True)
        assert bytes_held_for_backward(module, x) == x.nbytes  # the input copy mm keeps
    finally:
        dist.destroy_process_group()
