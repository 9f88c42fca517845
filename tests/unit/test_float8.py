"""Float8 training (`model.converters = ["float8"]`): which Linear layers convert, what is refused,
and that activation checkpointing leaves a float8 block's numbers unchanged (torchao on the CPU)."""

import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torchao.float8.float8_linear import Float8Linear

from torchtitan.components.float8 import Float8Converter
from torchtitan.components.model_converter import build_model_converters
from torchtitan.config import ActivationCheckpoint
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import get_train_spec
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import TransformerBlock
from torchtitan.models.llama3.parallelize import LLAMA3_SAVE_LIST
from torchtitan.models.rope import precompute_rope_cache

CPU = torch.device("cpu")
ONE_PROCESS = ParallelDims(1, 1, 1, 1)


def _converter(*argv: str) -> Float8Converter:
    return Float8Converter(parse_args(["--model.converters", "float8", *argv], env={}), ONE_PROCESS, CPU)


def _meta_model(name: str, flavor: str) -> nn.Module:
    spec = get_train_spec(name)
    return spec.build_meta_model(spec.get_flavor(flavor), torch.float32)


def _linears(model: nn.Module, cls=nn.Linear) -> set[str]:
    return {fqn for fqn, module in model.named_modules() if type(module) is cls}


def test_every_linear_but_the_output_and_the_router_gates_converts():
    model = _meta_model("qwen3", "debugmodel_moe")
    before = _linears(model)
    _converter().convert(model)

    kept = _linears(model)
    assert kept == {"output"} | {fqn for fqn in before if fqn.endswith("moe.router.gate")}
    assert _linears(model, Float8Linear) == before - kept
    assert len(kept) > 1 and len(before - kept) > 10


def test_the_state_dict_keys_and_values_are_unchanged_so_checkpoints_stay_compatible():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _converter().convert(model)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) and after[k].dtype == torch.float32 for k in before)


def test_filter_fqns_and_shapes_that_scaled_mm_cannot_take_stay_in_high_precision():
    model = nn.ModuleDict(
        {
            "keep_me": nn.Linear(32, 32),
            "odd": nn.Linear(32, 24),
            "plain": nn.Linear(32, 32),
            "output": nn.Linear(32, 32),
        }
    )
    _converter("--float8.filter_fqns", "keep_me").convert(model)
    assert _linears(model, Float8Linear) == {"plain", "output"}
    assert _linears(model) == {"keep_me", "odd"}


@pytest.mark.parametrize(
    "recipe, small, large",
    [("tensorwise", (4096, 1024), (4096, 2048)), ("rowwise", (1024, 4096), (4096, 4096))],
)
def test_auto_filter_small_kn_keeps_layers_too_small_to_gain_as_upstream(recipe, small, large):
    """Upstream's flag: torchao's size heuristic for the recipe (in, out) on top of the patterns."""
    shapes = {"small": small, "large": large, "output": large}
    model = nn.ModuleDict({name: nn.Linear(*shape, device="meta") for name, shape in shapes.items()})
    _converter("--float8.recipe_name", recipe, "--float8.filter_fqns", "output,auto_filter_small_kn").convert(
        model
    )
    assert _linears(model, Float8Linear) == {"large"}
    assert _linears(model) == {"small", "output"}


def test_without_auto_filter_small_kn_small_layers_convert():
    model = nn.ModuleDict({"small": nn.Linear(4096, 1024, device="meta")})
    _converter("--float8.filter_fqns", "output").convert(model)
    assert _linears(model, Float8Linear) == {"small"}


@pytest.mark.parametrize("recipe, emulated_casts", [("tensorwise", False), ("rowwise", True),
                                                     ("rowwise_with_gw_hp", True)])  # fmt: skip
def test_rowwise_recipes_make_inductor_keep_eagers_casts(recipe, emulated_casts):
    """As upstream: without it, rowwise float8 under compile and AC diverges to NaN (pytorch#150859)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(emulate_precision_casts=False):
        _converter("--float8.recipe_name", recipe)
        assert inductor_config.emulate_precision_casts is emulated_casts


def test_no_converter_is_built_when_model_converters_is_empty():
    converters = build_model_converters(parse_args([], env={}), ONE_PROCESS, CPU)
    assert converters.converters == []


def test_the_upstream_spelling_builds_the_float8_converter_once():
    cfg = parse_args(["--model.converters", "quantize.linear.float8,float8"], env={})
    converters = build_model_converters(cfg, ONE_PROCESS, CPU)
    assert [type(c) for c in converters.converters] == [Float8Converter]


def test_a_missing_torchao_is_a_config_error_that_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r"needs torchao: pip install 'torchao>=0\.16'"):
        _converter()


def test_the_float8_all_gather_is_refused_without_fsdp():
    with pytest.raises(ConfigError, match="needs FSDP"):
        _converter("--float8.enable_fsdp_float8_all_gather")


def test_the_float8_all_gather_is_refused_on_gloo(tmp_path):
    cfg = parse_args(["--model.converters", "float8", "--float8.enable_fsdp_float8_all_gather"], env={})
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="gloo cannot all-gather float8"):
            Float8Converter(cfg, ParallelDims(1, 2, 1, 2), CPU)
    finally:
        dist.destroy_process_group()


def _block_and_inputs(seq: int = 16):
    """One block and one sequence of `seq` tokens: torch's CPU `_scaled_mm` is a slow reference
    kernel whose time grows with the tokens (see tests/integration/test_float8_training.py)."""
    args = replace(llama3_flavors["debugmodel"], max_seq_len=seq)
    torch.manual_seed(0)
    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": TransformerBlock(0, args)})
    x = torch.randn(1, seq, args.dim, generator=torch.Generator().manual_seed(1))
    return holder, x, precompute_rope_cache(args.head_dim, seq, args.rope_theta)


def _output_and_grads(holder: nn.Module, x: torch.Tensor, rope: torch.Tensor):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = holder.layers["0"](x, rope)
    out.float().square().mean().backward()
    return [out.detach(), x.grad, *(p.grad for p in holder.parameters())]


AC_MODES = {
    "full": ActivationCheckpoint(mode="full"),
    "selective op": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
    "selective 1": ActivationCheckpoint(mode="selective", selective_ac_option="1"),
}


@pytest.mark.parametrize("mode", list(AC_MODES))
def test_ac_gives_a_float8_block_the_output_and_gradients_of_no_ac_bit_for_bit(mode):
    results = []
    for ac in (ActivationCheckpoint(mode="none"), AC_MODES[mode]):
        holder, x, rope = _block_and_inputs()
        _converter().convert(holder)
        apply_ac(holder, ac, op_sac_save_list=LLAMA3_SAVE_LIST)
        results.append(_output_and_grads(holder, x, rope))
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_a_float8_block_is_close_to_but_not_equal_to_the_high_precision_one():
    holder, x, rope = _block_and_inputs()
    reference = _output_and_grads(holder, x, rope)[0]
    holder, x, rope = _block_and_inputs()
    _converter().convert(holder)
    float8 = _output_and_grads(holder, x, rope)[0]

    relative_error = (float8 - reference).norm() / reference.norm()
    assert 0 < relative_error < 0.05
