"""FSDP as `apply_fsdp` lays it out, in one process over a fake process group."""

from dataclasses import replace

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.config.manager import parse_args
from torchtitan.distributed.data_parallel import apply_fsdp, cpu_offload_policy
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import get_train_spec
from torchtitan.models.rope import Rotary


def test_blocks_under_bf16_fsdp_get_the_rope_table_in_fp32(monkeypatch):
    """FSDP casts a unit's floating-point inputs to param_dtype by default: the RoPE table then
    reached attention in bf16, its cos/sin off by up to 2e-3 at 4096 positions."""
    seen = []

    def spy(self, x, rope_cache):
        seen.append((x.dtype, rope_cache.dtype))
        return rope(self, x, rope_cache)

    rope = Rotary.forward
    monkeypatch.setattr(Rotary, "forward", spy)
    cfg = parse_args(["--training.mixed_precision_param", "bfloat16", "--training.seq_len", "32"], env={})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        dims = ParallelDims(1, 2, 1, 2)
        dims.build_mesh("cpu")
        spec = get_train_spec("llama3")
        model = spec.model_cls(replace(spec.get_flavor("debugmodel"), n_layers=1, max_seq_len=32))
        apply_fsdp(model, dims, cfg, torch.device("cpu"))
        model(torch.zeros(1, 32, dtype=torch.long))
    finally:
        dist.destroy_process_group()
    assert seen and set(seen) == {(torch.bfloat16, torch.float32)}


def test_every_fsdp_unit_reduces_gradients_in_mixed_precision_reduce_not_the_param_dtype():
    """The parity tests train in fp32, where the two dtypes coincide: a policy that reduced in the
    param dtype (bf16 gradient sums) would pass them all. Expert units (EP 2) included."""
    from torch.distributed.fsdp import FSDPModule

    cfg = parse_args(
        ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--training.seq_len", "32",
         "--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "float32",
         "--parallelism.expert_parallel_degree", "2"],
        env={},
    )  # fmt: skip
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        dims = ParallelDims(1, 4, 1, 4, ep=2)
        dims.build_mesh("cpu")
        spec = get_train_spec("qwen3")
        model = spec.model_cls(replace(spec.get_flavor("debugmodel_moe"), n_layers=2, max_seq_len=32))
        spec.parallelize_fn(model, dims, cfg, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    units = {name or "<root>": m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    policies = {name: m._get_fsdp_state()._mp_policy for name, m in units.items()}
    assert any("experts" in name for name in units), list(units)
    assert {(p.param_dtype, p.reduce_dtype) for p in policies.values()} == {(torch.bfloat16, torch.float32)}


EARLY_STEP = ["--optimizer.early_step_in_backward", "--training.max_norm", "0"]


def test_cpu_offload_under_early_step_in_backward_before_torch_2_13_copies_gradients_unpinned():
    """Torch 2.11 and 2.12 ran FSDP's post-accumulate-grad hooks (the early step) while the
    gradient's non-blocking copy to pinned host memory was in flight."""
    policy = cpu_offload_policy(parse_args(EARLY_STEP, env={}), torch_version="2.12.1+cu130")
    assert policy.pin_memory is False


def test_cpu_offload_pins_memory_where_no_hook_reads_gradients_early_or_torch_waits_for_the_copy():
    assert cpu_offload_policy(parse_args([], env={}), torch_version="2.11.0").pin_memory is True
    assert cpu_offload_policy(parse_args(EARLY_STEP, env={}), torch_version="2.13.0+cpu").pin_memory is True


def test_default_resharding_frees_no_gathered_weights_under_pipeline_parallelism():
    from torchtitan.distributed.data_parallel import _reshard_policy

    assert _reshard_policy("default") == (True, False, False)
    assert _reshard_policy("default", pipelined=True) == (False, False, False)
    assert _reshard_policy("always", pipelined=True) == (True, True, True)
