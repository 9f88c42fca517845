"""The pipeline split: which modules each stage holds, which stages a rank runs, what is refused,
and that a stage computes and initializes what the whole model does for its part."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleZBVZeroBubble,
    _PipelineScheduleRuntime,
)
from torch.utils.checkpoint import checkpoint

from torchtitan.config import ConfigError, parse_args
from torchtitan.distributed.activation_checkpoint import DEFAULT_SAVE_LIST, op_sac_context_fn
from torchtitan.distributed.pipeline_parallel import (
    PipelinePlan,
    check_pipeline_supported,
    describe_pipeline,
    merged_model,
    prune_to_stage,
    split_module_names,
    splits_backward,
)
from torchtitan.models import get_train_spec

_P = "--parallelism."


def _plan(*argv: str, n_layers: int = 6, pp: int = 2, rank: int = 0) -> PipelinePlan:
    cfg = parse_args(["--training.local_batch_size", "4", *argv], env={})
    return PipelinePlan.from_config(cfg, n_layers, pp, rank)


def test_the_embedding_and_head_count_as_layers_so_the_end_stages_hold_fewer_blocks():
    assert split_module_names(6, 2, 1, 1) == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2"],
        ["layers.3", "layers.4", "layers.5", "norm", "output"],
    ]


def test_a_remainder_of_blocks_goes_to_the_middle_stages_first():
    sizes = [sum(n.startswith("layers.") for n in names) for names in split_module_names(9, 4, 1, 1)]
    assert sizes == [2, 3, 3, 1]


def test_every_block_is_in_exactly_one_stage_in_order():
    names = [n for stage in split_module_names(13, 8, 1, 1) for n in stage if n.startswith("layers.")]
    assert names == [f"layers.{i}" for i in range(13)]


def test_an_end_stage_may_hold_only_the_embedding_or_the_head():
    stages = split_module_names(6, 8, 1, 1)
    assert stages[0] == ["tok_embeddings"] and stages[-1] == ["norm", "output"]


def test_a_middle_stage_without_a_block_is_refused_naming_the_keys():
    with pytest.raises(ConfigError, match="a stage would hold no block.*pipeline_parallel_layers_per_stage"):
        split_module_names(2, 6, 1, 1)


def test_a_single_stage_schedule_gives_each_rank_one_stage():
    plan = _plan(rank=1)
    assert plan.schedule is Schedule1F1B and plan.num_stages == 2 and plan.stage_ids == (1,)
    assert plan.n_microbatches == 4


def test_a_looped_schedule_gives_rank_r_the_stages_r_r_plus_pp_and_so_on():
    plan = _plan(_P + "pipeline_parallel_schedule", "Interleaved1F1B", rank=1)
    assert plan.num_stages == 4 and plan.stage_ids == (1, 3)


def test_a_v_schedule_gives_rank_r_the_stages_r_and_2pp_minus_1_minus_r():
    plan = _plan(_P + "pipeline_parallel_schedule", "ZBVZeroBubble", rank=0)
    assert plan.schedule is ScheduleZBVZeroBubble and plan.stage_ids == (0, 3)


def test_layers_per_stage_sets_the_number_of_stages():
    plan = _plan(
        _P + "pipeline_parallel_schedule", "Interleaved1F1B", _P + "pipeline_parallel_layers_per_stage", "1"
    )
    assert plan.num_stages == 8 and plan.stage_ids == (0, 2, 4, 6)


@pytest.mark.parametrize(
    "argv, message",
    [([_P + "pipeline_parallel_schedule", "2F2B"], "'2F2B' is not a schedule"),
     ([_P + "pipeline_parallel_microbatch_size", "3"], "does not divide 'training.local_batch_size' = 4"),
     ([_P + "pipeline_parallel_layers_per_stage", "1"], "'1F1B' runs one stage per rank, but"),
     ([_P + "pipeline_parallel_schedule", "LoopedBFS", _P + "pipeline_parallel_layers_per_stage", "4"],
      "runs several stages per rank, but the split makes 1"),
     ([_P + "pipeline_parallel_schedule", "DualPipeV", _P + "pipeline_parallel_layers_per_stage", "1"],
      "V schedule and needs exactly 2 stages per rank, but the split makes 4"),
     ([_P + "pipeline_parallel_layers_per_stage", "3"], "3 pipeline stages do not divide over"),
     ([_P + "module_fqns_per_model_part", "tok_embeddings,layers.0;layers.0,norm"],
      "'layers.0' is in more than one stage; 'layers.1' is in no stage")],
    ids=["unknown schedule", "microbatch", "one stage per rank", "several per rank", "V with 4 per rank",
         "stages over ranks", "module names"],
)  # fmt: skip
def test_a_pipeline_that_cannot_work_is_refused_naming_the_key(argv, message):
    with pytest.raises(ConfigError, match=message):
        _plan(*argv)


def test_module_names_per_stage_override_the_split():
    parts = "tok_embeddings,layers.0,layers.1;layers.2,layers.3,layers.4,layers.5,norm,output"
    plan = _plan(_P + "module_fqns_per_model_part", parts, rank=1)
    assert plan.modules_per_stage[1] == ["layers.2", "layers.3", "layers.4", "layers.5", "norm", "output"]


def test_a_csv_schedule_runs_on_torchs_runtime_with_the_named_schedules_stage_count(tmp_path):
    (csv := tmp_path / "schedule.csv").write_text("0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0\n")
    plan = _plan(
        _P + "pipeline_parallel_schedule", "Interleaved1F1B", _P + "pipeline_parallel_schedule_csv", str(csv)
    )
    assert plan.schedule is _PipelineScheduleRuntime and plan.num_stages == 4


def test_a_csv_schedule_that_cannot_be_read_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="'parallelism.pipeline_parallel_schedule_csv' = .* cannot be read"):
        _plan(_P + "pipeline_parallel_schedule_csv", str(tmp_path / "missing.csv"))


@pytest.mark.parametrize("actions, splits", [("0F0,0B0", False), ("0F0,0I0,0W0", True)])
def test_a_csv_schedule_splits_backward_when_it_has_input_or_weight_actions(tmp_path, actions, splits):
    (csv := tmp_path / "schedule.csv").write_text(actions + "\n")
    argv = [_P + "pipeline_parallel_degree", "2", _P + "pipeline_parallel_schedule_csv", str(csv)]
    assert splits_backward(parse_args(argv, env={})) is splits


@pytest.mark.parametrize(
    "schedule, splits", [("1F1B", False), ("Interleaved1F1B", False), ("ZBVZeroBubble", True),
                         ("DualPipeV", True), ("InterleavedZeroBubble", True)],
)  # fmt: skip
def test_zero_bubble_schedules_are_the_ones_that_split_backward(schedule, splits):
    cfg = parse_args(
        [_P + "pipeline_parallel_degree", "2", _P + "pipeline_parallel_schedule", schedule], env={}
    )
    assert splits_backward(cfg) is splits


def test_the_log_line_names_the_schedule_and_this_ranks_stages_with_their_modules():
    plan = _plan(_P + "pipeline_parallel_schedule", "ZBVZeroBubble", rank=0)
    assert describe_pipeline(plan, 0) == (
        "Pipeline: ScheduleZBVZeroBubble, 4 microbatches, 4 stages; pipeline rank 0 runs stage 0 "
        "(tok_embeddings, layers.0); stage 3 (layers.5, norm, output)"
    )


def _llama(n_layers: int = 4) -> nn.Module:
    spec = get_train_spec("llama3")
    cfg = parse_args(["--config", "debug_model.toml"], env={})
    args = spec.get_flavor("debugmodel").update_from_config(cfg)
    args = type(args)(**{**args.__dict__, "n_layers": n_layers})
    torch.manual_seed(0)
    return spec.build_meta_model(args, torch.float32).to_empty(device="cpu")


def _init(model: nn.Module) -> nn.Module:
    torch.manual_seed(7)
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


def test_a_stage_is_initialized_as_the_whole_model_initializes_its_part():
    whole = _init(_llama())
    stage = _init(prune_to_stage(_llama(), ["layers.2", "layers.3", "norm", "output"]))
    want = dict(whole.named_parameters())
    for name, param in stage.named_parameters():
        assert torch.equal(param, want[name]), name


def test_stages_run_one_after_another_compute_the_whole_models_logits():
    whole = _init(_llama())
    first = _init(prune_to_stage(_llama(), ["tok_embeddings", "layers.0", "layers.1"]))
    last = _init(prune_to_stage(_llama(), ["layers.2", "layers.3", "norm", "output"]))
    tokens = torch.randint(0, whole.args.vocab_size, (2, 16))
    torch.testing.assert_close(last(first(tokens)), whole(tokens), rtol=0, atol=0)


def test_the_merged_module_has_the_whole_models_names_for_this_ranks_stages():
    stages = [
        prune_to_stage(_llama(), ["tok_embeddings", "layers.0"]),
        prune_to_stage(_llama(), ["layers.3"]),
    ]
    names = {name for name, _ in merged_model(stages).named_parameters()}
    want = {
        name
        for name, _ in _llama().named_parameters()
        if name.startswith(("tok_embeddings", "layers.0.", "layers.3."))
    }
    assert names == want


def test_merged_module_shares_the_stages_parameters_rather_than_copying_them():
    stage = prune_to_stage(_llama(), ["tok_embeddings", "layers.0"])
    assert merged_model([stage]).layers["0"] is stage.layers["0"]


@pytest.mark.parametrize(
    "argv, what",
    [(["--optimizer.early_step_in_backward", "--training.max_norm", "0"], "optimizer.early_step_in_backward"),
     (["--model.attn_backend", "flex"], "the flex attention backend")],
)  # fmt: skip
def test_what_pipeline_parallelism_does_not_run_with_yet_is_refused(argv, what):
    cfg = parse_args(["--config", "debug_model.toml", _P + "pipeline_parallel_degree", "2", *argv], env={})
    args = get_train_spec("llama3").get_flavor("debugmodel").update_from_config(cfg)
    with pytest.raises(ConfigError, match=f"does not run with {what}.*or set pipeline_parallel_degree = 1"):
        check_pipeline_supported(cfg, args, ddp=False)


def _split_backward_grads(keep: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Input then weight gradients of a small MLP in two backward passes, as a zero-bubble
    stage takes them; op-SAC (kept or not) around the MLP, or no AC (None)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16, bias=False), nn.SiLU(), nn.Linear(16, 8, bias=False))
    x = torch.randn(4, 8, requires_grad=True)
    if keep is None:
        out = mlp(x)
    else:
        context_fn = op_sac_context_fn(DEFAULT_SAVE_LIST, keep=keep)
        out = checkpoint(mlp, x, use_reentrant=False, context_fn=context_fn)
    loss = out.square().sum()
    (input_grad,) = torch.autograd.grad(loss, x, retain_graph=True)
    weight_grad = torch.autograd.grad(loss, mlp[0].weight)[0]
    return input_grad, weight_grad


def test_op_sac_that_keeps_its_cache_gives_the_split_backward_the_gradients_without_ac():
    for got, want in zip(_split_backward_grads(keep=True), _split_backward_grads(keep=None)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_torchs_sac_cache_alone_refuses_the_second_backward_pass():
    with pytest.raises(RuntimeError, match="backward an extra time"):
        _split_backward_grads(keep=False)


def test_resharding_after_forward_under_a_split_backward_with_fsdp_is_refused():
    argv = [_P + "pipeline_parallel_degree", "2", _P + "pipeline_parallel_schedule", "ZBVZeroBubble",
            _P + "fsdp_reshard_after_forward", "always"]  # fmt: skip
    cfg = parse_args(["--config", "debug_model.toml", *argv], env={})
    args = get_train_spec("llama3").get_flavor("debugmodel").update_from_config(cfg)
    with pytest.raises(ConfigError, match="wrong gradients.*set fsdp_reshard_after_forward = 'default'"):
        check_pipeline_supported(cfg, args, ddp=False)
