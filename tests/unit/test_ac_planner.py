"""Mode "auto": the per-block plan string, the plan class that applies it, the exact solver,
and the trainer's saved plan. The estimator's measurements are in
tests/integration/test_ac_auto.py."""

import itertools
import json
import random

import pytest
import torch

from tests.model_testing import next_token_loss_and_grads, tiny_deepseek_v3, tiny_llama3, tiny_qwen3
from torchtitan.components import ac_auto
from torchtitan.config import ActivationCheckpoint, ConfigError, JobConfig
from torchtitan.distributed.ac_planner import (
    BLOCK_CHOICES,
    BlockCost,
    BlockPlan,
    BlockWork,
    RankCosts,
    RecomputeRates,
    solve,
)
from torchtitan.distributed.activation_checkpoint import (
    OFFLOAD_CHOICES,
    ACFacts,
    NothingFits,
    PerBlockAC,
    apply_ac,
    format_block_plan,
    in_selective_checkpoint,
    parse_block_plan,
    plan_activation_checkpointing,
)
from torchtitan.models.moe import MoEArgs
from torchtitan.tools.activation_memory import bytes_held_for_backward
from torchtitan.tools.op_counter import OpCounter, RecomputeCost

MiB = 2**20
GRANULE = MiB


# ----- the plan string ------------------------------------------------------------------------


def test_a_plan_string_names_each_block_once_with_ranges():
    plan = parse_block_plan("none:0-3; op:4-5,8; full:6-7")
    assert plan == {
        0: "none",
        1: "none",
        2: "none",
        3: "none",
        4: "op",
        5: "op",
        8: "op",
        6: "full",
        7: "full",
    }
    assert format_block_plan(plan) == "none:0-3; op:4-5,8; full:6-7"


@pytest.mark.parametrize(
    "spec, complaint",
    [("some:0-3", "invalid at 'some:0-3'"), ("op 0-3", "invalid at 'op 0-3'"), ("op:all", "invalid"),
     ("op:3-1", "bad block indices in 'op:3-1'"), ("op:0-2; full:2", "names block 2 twice")],
)  # fmt: skip
def test_a_malformed_plan_string_is_refused_naming_the_key_and_the_syntax(spec, complaint):
    with pytest.raises(ConfigError, match="'activation_checkpoint.auto_plan'") as error:
        parse_block_plan(spec)
    assert complaint in str(error.value)


def test_mode_auto_without_a_plan_is_refused_where_blocks_are_wrapped():
    with pytest.raises(ConfigError, match="without a plan.*estimate_memory.py --plan"):
        plan_activation_checkpointing(ActivationCheckpoint(mode="auto"), ACFacts())


def test_mode_auto_with_the_offload_key_is_refused_since_its_plan_chooses_offload():
    config = ActivationCheckpoint(mode="auto", auto_plan="op:0-1", offload="saved")
    with pytest.raises(ConfigError, match='mode auto chooses offload per block itself.*offload = "none"'):
        plan_activation_checkpointing(config, ACFacts())


@pytest.mark.parametrize(
    "facts, fix",
    [(ACFacts(compile_enabled=True), "compile.enable = false"),
     (ACFacts(split_backward=True), 'pipeline_parallel_schedule = "1F1B"')],
)  # fmt: skip
def test_a_plan_that_offloads_where_offload_cannot_run_is_refused_naming_the_plan(facts, fix):
    config = ActivationCheckpoint(mode="auto", auto_plan="op_offload:0; full:1")
    with pytest.raises(
        ConfigError, match="'activation_checkpoint.auto_plan' = 'op_offload:0; full:1'"
    ) as error:
        plan_activation_checkpointing(config, facts)
    assert fix in str(error.value) and "a plan without op_offload and full_offload" in str(error.value)


# ----- the plan class -------------------------------------------------------------------------


def _auto(spec: str) -> ActivationCheckpoint:
    # Every tensor offloads, however small: the tiny models' are all under the default 1 MiB.
    return ActivationCheckpoint(mode="auto", auto_plan=spec, offload_min_bytes=0)


def test_each_block_gets_the_wrapping_its_choice_names(caplog):
    model = tiny_llama3(n_layers=3)
    with caplog.at_level("INFO"):
        plan = apply_ac(model, _auto("none:0; op:1; full:2"))
    assert isinstance(plan, PerBlockAC)
    assert type(model.layers["0"]).__name__ == "TransformerBlock"
    assert type(model.layers["2"]).__name__ == "CheckpointWrapper"
    assert (
        "mode auto, no AC on 1/3 blocks: 0, op-SAC on 1/3 blocks: 1, full AC on 1/3 blocks: 2" in caplog.text
    )


def test_regions_checkpoint_each_norm_rope_and_gate_of_the_block_and_hold_less_than_none():
    def held(spec: str) -> int:
        model = tiny_llama3(n_layers=1)
        apply_ac(model, _auto(spec))
        block = model.layers["0"]
        h = torch.randn(2, 16, 32, requires_grad=True)
        return bytes_held_for_backward(block, h, model.rope_cache[:16])

    model = tiny_llama3(n_layers=1)
    names = {type(m).__name__ for m in model.layers["0"].cheap_regions()}
    assert names == {"RMSNorm", "Rotary", "SwiGLU"}
    assert held("full:0") < held("op_all_mm:0") < held("op:0") < held("regions:0") < held("none:0")


@pytest.mark.parametrize("choice", ["op", "full"])
def test_an_offloading_choice_keeps_on_the_device_what_its_choice_keeps_less_what_it_offloads(choice):
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(5))

    def held_and_offloaded(spec: str) -> tuple[int, int]:
        model = tiny_llama3(n_layers=2)
        plan = apply_ac(model, _auto(spec))
        offloader = plan.offloader
        # A first step fills the host pool; the measured forward reuses its buffers, so what is
        # measured is the device side alone.
        next_token_loss_and_grads(model, tokens)
        before = offloader.bytes_total if offloader else 0
        h = torch.randn(2, 16, 32, requires_grad=True)
        pool = offloader.pool.free_buffer_tensors() if offloader else []
        held = bytes_held_for_backward(model.layers["1"], h, model.rope_cache[:16], elsewhere=pool)
        return held, (offloader.bytes_total if offloader else 0) - before

    kept, _ = held_and_offloaded(f"none:0; {choice}:1")
    kept_offloading, offloaded = held_and_offloaded(f"none:0; {choice}_offload:1")
    assert offloaded > 0
    assert kept - kept_offloading == offloaded


def test_an_offloading_plan_logs_which_blocks_offload(caplog):
    with caplog.at_level("INFO"):
        apply_ac(tiny_llama3(n_layers=3), _auto("op_offload:0; full_offload:1; none:2"))
    assert "offload of saved tensors of 0 bytes or more on 2/3 blocks: 0, 1" in caplog.text


def test_a_block_the_plan_does_not_name_is_refused():
    with pytest.raises(ConfigError, match="names no choice for block 1"):
        apply_ac(tiny_llama3(), _auto("op:0"))


FAMILIES = {
    "llama3": lambda: tiny_llama3(n_layers=3),
    "qwen3 moe": lambda: tiny_qwen3(n_layers=3, moe_args=MoEArgs(num_experts=4, top_k=2), moe_hidden_dim=16),
    "deepseek v3": lambda: tiny_deepseek_v3(),
}


@pytest.mark.parametrize(
    "spec", ["none:0; op:1; full:2", "regions:0-1; op_all_mm:2", "op_offload:0-1; full_offload:2"]
)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixed_plan_gives_the_no_ac_loss_and_gradients(family, spec):
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(5))
    model = FAMILIES[family]()
    apply_ac(model, ActivationCheckpoint(mode="none"))
    want_loss, want_grads = next_token_loss_and_grads(model, tokens)
    model = FAMILIES[family]()
    plan = apply_ac(model, _auto(spec))
    loss, grads = next_token_loss_and_grads(model, tokens)
    assert ("offload" in spec) == (plan.offloader is not None and plan.offloader.bytes_total > 0)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-6, atol=1e-7, msg=name)


# ----- the solver -----------------------------------------------------------------------------


# The choices that recompute and do not offload: a CPU run's.
RECOMPUTE_CHOICES = tuple(c for c in BLOCK_CHOICES if c not in OFFLOAD_CHOICES)
# Prices that make a block's recompute time its FLOPs, in seconds.
FLOPS_AS_SECONDS = RecomputeRates(tflops=1e-12, memory_gbps=1.0, host_us_per_op=0.0, host_us_per_rerun=0.0)


def _costs(blocks: list[tuple[int, ...]], in_flight: float = 1, label: str = "") -> RankCosts:
    """Blocks as (held none, held op, held full, op recompute, full recompute), in MiB and FLOPs,
    optionally followed by (held regions, regions recompute) and (held op_all_mm, op_all_mm
    recompute); left out, regions saves nothing and costs 1, and op_all_mm saves what op does
    for 1 more. The peaks follow from them with 100 MiB of other memory and `in_flight` forwards
    held at once (a pipeline rank's microbatches; below 1 where a probe counts bytes the peak
    never sees). A block's recompute time is its FLOPs (`FLOPS_AS_SECONDS`)."""
    costs = []
    for i, (n, o, f, ro, rf, *more) in enumerate(blocks):
        r, rr, a, ra = (more + [n, 1] if len(more) < 2 else more) + ([o, ro + 1] if len(more) < 4 else [])
        held = {"none": n, "regions": r, "op": o, "op_all_mm": a, "full": f}
        recompute = {"none": 0, "regions": rr, "op": ro, "op_all_mm": ra, "full": rf}
        costs.append(
            BlockCost(i, held={c: held[c] * MiB for c in RECOMPUTE_CHOICES},
                      work={c: BlockWork(flops, recompute_flops=flops) for c, flops in recompute.items()})
        )  # fmt: skip
    peak = {c: 100 * MiB + round(in_flight * sum(b.held[c] for b in costs)) for c in RECOMPUTE_CHOICES}
    return RankCosts(label, peak, tuple(costs), FLOPS_AS_SECONDS)


def _random_costs(seed: int, n: int = 6, in_flight: int = 1) -> RankCosts:
    rng = random.Random(seed)
    blocks = []
    for _ in range(n):
        none = rng.randint(20, 60)
        op, full = rng.randint(5, none - 5), rng.randint(0, 4)
        op_flops = rng.randint(1, 50)
        full_flops = op_flops + rng.randint(1, 80)
        regions, all_mm = rng.randint(op + 1, none), rng.randint(full, op)
        blocks.append((none, op, full, op_flops, full_flops, regions, rng.randint(0, op_flops), all_mm,
                       rng.randint(op_flops, full_flops)))  # fmt: skip
    return _costs(blocks, in_flight)


def _brute_force(costs: RankCosts, budget: int) -> float:
    """The least recompute time over every plan whose modelled peak fits, by enumeration."""
    best = None
    for combo in itertools.product(costs.choices, repeat=len(costs.blocks)):
        choices = {b.index: c for b, c in zip(costs.blocks, combo)}
        if costs.estimated_peak(choices) <= budget:
            seconds = costs.added_seconds(choices)
            best = seconds if best is None else min(best, seconds)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("in_flight", [0.4, 1, 3])
def test_the_solver_finds_the_least_recompute_time_that_fits_as_enumeration_does(seed, in_flight):
    costs = _random_costs(seed, n=5, in_flight=in_flight)
    for fraction in (0.0, 0.2, 0.5, 0.8, 1.0):
        budget = round(costs.peak["full"] + fraction * (costs.peak["none"] - costs.peak["full"]))
        choices = solve(costs, budget)
        assert costs.estimated_peak(choices) <= budget
        assert costs.added_seconds(choices) == pytest.approx(_brute_force(costs, budget)), (
            seed,
            fraction,
        )


@pytest.mark.parametrize("choice", ["regions", "op", "full"])
def test_at_a_uniform_plans_own_peak_the_solver_recomputes_no_more_than_it(choice):
    # Savings split into thirds of a unit: rounding down alone would miss the uniform plan.
    costs = _costs([(40, 13, 3, 7, 11, 31, 2)] * 3 + [(35, 11, 2, 6, 10, 28, 2)] * 4)
    uniform = dict.fromkeys(range(7), choice)
    choices = solve(costs, costs.peak[choice])
    assert costs.estimated_peak(choices) <= costs.peak[choice]
    assert costs.added_seconds(choices) <= costs.added_seconds(uniform)


def test_a_larger_budget_never_plans_more_recompute_time():
    costs = _random_costs(11, n=24)
    budgets = range(costs.peak["full"], costs.peak["none"] + 4 * GRANULE, 7 * GRANULE)
    recompute = [costs.added_seconds(solve(costs, budget)) for budget in budgets]
    assert recompute == sorted(recompute, reverse=True)
    assert recompute[0] > 0 and recompute[-1] == 0


def _block_at_ops_peak(none: BlockWork, op: BlockWork, full: BlockWork, rates) -> dict[int, str]:
    """The plan of one block at op-SAC's peak, with `none`, `op` and `full`'s work in it."""
    held = {"none": 40 * MiB, "regions": 40 * MiB, "op": 10 * MiB, "op_all_mm": 10 * MiB, "full": 2 * MiB}
    work = {"none": none, "regions": none, "op": op, "op_all_mm": op, "full": full}
    block = BlockCost(0, held, work)
    peak = {c: 100 * MiB + block.held[c] for c in RECOMPUTE_CHOICES}
    return solve(RankCosts("", peak, (block,), rates), peak["op"])


def test_host_time_costs_where_it_exceeds_the_blocks_device_time():
    # 1 ms per op dispatched, 1 ms per GFLOP. op-SAC recomputes half of full AC's FLOPs but
    # dispatches 8 more ops, full AC 3 more.
    rates = RecomputeRates(tflops=1.0, memory_gbps=1.0, host_us_per_op=1000.0, host_us_per_rerun=0.0)
    assert rates.seconds(BlockWork(flops=2 * 10**9, host_ops=5)) == pytest.approx(0.005)
    assert rates.seconds(BlockWork(flops=5 * 10**9, host_ops=2)) == pytest.approx(0.005)

    def plan(forward_gflop: int) -> str:
        g = 10**9
        none = BlockWork(flops=3 * forward_gflop * g, host_ops=10)
        op = BlockWork(flops=int(3.5 * forward_gflop * g), host_ops=18)
        full = BlockWork(flops=4 * forward_gflop * g, host_ops=13)
        return _block_at_ops_peak(none, op, full, rates)[0]

    # Short kernels (1 ms a forward): the host is the longer, and op-SAC's ops cost more than
    # full AC's FLOPs.
    assert plan(forward_gflop=1) == "full"
    # Long kernels (100 ms a forward): the device is the longer, and hides the host.
    assert plan(forward_gflop=100) == "op"


def test_a_budget_below_full_ac_is_refused_with_its_peak_and_what_to_change():
    costs = _costs([(40, 10, 2, 5, 9)] * 4, label="pp 0")
    with pytest.raises(
        NothingFits, match=r"full AC on every block needs 0\.11 GiB per device on pp 0"
    ) as error:
        solve(costs, costs.peak["full"] - 1)
    assert "tensor_parallel_degree" in str(error.value) and "local_batch_size" in str(error.value)


def test_exposed_copy_time_is_what_the_neighbouring_forward_and_backward_do_not_hide():
    rates = RecomputeRates(
        tflops=1.0, memory_gbps=1.0, host_us_per_op=0.0, host_us_per_rerun=0.0, offload_gbps=1.0
    )
    # 3 s of compute per block: its copy out hides behind 1 s of forward, its copy back behind 2 s
    # of backward.
    for gigabytes, exposed in ((0.5, 0.0), (1.0, 0.0), (1.5, 0.5), (3.0, 3.0)):
        work = BlockWork(offloaded_bytes=round(gigabytes * 1e9))
        assert rates.exposed_copy_seconds(work, compute_seconds=3.0) == pytest.approx(exposed), gigabytes


def _offloading_costs(offload_gbps: float, blocks: int = 4) -> RankCosts:
    """`blocks` equal blocks of 1 s of compute without AC (1 TFLOP at 1 TFLOP/s), with every
    choice. op-SAC with offload sends what op-SAC keeps and the block's 1 MiB input to the host
    (9 MiB a forward, 1 GB a step) and recomputes op-SAC's 0.2 s; full AC recomputes 0.3 s, and
    with offload sends its input (0.1 GB a step)."""
    g = 10**12
    held = {
        "none": 40,
        "regions": 38,
        "op": 10,
        "op_all_mm": 8,
        "op_offload": 2,
        "full": 2,
        "full_offload": 2,
    }
    per_forward = {"op_offload": 9 * MiB, "full_offload": MiB}
    flops = {"none": g, "regions": g, "op": 1.2 * g, "op_all_mm": 1.25 * g, "op_offload": 1.2 * g,
             "full": 1.3 * g, "full_offload": 1.3 * g}  # fmt: skip
    per_step = {"op_offload": 10**9, "full_offload": 10**8}
    work = {c: BlockWork(flops=int(f), offloaded_bytes=per_step.get(c, 0)) for c, f in flops.items()}
    costs = tuple(
        BlockCost(i, {c: n * MiB for c, n in held.items()}, work, per_forward) for i in range(blocks)
    )
    peak = {c: 100 * MiB + blocks * (40 * MiB - costs[0].held_less(c)) for c in held}
    rates = RecomputeRates(1.0, 1.0, host_us_per_op=0.0, host_us_per_rerun=0.0, offload_gbps=offload_gbps)
    return RankCosts("", peak, costs, rates)


def test_an_offloading_choice_holds_less_by_all_it_offloads_the_input_included():
    block = _offloading_costs(offload_gbps=10.0).blocks[0]
    assert block.held_less("op") == 30 * MiB and block.held_less("full") == 38 * MiB
    # What op-SAC keeps (8 MiB) and the block's input (1 MiB) leave the device.
    assert block.held_less("op_offload") == block.held_less("full_offload") == 39 * MiB


def test_the_planner_offloads_where_compute_hides_the_copies_and_recomputes_where_it_does_not():
    fast = _offloading_costs(offload_gbps=10.0)
    budget = fast.peak["full"]
    # 10 GB/s: the 1 GB takes 0.1 s each way, under the 0.33 s forward and the 0.67 s backward.
    assert set(solve(fast, budget).values()) == {"op_offload"}
    # 1 GB/s: 1 s each way, of which 0.67 + 0.33 s is exposed; full AC with offload costs full
    # AC's recompute, its 0.1 GB hidden, and the tie goes to full AC, which saves less.
    slow = _offloading_costs(offload_gbps=1.0)
    assert slow.seconds(slow.blocks[0], "op_offload") == pytest.approx(0.2 + 1.0)
    assert set(solve(slow, budget).values()) == {"full"}


def test_full_ac_with_offload_is_the_floor_and_the_refusal_names_it():
    costs = _offloading_costs(offload_gbps=1.0)
    assert costs.floor == "full_offload" and costs.peak["full_offload"] < costs.peak["full"]
    below_full = costs.peak["full"] - MiB
    choices = solve(costs, below_full)
    assert "full_offload" in choices.values() and costs.estimated_peak(choices) <= below_full
    with pytest.raises(NothingFits, match="full AC with offload on every block needs"):
        solve(costs, costs.peak["full_offload"] - 1)


def test_equal_blocks_get_the_least_recompute_and_ties_go_to_the_first_blocks():
    # 100 MiB to save: op saves 30 for 5 FLOPs, full 38 for 9; four ops are the cheapest, and of
    # the equal plans the one that recomputes the first blocks is taken, on every rank alike.
    costs = _costs([(40, 10, 2, 5, 9)] * 8)
    budget = costs.peak["none"] - 100 * MiB
    assert solve(costs, budget) == {i: "op" if i < 4 else "none" for i in range(8)}


@pytest.mark.parametrize("in_flight", [0.4, 3])
def test_each_choice_saves_what_the_peaks_say_shared_by_the_bytes_each_block_holds_less(in_flight):
    costs = _costs([(40, 10, 2, 5, 9), (20, 10, 2, 5, 9)], in_flight=in_flight)
    first, second = costs.blocks
    assert costs.saving(first, "op") == pytest.approx(in_flight * 30 * MiB)
    assert costs.saving(second, "op") == pytest.approx(in_flight * 10 * MiB)
    for choice in costs.choices:
        assert costs.estimated_peak({0: choice, 1: choice}) == costs.peak[choice]


def test_a_choice_whose_peak_is_set_outside_the_activations_saves_at_the_rate_of_one_that_is_not():
    # Activations take 100 MiB + what 4 blocks hold, but the optimizer step peaks at 130 MiB:
    # op's peak (100 + 40) shows its saving, full AC's (130, not 108) hides 22 MiB of it.
    costs = _costs([(40, 10, 2, 5, 9)] * 4)
    peak = {c: max(130 * MiB, p) for c, p in costs.peak.items()}
    floored = RankCosts("", peak, costs.blocks, costs.rates)
    block = floored.blocks[0]
    assert floored.saving(block, "op") == pytest.approx(30 * MiB)
    assert floored.saving(block, "full") == pytest.approx(38 * MiB)  # not (260 - 130) / 4 = 32.5
    assert floored.estimated_peak(dict.fromkeys(range(4), "full")) == peak["full"]
    assert floored.estimated_peak({0: "full", 1: "none", 2: "none", 3: "none"}) == 260 * MiB - 38 * MiB


# ----- the saved plan -------------------------------------------------------------------------


def _plan(spec_choices: dict[int, str], fingerprint: str) -> BlockPlan:
    zeros = {i: dict.fromkeys(RECOMPUTE_CHOICES, 0) for i in spec_choices}
    return BlockPlan(
        choices=spec_choices, budget=GRANULE, ranks={"": {"estimated": 1, "measured": 1, "recompute_flops": 0,
        "added_ms": 0.0, "full_ac_added_ms": 0.0}}, saving=zeros, recompute=zeros, added_ms=zeros,
        rates=FLOPS_AS_SECONDS.describe(), fingerprint=fingerprint,
    )  # fmt: skip


def _auto_config(tmp_path, **ac) -> JobConfig:
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.activation_checkpoint = ActivationCheckpoint(**{"mode": "auto", "auto_memory_gib": 1.0, **ac})
    return cfg


def test_the_planner_offloads_only_where_copies_can_run_beside_compute(tmp_path):
    cfg = _auto_config(tmp_path)
    assert set(OFFLOAD_CHOICES) <= set(ac_auto.planned_choices(cfg))
    # The CPU copies synchronously; compiled blocks and zero-bubble schedules cannot offload.
    on_cpu = ac_auto.with_rates_of(cfg, torch.device("cpu"))
    compiled = _auto_config(tmp_path)
    compiled.compile.enable = True
    zero_bubble = _auto_config(tmp_path)
    zero_bubble.parallelism.pipeline_parallel_degree = 2
    zero_bubble.parallelism.pipeline_parallel_schedule = "ZBVZeroBubble"
    for cfg in (on_cpu, compiled, zero_bubble, _auto_config(tmp_path, auto_offload=False)):
        assert ac_auto.planned_choices(cfg) == RECOMPUTE_CHOICES


def test_the_fingerprint_follows_what_changes_memory_and_not_the_step_count(tmp_path):
    cfg = _auto_config(tmp_path)
    base = ac_auto.layout_fingerprint(cfg, 8, GRANULE)
    cfg.training.steps += 100
    assert ac_auto.layout_fingerprint(cfg, 8, GRANULE) == base
    assert ac_auto.layout_fingerprint(cfg, 8, 2 * GRANULE) != base
    assert ac_auto.layout_fingerprint(cfg, 16, GRANULE) != base
    cfg.training.seq_len *= 2
    assert ac_auto.layout_fingerprint(cfg, 8, GRANULE) != base


def test_a_resume_takes_the_saved_plan_and_a_changed_layout_plans_again(tmp_path, monkeypatch):
    planned = []

    def fake_estimator(cfg, world_size, budget):
        planned.append(cfg.training.seq_len)
        return _plan({0: "op", 1: "full"}, "")

    monkeypatch.setattr(ac_auto, "plan_with_estimator", fake_estimator)
    cfg = _auto_config(tmp_path)
    first = ac_auto.resolve_auto_plan(cfg, 1, 0, torch.device("cpu"))
    assert first.activation_checkpoint.auto_plan == "op:0; full:1"
    saved = json.loads((tmp_path / ac_auto.PLAN_FILE).read_text())
    priced = ac_auto.with_rates_of(cfg, torch.device("cpu"))
    assert saved["fingerprint"] == ac_auto.layout_fingerprint(priced, 1, GRANULE * 1024)
    ac_auto.resolve_auto_plan(cfg, 1, 0, torch.device("cpu"))
    assert len(planned) == 1
    cfg.training.seq_len *= 2
    ac_auto.resolve_auto_plan(cfg, 1, 0, torch.device("cpu"))
    assert len(planned) == 2


def _plan_slowly_on_rank_0(rank: int, folder: str, seconds: float) -> None:
    import datetime
    import time

    import torch.distributed as dist

    def slow_estimator(cfg, world_size, budget):
        time.sleep(seconds)
        return _plan({0: "op", 1: "full"}, "")

    ac_auto.plan_with_estimator = slow_estimator
    store = dist.FileStore(f"{folder}/store", 2)
    timeout = datetime.timedelta(seconds=seconds / 4)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    try:
        cfg = _auto_config(folder)
        cfg.comm.init_timeout_seconds = 1
        got = ac_auto.resolve_auto_plan(cfg, 2, rank, torch.device("cpu"))
        assert got.activation_checkpoint.auto_plan == "op:0; full:1"
    finally:
        dist.destroy_process_group()


def test_the_other_ranks_wait_for_a_plan_longer_than_the_worlds_timeout(tmp_path):
    # The world's collectives time out after 1 s; rank 0 plans for 4 s.
    torch.multiprocessing.spawn(_plan_slowly_on_rank_0, args=(str(tmp_path), 4.0), nprocs=2)


def test_mode_auto_on_the_cpu_without_a_budget_is_refused(tmp_path):
    cfg = _auto_config(tmp_path, auto_memory_gib=0.0)
    with pytest.raises(
        ConfigError, match="on the CPU needs a budget: set 'activation_checkpoint.auto_memory_gib'"
    ):
        ac_auto.resolve_auto_plan(cfg, 1, 0, torch.device("cpu"))


def test_a_given_plan_is_used_as_it_is(tmp_path):
    cfg = _auto_config(tmp_path, auto_plan="full:0-1")
    assert ac_auto.resolve_auto_plan(cfg, 1, 0, torch.device("cpu")) is cfg


# ----- the recompute FLOPs --------------------------------------------------------------------


def test_recompute_flops_count_what_each_blocks_backward_reruns():
    model = tiny_llama3(n_layers=3)
    apply_ac(model, _auto("none:0; op:1; full:2"))
    blocks = {int(name): block for name, block in model.layers.named_children()}
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(5))
    with torch.utils.flop_counter.FlopCounterMode(display=False) as forward_only:
        with torch.no_grad():
            blocks[0](model.tok_embeddings(tokens[:, :-1]), model.rope_cache[:16])
    block_forward = forward_only.get_total_flops()
    last_matmul = next(
        sum(ops.values()) for name, ops in forward_only.get_flop_counts().items() if name.endswith("w2")
    )
    with RecomputeCost(blocks) as counter:
        next_token_loss_and_grads(model, tokens)
    assert counter.flops.get(0, 0) == 0
    assert 0 < counter.flops[1] < counter.flops[2]
    # early_stop: full AC reruns the block's forward but its last matmul (w2). Its attention
    # counts as the GPU's flash kernel (q k^T and p v: 4 b s^2 dim), which FlopCounterMode,
    # lacking a formula for the CPU's kernel, leaves out of block_forward.
    attention = 4 * 2 * 16**2 * 32
    assert counter.flops[2] == block_forward - last_matmul + attention


def test_recompute_cost_sees_cheap_regions_rerun_and_sacs_dispatch():
    model = tiny_llama3(n_layers=5)
    apply_ac(model, _auto("none:0; regions:1; op:2; full:3; op_all_mm:4"))
    blocks = {int(name): block for name, block in model.layers.named_children()}
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(5))
    h, rope = model.tok_embeddings(tokens[:, :-1]), model.rope_cache[:16]
    with OpCounter() as block_ops:
        blocks[0](h, rope)
    with RecomputeCost(blocks, in_selective_checkpoint) as counter:
        next_token_loss_and_grads(model, tokens)
    # A cheap region reruns as a bare function, with no module hooks: found by its graph nodes.
    # Two norms and the gate rerun once each, RoPE twice (for q and for k).
    assert len(blocks[1].cheap_regions()) == 4 and counter.runs[1] == 5
    assert counter.flops.get(1, 0) == 0 and counter.memory_bytes[1] > 0
    assert counter.runs[2] == counter.runs[3] == 1
    assert 0 < counter.ops[1] < counter.ops[2] <= counter.ops[3]
    # Only op-SAC's dispatch mode sees every op of the forward, and again in its recompute (the
    # checkpoint adds a few of its own).
    assert set(counter.sac_ops) == {2, 4}
    assert 0 <= counter.sac_ops[2] - 2 * len(block_ops.calls) <= 4
    # op_all_mm reruns every matmul but keeps attention: full AC's FLOPs less attention's.
    assert counter.flops[2] < counter.flops[4] == counter.flops[3] - 4 * 2 * 16**2 * 32
    assert 0 not in counter.ops


def test_preflight_refuses_mode_auto_on_the_cpu_without_a_budget():
    from torchtitan.config import parse_args
    from torchtitan.preflight import check_layout

    cfg = parse_args(["--config", "debug_model.toml", "--activation_checkpoint.mode", "auto"], env={})
    with pytest.raises(ConfigError, match="on the CPU needs a budget"):
        check_layout(cfg, 2, torch.device("cpu"))
