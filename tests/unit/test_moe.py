"""MoE layer: routing, expert paths, naive-reference numerics, load balancing, AC and meta init."""

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.model_testing import init_on_cpu
from torchtitan.config import ActivationCheckpoint, ConfigError, parse_args
from torchtitan.distributed import activation_checkpoint as ac_module
from torchtitan.distributed.activation_checkpoint import DEFAULT_SAVE_LIST, apply_ac
from torchtitan.models import get_train_spec
from torchtitan.models.moe import (
    GroupedExperts,
    MoE,
    MoEArgs,
    TokenChoiceTopKRouter,
    load_balance_step,
    pop_aux_loss,
    update_expert_bias,
)
from torchtitan.tools.fqn import clean_fqn
from torchtitan.tools.grouped_mm import grouped_mm_supported
from torchtitan.tools.op_counter import OpCounter, ops

DIM, HIDDEN = 16, 32
OP_SAC = ActivationCheckpoint(mode="selective", selective_ac_option="op")
FULL = ActivationCheckpoint(mode="full")
SCORE_FUNCS = [("softmax", lambda z: F.softmax(z, -1)), ("sigmoid", torch.sigmoid)]


def _moe(seed: int = 0, **overrides) -> MoE:
    """A small MoE with O(1) weights, so that 1e-5 comparisons are not trivially met."""
    args = MoEArgs(**{"num_experts": 8, "top_k": 2, **overrides})
    torch.manual_seed(seed)
    moe = MoE(DIM, HIDDEN, args)
    moe.init_weights(0.02)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.4)
    return moe


def _tokens(*shape, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _router_with_identity_gate(num_experts: int, **overrides) -> TokenChoiceTopKRouter:
    """A router whose gate logits equal its input (dim = num_experts)."""
    router = TokenChoiceTopKRouter(num_experts, MoEArgs(num_experts=num_experts, **overrides))
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(num_experts))
    return router


def test_router_selects_by_biased_scores_but_weights_use_unbiased_scores():
    router = _router_with_identity_gate(4, top_k=1)
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    top_scores, selected, _ = router(logits, expert_bias=torch.tensor([0.0, 0.0, 5.0, 0.0]))
    assert selected.tolist() == [[2]]
    torch.testing.assert_close(top_scores, F.softmax(logits, dim=-1)[:, 2:3])


def test_route_norm_makes_each_tokens_weights_sum_to_one():
    router = _router_with_identity_gate(8, top_k=3, score_func="sigmoid", route_norm=True)
    top_scores, _, _ = router(_tokens(10, 8))
    torch.testing.assert_close(top_scores.sum(dim=-1), torch.ones(10))


@pytest.mark.parametrize("score_func, score", SCORE_FUNCS)
def test_score_func_gives_softmax_or_sigmoid_of_the_gate_logits(score_func, score):
    router = _router_with_identity_gate(8, top_k=3, score_func=score_func, route_scale=2.5)
    logits = _tokens(10, 8)
    top_scores, selected, _ = router(logits)
    torch.testing.assert_close(selected, torch.topk(logits, 3).indices)
    torch.testing.assert_close(top_scores, 2.5 * score(logits).gather(-1, selected))


def test_group_limited_routing_picks_experts_only_from_the_best_groups():
    router = _router_with_identity_gate(16, top_k=4, num_expert_groups=4, num_limited_groups=2)
    logits = _tokens(200, 16)
    _, selected, _ = router(logits)
    top2_sum = torch.topk(F.softmax(logits, -1).view(200, 4, 4), 2, dim=-1).values.sum(dim=-1)
    best_groups = torch.topk(top2_sum, 2, dim=-1).indices
    for token_groups, allowed in zip((selected // 4).tolist(), best_groups.tolist()):
        assert set(token_groups) <= set(allowed)
    assert any(len(set(g)) == 2 for g in (selected // 4).tolist())


def test_token_counts_equal_bincount_of_selections_and_sum_to_tokens_times_k():
    moe = _moe(top_k=3)
    top_scores, selected, counts = moe.router(_tokens(40, DIM))
    assert torch.equal(counts, torch.bincount(selected.flatten(), minlength=8))
    assert counts.sum().item() == 40 * 3
    moe(_tokens(2, 20, DIM, seed=2))
    assert moe.tokens_per_expert.sum().item() == 40 * 3


def test_forced_balance_deals_experts_round_robin_and_weights_them_by_their_scores():
    router = _router_with_identity_gate(8, top_k=3, force_load_balance=True, route_norm=True)
    logits = _tokens(16, 8)
    bias_against_expert_0 = torch.tensor([-9.0] + [9.0] * 7)
    top_scores, selected, counts = router(logits, expert_bias=bias_against_expert_0)
    assert selected[:3].tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 0]]
    assert counts.tolist() == [16 * 3 // 8] * 8
    assert all(len(set(row)) == 3 for row in selected.tolist())
    chosen = F.softmax(logits, -1).gather(-1, selected)
    torch.testing.assert_close(top_scores, chosen / chosen.sum(dim=-1, keepdim=True))


def test_forced_balance_ignores_the_group_limit_and_keeps_the_gates_gradient():
    router = _router_with_identity_gate(
        16, top_k=4, num_expert_groups=4, num_limited_groups=1, force_load_balance=True
    )
    top_scores, selected, counts = router(_tokens(8, 16))
    assert torch.equal(selected.flatten(), torch.arange(32) % 16) and counts.tolist() == [2] * 16
    top_scores.sum().backward()
    assert router.gate.weight.grad.abs().sum() > 0


def _run_args(model: str, flavor: str, *argv: str):
    cfg = parse_args(
        ["--model.name", model, "--model.flavor", flavor, "--training.seq_len", "64", *argv], env={}
    )
    return get_train_spec(model).get_flavor(flavor).update_from_config(cfg)


@pytest.mark.parametrize("model, flavor", [("qwen3", "debugmodel_moe"), ("deepseek_v3", "debugmodel")])
def test_moe_force_load_balance_gives_every_expert_of_every_layer_the_same_tokens(model, flavor):
    args = _run_args(model, flavor, "--model.moe_force_load_balance")
    assert args.moe_args == replace(_run_args(model, flavor).moe_args, force_load_balance=True)
    with torch.device("meta"):
        built = get_train_spec(model).model_cls(args)
    init_on_cpu(built)(torch.randint(0, args.vocab_size, (2, 64)))
    loads = [m.tokens_per_expert for m in built.modules() if isinstance(m, MoE)]
    per_expert = 2 * 64 * args.moe_args.top_k // args.moe_args.num_experts
    assert loads and all(load.tolist() == [per_expert] * args.moe_args.num_experts for load in loads)


def test_moe_force_load_balance_on_a_dense_flavor_is_refused_naming_the_key():
    with pytest.raises(
        ConfigError, match=r"'model.moe_force_load_balance' = true, but llama3 flavor 'debugmodel'"
    ):
        _run_args("llama3", "debugmodel", "--model.moe_force_load_balance")


def _loss_and_grads(module: nn.Module, x: torch.Tensor):
    x = x.clone().requires_grad_()
    out = module(x)
    aux = pop_aux_loss(module)
    (out.square().mean() + (0 if aux is None else aux)).backward()
    grads = {clean_fqn(n): p.grad for n, p in module.named_parameters()}
    return out.detach(), x.grad, grads


@pytest.mark.skipif(not grouped_mm_supported(torch.device("cpu"), torch.float32), reason="no grouped mm")
def test_grouped_mm_path_matches_the_loop_path_in_output_and_grads():
    grouped = _moe(num_shared_experts=1, load_balance_coeff=1e-3)
    with torch.no_grad():
        grouped.expert_bias[0] = -100.0  # expert 0 gets no tokens: an empty group
    looped = copy.deepcopy(grouped)
    looped.experts.use_grouped_mm = False
    x = _tokens(2, 12, DIM)
    assert grouped.experts.uses_grouped_mm(x) and not looped.experts.uses_grouped_mm(x)
    out_g, dx_g, grads_g = _loss_and_grads(grouped, x)
    out_l, dx_l, grads_l = _loss_and_grads(looped, x)
    assert grouped.tokens_per_expert[0] == 0
    torch.testing.assert_close(out_g, out_l, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_g, dx_l, rtol=1e-5, atol=1e-5)
    for name, grad in grads_g.items():
        torch.testing.assert_close(grad, grads_l[name], rtol=1e-5, atol=1e-5, msg=name)


def test_experts_fall_back_to_the_loop_when_rows_are_not_16_byte_aligned():
    experts = GroupedExperts(6, 10, num_experts=3, use_grouped_mm=True)
    experts.init_weights(0.02)
    x = _tokens(9, 6)
    assert not experts.uses_grouped_mm(x)
    looped = copy.deepcopy(experts)
    looped.use_grouped_mm = False
    counts = torch.tensor([4, 0, 5])
    torch.testing.assert_close(experts(x, counts), looped(x, counts), rtol=0, atol=0)


@pytest.mark.skipif(
    not grouped_mm_supported(torch.device("cpu"), torch.bfloat16), reason="no bf16 grouped mm"
)
def test_grouped_experts_under_autocast_run_in_the_autocast_dtype_like_every_linear():
    """The trainer autocasts without FSDP; `torch._grouped_mm` has no autocast kernel, so the
    experts must cast themselves or run in the fp32 of the residual stream."""
    experts = GroupedExperts(DIM, HIDDEN, num_experts=3, use_grouped_mm=True)
    experts.init_weights(0.02)
    x, counts = _tokens(9, DIM), torch.tensor([4, 0, 5])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert experts.uses_grouped_mm(x.bfloat16())
        out = experts(x, counts)
    in_bf16 = copy.deepcopy(experts).bfloat16()(x.bfloat16(), counts)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, in_bf16, rtol=0, atol=0)


def _naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sum over its chosen experts of weight * expert(token), plus shared."""
    a, w1, w2, w3 = moe.args, moe.experts.w1, moe.experts.w2, moe.experts.w3
    out = torch.zeros_like(x.view(-1, DIM))
    for t, token in enumerate(x.view(-1, DIM)):
        logits = moe.router.gate.weight @ token
        scores = torch.sigmoid(logits) if a.score_func == "sigmoid" else torch.softmax(logits, dim=0)
        choice = (scores + moe.expert_bias).view(a.num_expert_groups, -1)
        group_rank = choice.sort(dim=1, descending=True).values[:, :2].sum(dim=1).argsort(descending=True)
        choice[group_rank[a.num_limited_groups :]] = float("-inf")
        chosen = choice.flatten().argsort(descending=True)[: a.top_k]
        weights = scores[chosen] / scores[chosen].sum() * a.route_scale
        for e, weight in zip(chosen.tolist(), weights):
            out[t] += weight * (w2[e] @ (F.silu(w1[e] @ token) * (w3[e] @ token)))
        out[t] += moe.shared_experts(token)
    return out.view_as(x)


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_moe_output_matches_a_naive_per_token_reference(use_grouped_mm):
    moe = _moe(
        num_experts=8,
        top_k=3,
        num_shared_experts=2,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        num_expert_groups=4,
        num_limited_groups=2,
        load_balance_coeff=1e-3,
        use_grouped_mm=use_grouped_mm,
    )
    with torch.no_grad():
        moe.expert_bias.copy_(_tokens(8, seed=3) * 0.3)
    x = _tokens(2, 7, DIM)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _naive_moe(moe, x), rtol=1e-5, atol=1e-5)


def test_sequence_aux_loss_matches_the_per_sequence_formula_and_reaches_the_gate():
    moe = _moe(score_func="sigmoid", seq_aux_loss_coeff=0.01)
    x = _tokens(3, 10, DIM)
    moe(x)
    expected = 0.0
    for seq in x:
        scores = torch.sigmoid(seq @ moe.router.gate.weight.T)
        chosen = torch.topk(scores, 2).indices
        load = torch.bincount(chosen.flatten(), minlength=8) * 8 / (2 * 10)
        expected += (load * (scores / scores.sum(-1, keepdim=True)).mean(0)).sum() / 3
    aux = pop_aux_loss(moe)
    torch.testing.assert_close(aux, 0.01 * expected)
    assert moe.aux_loss is None
    aux.backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0


def test_an_eval_forward_neither_counts_tokens_nor_sets_the_aux_loss():
    # Validation runs the model in eval mode between steps; its tokens must not steer the
    # next expert-bias update, nor its aux loss reach the next backward.
    moe = _moe(seq_aux_loss_coeff=0.01)
    moe.train()
    moe(_tokens(2, 10, DIM))
    counted, aux = moe.tokens_per_expert.clone(), moe.aux_loss
    moe.eval()
    with torch.no_grad():
        moe(_tokens(4, 10, DIM, seed=3))
    assert counted.sum().item() == 2 * 10 * 2
    assert torch.equal(moe.tokens_per_expert, counted)
    assert moe.aux_loss is aux


def test_aux_loss_is_none_when_its_coefficient_is_zero():
    moe = _moe()
    moe(_tokens(1, 4, DIM))
    assert moe.aux_loss is None and pop_aux_loss(moe) is None


def test_bias_update_favors_underloaded_experts_and_resets_counts():
    moe = _moe(num_experts=4, top_k=1, load_balance_coeff=0.1)
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 0.0, 6.0, 4.0]))
    counts = update_expert_bias(nn.Sequential(moe))
    # sign(5 - n) = [-1, 1, -1, 1] sums to 0, so centering changes nothing here.
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.1, 0.1, -0.1, 0.1]))
    assert torch.equal(moe.tokens_per_expert, torch.zeros(4))
    assert {k: v.tolist() for k, v in counts.items()} == {"0": [10.0, 0.0, 6.0, 4.0]}


def test_step_log_reports_the_worst_layers_expert_load_over_the_mean():
    layers = nn.ModuleList([_moe(num_experts=4, top_k=1), _moe(num_experts=4, top_k=1)])
    layers[0].tokens_per_expert.copy_(torch.tensor([10.0, 0.0, 6.0, 4.0]))  # max/mean 2
    layers[1].tokens_per_expert.copy_(torch.tensor([15.0, 5.0, 0.0, 0.0]))  # max/mean 3
    metrics = load_balance_step(layers)
    assert list(metrics) == ["moe_imbalance"]  # no expert parallelism, no per-rank figure
    assert metrics["moe_imbalance"].item() == pytest.approx(3.0)


def test_step_log_under_expert_parallelism_reports_the_busiest_ranks_rows_over_the_mean():
    layers = nn.ModuleList([_moe(num_experts=4, top_k=1), _moe(num_experts=4, top_k=1)])
    for moe in layers:
        moe.experts.num_experts = 2  # as expert parallelism over 2 ranks leaves it
    layers[0].tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 6.0, 6.0]))  # ranks 12, 12
    layers[1].tokens_per_expert.copy_(torch.tensor([10.0, 8.0, 1.0, 1.0]))  # ranks 18, 2
    metrics = load_balance_step(layers)
    assert metrics["moe_imbalance"].item() == pytest.approx(2.0)  # 10 / 5, layer 1
    assert metrics["moe_ep_imbalance"].item() == pytest.approx(1.8)  # 18 / 10, layer 1


def test_bias_update_is_centered_and_skips_layers_without_a_coefficient():
    balanced, unbalanced = _moe(num_experts=4, top_k=1, load_balance_coeff=0.1), _moe(num_experts=4, top_k=1)
    balanced.tokens_per_expert.copy_(torch.tensor([9.0, 1.0, 1.0, 1.0]))
    unbalanced.tokens_per_expert.copy_(torch.tensor([9.0, 1.0, 1.0, 1.0]))
    update_expert_bias(nn.ModuleList([balanced, unbalanced]))
    torch.testing.assert_close(balanced.expert_bias, torch.tensor([-0.15, 0.05, 0.05, 0.05]))
    assert torch.equal(unbalanced.expert_bias, torch.zeros(4))
    assert torch.equal(unbalanced.tokens_per_expert, torch.zeros(4))


class _Block(nn.Module):
    """An MoE block with the interface the AC plan asks blocks for (`DecoderBlock`'s)."""

    is_moe, mlp_name = True, "moe"

    def __init__(self, moe: MoE):
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.moe = moe

    @property
    def mlp(self) -> MoE:
        return self.moe

    @property
    def routed_experts(self) -> nn.Module:
        return self.moe.experts

    def end_linears(self) -> list[nn.Linear]:
        return [m for m in self.moe.modules() if isinstance(m, nn.Linear)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class _Holder(nn.Module):
    def __init__(self, moe: MoE):
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Block(moe)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


def test_gate_is_a_linear_named_moe_router_gate_that_op_sac_force_recomputes():
    holder = _Holder(_moe())
    gate = dict(holder.named_modules())["layers.0.moe.router.gate"]
    assert isinstance(gate, nn.Linear)
    assert ac_module.forced_recompute_linears(holder, ["moe.router.gate"]) == {gate}


@pytest.mark.parametrize("use_grouped_mm", [True, False])
@pytest.mark.parametrize("ac", [OP_SAC, FULL], ids=["op-sac", "full"])
def test_checkpointed_moe_gives_the_same_grads_as_no_checkpoint(ac, use_grouped_mm):
    moe = _moe(num_shared_experts=1, seq_aux_loss_coeff=0.01, load_balance_coeff=1e-3)
    moe.experts.use_grouped_mm = use_grouped_mm
    plain, checkpointed = _Holder(moe), _Holder(copy.deepcopy(moe))
    apply_ac(checkpointed, ac, op_sac_save_list=DEFAULT_SAVE_LIST)
    assert "Checkpoint" in type(checkpointed.layers["0"]).__name__
    x = _tokens(2, 12, DIM)
    out_p, dx_p, grads_p = _loss_and_grads(plain, x)
    out_c, dx_c, grads_c = _loss_and_grads(checkpointed, x)
    assert torch.equal(out_p, out_c) and torch.equal(dx_p, dx_c)
    for name, grad in grads_p.items():
        assert torch.equal(grad, grads_c[name]), name


def _recomputed_grouped_mm(feeds_all_to_all: bool) -> int:
    holder = _Holder(_moe())
    # Planned as for expert parallelism, whose combine all-to-all reads the experts' output.
    ep = 2 if feeds_all_to_all else 1
    apply_ac(holder, OP_SAC, op_sac_save_list=DEFAULT_SAVE_LIST, expert_parallel=ep)
    x = _tokens(2, 12, DIM)
    assert holder.layers["0"].moe.experts.uses_grouped_mm(x)
    loss = holder(x).square().mean()
    # Entered for backward alone: the grouped matmuls run there with grad mode on are a
    # recompute's (the gradients' own run with it off).
    with OpCounter(ops(torch.ops.aten._grouped_mm.default)) as counter:
        loss.backward()
    return counter.count(grad_enabled=True)


def test_without_expert_parallelism_op_sac_recomputes_all_three_expert_matmuls():
    """w2's output is weighted by the routing scores, which backward needs."""
    assert _recomputed_grouped_mm(feeds_all_to_all=False) == 3


def test_experts_whose_output_feeds_an_all_to_all_skip_w2_in_recompute():
    """Under expert parallelism the all-to-all then replays from the cache (see
    tests/integration/test_expert_parallel.py for the gradients, and for the skipped outputs
    filled with NaN)."""
    assert _recomputed_grouped_mm(feeds_all_to_all=True) == 2


def test_recompute_neither_recounts_tokens_nor_resets_the_aux_loss():
    holder = _Holder(_moe(seq_aux_loss_coeff=0.01))
    apply_ac(holder, FULL)
    moe = holder.layers["0"]._checkpoint_wrapped_module.moe
    out = holder(_tokens(2, 12, DIM))
    aux = moe.aux_loss
    (out.sum() + aux).backward()
    assert moe.tokens_per_expert.sum().item() == 2 * 12 * 2
    assert moe.aux_loss is aux


ROUTING_AC = {
    "full, all-to-alls reissued": FULL,
    "full, all-to-alls replayed": ActivationCheckpoint(mode="full", full_ac_all_to_all="replay"),
    "full, no early stop": ActivationCheckpoint(mode="full", early_stop=False),
    "selective 1": ActivationCheckpoint(mode="selective", selective_ac_option="1"),
    "selective op": OP_SAC,
}


@pytest.mark.parametrize("ac", list(ROUTING_AC))
def test_recompute_replays_the_forward_routing_even_when_the_router_changed_in_between(ac):
    """Between forward and backward, the expert bias is changed so that a recomputed router
    would send every token elsewhere; the gradients must still be those of the forward's routing."""
    moe = _moe(num_shared_experts=1, load_balance_coeff=1e-3)
    plain, checkpointed = _Holder(moe), _Holder(copy.deepcopy(moe))
    apply_ac(checkpointed, ROUTING_AC[ac], op_sac_save_list=DEFAULT_SAVE_LIST)
    x = _tokens(2, 12, DIM)
    out_p, dx_p, grads_p = _loss_and_grads(plain, x)
    moved = checkpointed.layers["0"]
    moved = getattr(moved, "_checkpoint_wrapped_module", moved).moe
    x_c = x.clone().requires_grad_()
    out_c = checkpointed(x_c)
    moved.expert_bias.copy_(torch.tensor([0.0] * 7 + [100.0]))
    out_c.square().mean().backward()
    assert torch.equal(out_p, out_c.detach()) and torch.equal(dx_p, x_c.grad)
    grads_c = {clean_fqn(n): p.grad for n, p in checkpointed.named_parameters()}
    for name, grad in grads_p.items():
        assert torch.equal(grad, grads_c[name]), name


def test_plain_checkpoint_would_silently_route_differently_when_the_router_changed():
    """The check above can fail: without saved routing the same change alters the gradients."""
    from torch.utils.checkpoint import checkpoint

    moe = _moe(load_balance_coeff=1e-3)
    x = _tokens(2, 12, DIM)
    _, _, grads_plain = _loss_and_grads(moe, x)
    moe.zero_grad()
    out = checkpoint(moe, x, use_reentrant=False)
    moe.expert_bias.copy_(torch.tensor([0.0] * 7 + [100.0]))
    out.square().mean().backward()
    assert not torch.allclose(moe.experts.w1.grad, grads_plain["experts.w1"])


def test_meta_construction_then_to_empty_and_init_weights_gives_finite_outputs():
    with torch.device("meta"):
        moe = MoE(DIM, HIDDEN, MoEArgs(num_experts=8, top_k=2, num_shared_experts=1, load_balance_coeff=1e-3))
    moe.to_empty(device="cpu")
    torch.manual_seed(0)
    moe.init_weights(0.02)
    assert torch.equal(moe.expert_bias, torch.zeros(8)) and torch.equal(moe.tokens_per_expert, torch.zeros(8))
    out = moe(_tokens(2, 5, DIM))
    assert out.shape == (2, 5, DIM) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "overrides",
    [
        {"top_k": 9},
        {"score_func": "relu"},
        {"num_expert_groups": 3, "num_limited_groups": 1},
        {"num_expert_groups": 4},
        {"num_expert_groups": 4, "num_limited_groups": 1, "top_k": 3},
    ],
)
def test_inconsistent_args_are_refused(overrides):
    with pytest.raises(ValueError):
        MoEArgs(**{"num_experts": 8, **overrides})


def test_a_skipped_output_that_something_reads_shows_as_nan(monkeypatch):
    """What tests/integration/test_expert_parallel.py's NaN check would see if a skipped matmul's
    output were read: planned for expert parallelism but run without it, no all-to-all replays
    the experts' output, the weighting by the routing scores reads it, and the NaN reaches the
    gradients."""
    holder = _Holder(_moe())
    apply_ac(holder, OP_SAC, op_sac_save_list=DEFAULT_SAVE_LIST, expert_parallel=2)
    skipped = ac_module._matmul_output

    def nan_filled(func, args, kwargs):
        out = skipped(func, args, kwargs)
        return None if out is None else out.fill_(float("nan"))

    monkeypatch.setattr(ac_module, "_matmul_output", nan_filled)
    holder(_tokens(2, 12, DIM)).square().mean().backward()
    assert not all(torch.isfinite(p.grad).all() for p in holder.parameters() if p.grad is not None)
