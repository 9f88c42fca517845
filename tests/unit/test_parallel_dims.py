"""ParallelDims and layout checks: every bad mesh config names its numbers and the fix."""

import pytest
import torch
import torch.distributed as dist

from torchtitan.config import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import check_tp_divisibility, maybe_enable_async_tp
from torchtitan.train import main


def test_shard_degree_minus_one_takes_the_ranks_left_over():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8)
    assert dims.dp_shard == 2 and dims.dp_degree == 4
    assert dims.fsdp_enabled and dims.tp_enabled and not dims.ddp_enabled


def test_replicate_only_is_ddp():
    dims = ParallelDims(dp_replicate=4, dp_shard=1, tp=1, world_size=4)
    assert dims.ddp_enabled and not dims.fsdp_enabled


@pytest.mark.parametrize("shard", [1, -1], ids=["explicit", "left-over"])
def test_ddp_with_tensor_parallel_is_refused_naming_the_fsdp_layout(shard):
    """torch's replicate on a TP mesh slice leaves no parameter with a gradient: nothing trained."""
    with pytest.raises(ConfigError, match="data_parallel_shard_degree = 2 with data_parallel_replicate"):
        ParallelDims(dp_replicate=2, dp_shard=shard, tp=2, world_size=4)


def test_product_not_matching_world_size_names_every_degree():
    with pytest.raises(ConfigError) as info:
        ParallelDims(dp_replicate=1, dp_shard=3, tp=2, world_size=8)
    message = str(info.value)
    assert (
        "multiply to 6" in message and "world size is 8" in message and "tensor_parallel_degree 2" in message
    )


def test_degrees_not_dividing_world_size_are_refused():
    with pytest.raises(ConfigError, match="does not divide the world size 6"):
        ParallelDims(dp_replicate=1, dp_shard=-1, tp=4, world_size=6)


@pytest.mark.parametrize("tp, heads, kv_heads, what", [(3, 12, 4, "kv heads"), (4, 6, 4, "attention heads")])
def test_tp_degree_must_divide_heads_and_kv_heads(tp, heads, kv_heads, what):
    cfg = parse_args([], env={})
    with pytest.raises(ConfigError, match=what):
        check_tp_divisibility(ParallelDims(1, 1, tp, tp), cfg, heads, kv_heads)


@pytest.mark.parametrize(
    "argv, key",
    [(["--training.seq_len", "63"], "'training.seq_len' = 63"),
     (["--validation.enable", "--training.seq_len", "64", "--validation.seq_len", "63"],
      "'validation.seq_len' = 63")],
)  # fmt: skip
def test_a_sequence_length_tp_does_not_divide_is_refused_when_the_config_is_parsed(argv, key):
    with pytest.raises(ConfigError) as info:
        parse_args(argv + ["--parallelism.tensor_parallel_degree", "2"], env={})
    assert str(info.value).startswith(f"{key} is not a multiple of 'parallelism.tensor_parallel_degree' = 2")
    assert str(info.value).endswith("Use a multiple of 2, e.g. 62.")


def test_a_validation_sequence_length_is_not_checked_while_validation_is_off():
    parse_args(
        [
            "--training.seq_len",
            "64",
            "--validation.seq_len",
            "63",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
        env={},
    )


def test_tp_degree_must_divide_the_feed_forward_hidden_width():
    from torchtitan.distributed.tensor_parallel import dense_mlp_plan
    from torchtitan.models.layers import FeedForward

    with pytest.raises(ConfigError, match="does not divide the feed-forward hidden width 769"):
        dense_mlp_plan(FeedForward(dim=16, hidden_dim=769), tp=2)


def test_async_tp_without_compile_or_cuda_is_refused():
    argv = ["--parallelism.enable_async_tensor_parallel", "--parallelism.tensor_parallel_degree", "2"]
    cfg = parse_args(argv, env={})
    with pytest.raises(ConfigError, match="needs tensor_parallel_degree > 1, compile.enable"):
        maybe_enable_async_tp(ParallelDims(1, 1, 2, 2), cfg, torch.device("cpu"))


def test_context_parallel_degree_counts_in_the_world_size_and_shards_with_fsdp():
    dims = ParallelDims(1, -1, 1, 8, cp=2)
    assert dims.dp_shard == 4 and dims.dp_degree == 4 and dims.fsdp_enabled
    assert ParallelDims(1, 1, 1, 2, cp=2).fsdp_enabled  # the CP ranks alone shard the weights
    assert not ParallelDims(2, 1, 1, 4, cp=2).ddp_enabled
    with pytest.raises(ConfigError, match="x context_parallel_degree 2 x tensor_parallel_degree 1"):
        ParallelDims(1, 3, 1, 8, cp=2)


def test_pipeline_degree_counts_in_the_world_size_and_is_the_outermost_mesh_dim():
    dims = ParallelDims(1, -1, 1, 8, pp=2)
    assert dims.dp_shard == 4 and dims.pp_enabled
    with pytest.raises(ConfigError, match="pipeline_parallel_degree 2 x data_parallel_replicate_degree 1"):
        ParallelDims(1, 3, 1, 8, pp=2)


def test_mesh_mismatch_from_the_trainer_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--parallelism.data_parallel_shard_degree", "2", "--job.dump_folder", str(tmp_path)])
    assert info.value.code == 2
    assert "world size is 1" in capsys.readouterr().err


def test_cpu_offload_without_an_accelerator_is_refused(tmp_path):
    from torchtitan.distributed.data_parallel import apply_data_parallel

    cfg = parse_args(["--training.enable_cpu_offload"], env={})
    with pytest.raises(ConfigError, match="enable_cpu_offload' = true .* no accelerator"):
        apply_data_parallel(torch.nn.Module(), ParallelDims(1, 2, 1, 2), cfg, torch.device("cpu"))


@pytest.mark.parametrize(
    "dims", [ParallelDims(1, 1, 1, 1), ParallelDims(2, 1, 1, 2)], ids=["one-process", "ddp"]
)
def test_cpu_offload_without_fsdp_is_refused_not_ignored(dims):
    from torchtitan.distributed.data_parallel import apply_data_parallel

    cfg = parse_args(["--training.enable_cpu_offload"], env={})
    with pytest.raises(ConfigError, match="enable_cpu_offload' = true .* does not shard them"):
        apply_data_parallel(torch.nn.Module(), dims, cfg, torch.device("cuda"))


def test_tp_with_tied_embeddings_is_refused():
    from torchtitan.models.llama3 import llama3_flavors
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.models.llama3.parallelize import parallelize_llama

    cfg = parse_args(["--model.flavor", "1B", "--parallelism.tensor_parallel_degree", "2"], env={})
    with torch.device("meta"):
        model = Transformer(llama3_flavors["1B"])
    with pytest.raises(ConfigError, match="ties its embeddings"):
        parallelize_llama(model, ParallelDims(1, 1, 2, 2), cfg, torch.device("cpu"))


BF16_PARAMS = ["--training.mixed_precision_param", "bfloat16"]


@pytest.mark.parametrize(
    "dims, expected",
    [
        (ParallelDims(1, 8, 1, 8), "8 rank(s): dp_replicate 1 x dp_shard 8 x tp 1, FSDP; "),
        (ParallelDims(2, 2, 2, 8), "8 rank(s): dp_replicate 2 x dp_shard 2 x tp 2, HSDP; "),
        (ParallelDims(1, 4, 1, 4, ep=2), "4 rank(s): dp_replicate 1 x dp_shard 4 (ep 2) x tp 1, FSDP; "),
        (
            ParallelDims(1, 2, 2, 4, ep=4, etp=1),
            "4 rank(s): dp_replicate 1 x dp_shard 2 x tp 2 (ep 4 = 2 of dp_shard x tp 2), FSDP; ",
        ),
        (ParallelDims(1, 2, 2, 8, pp=2), "8 rank(s): pp 2 x dp_replicate 1 x dp_shard 2 x tp 2, FSDP; "),
        (
            ParallelDims(1, 4, 1, 8, ep=4, cp=2),
            "8 rank(s): dp_replicate 1 x dp_shard 4 x cp 2 x tp 1 (ep 4 = 2 of dp_shard x cp 2), FSDP; ",
        ),
    ],
    ids=["fsdp", "hsdp", "fsdp-ep", "fsdp-tp-ep-over-tp", "pp-fsdp-tp", "fsdp-cp-ep"],
)
def test_layout_line_under_fsdp_names_the_split_and_the_mixed_precision_dtypes(dims, expected):
    from torchtitan.components.training_step import describe_layout

    cfg = parse_args([*BF16_PARAMS, "--training.mixed_precision_reduce", "float32"], env={})
    assert describe_layout(cfg, dims) == expected + "float32 weights, params bfloat16, reduce float32"


@pytest.mark.parametrize(
    "dims, expected",
    [
        (ParallelDims(2, 1, 1, 2), "2 rank(s): dp_replicate 2 x dp_shard 1 x tp 1, DDP; "),
        (ParallelDims(1, 1, 1, 1), "1 rank(s): dp_replicate 1 x dp_shard 1 x tp 1, no data parallelism; "),
    ],
    ids=["ddp", "one-process"],
)
def test_layout_line_without_fsdp_names_the_autocast_dtype(dims, expected):
    from torchtitan.components.training_step import describe_layout

    cfg = parse_args(BF16_PARAMS, env={})
    assert describe_layout(cfg, dims) == expected + "float32 weights, bfloat16 autocast"


@pytest.mark.parametrize(
    "device, cpu_collectives, backend",
    [
        ("cuda", False, "nccl"),
        ("cuda", True, "cuda:nccl,cpu:gloo"),
        ("cpu", False, "gloo"),
        ("cpu", True, "gloo"),
    ],
)
def test_cpu_offload_runs_get_gloo_for_their_cpu_tensors_besides_the_accelerator_backend(
    device, cpu_collectives, backend
):
    """FSDP's CPU offload keeps gradients on the CPU, and their norm is all-reduced there."""
    from torchtitan.distributed.device import backend_for

    assert backend_for(device, cpu_collectives) == backend


def _compile_cache_tag(ep: int) -> str:
    """The compile cache tag rank 0 gets in a fake 4-rank world laid out as FSDP 2 x TP 2."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.components.compile import tag_compile_caches_with_process_groups

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        ParallelDims(1, 2, 2, 4, ep=ep, etp=2).build_mesh("cpu")
        tag_compile_caches_with_process_groups()
        return torch.compiler.config.cache_key_tag
    finally:
        dist.destroy_process_group()
        torch.compiler.config.cache_key_tag = ""


def test_compile_caches_are_keyed_by_the_process_groups_of_the_layout():
    """Compiled graphs name their process groups; another layout numbers its groups otherwise,
    so it must not be handed the first layout's cached graphs."""
    first, again, with_ep = _compile_cache_tag(ep=1), _compile_cache_tag(ep=1), _compile_cache_tag(ep=2)
    assert first.startswith("torchtitan-process-groups-")
    assert first == again and with_ep != first


def _ranks_of_groups(dims: ParallelDims, world_size: int) -> dict[str, list[int]]:
    """Rank 0's groups in a fake world of `world_size` ranks laid out as `dims`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        dims.build_mesh("cpu")
        names = ("cp", "ep", "dp", "dp_shard", "dp_shard_cp", "dp_shard_mod_ep")
        groups = {name: dims.submesh(name).get_group() for name in names}
        groups["cp_exchange"] = dims.cp_exchange_group()
        ranks = {name: dist.get_process_group_ranks(group) for name, group in groups.items()}
        ranks["cp_exchange is a group of its own"] = groups["cp_exchange"] not in (groups["cp"], groups["ep"])
        return ranks
    finally:
        dist.destroy_process_group()


def test_expert_parallelism_under_context_parallelism_takes_the_cp_ranks_into_its_group():
    """FSDP 2 x CP 2 with EP 4: the EP group spans dp_shard and cp; the experts are whole on
    each rank, and the rest is sharded over all four ranks."""
    ranks = _ranks_of_groups(ParallelDims(1, 2, 1, 4, ep=4, cp=2), 4)
    assert ranks["ep"] == [0, 1, 2, 3] and ranks["cp"] == [0, 1] and ranks["dp"] == [0, 2]
    assert ranks["dp_shard_cp"] == [0, 1, 2, 3] and ranks["dp_shard_mod_ep"] == [0]
    assert not ranks["cp_exchange is a group of its own"]


def test_an_ep_group_equal_to_the_cp_group_leaves_context_parallelism_an_exchange_group_of_its_own():
    """EP 2 on CP 2: torch makes one process group for the two, and AC tells CP's all-to-alls
    from EP's by their group; CP's exchanges then run on a copy of the group."""
    ranks = _ranks_of_groups(ParallelDims(1, 2, 1, 4, ep=2, cp=2), 4)
    assert ranks["ep"] == ranks["cp"] == ranks["cp_exchange"] == [0, 1]
    assert ranks["dp_shard_mod_ep"] == ranks["dp_shard"] == ranks["dp"] == [0, 2]
    assert ranks["cp_exchange is a group of its own"]
