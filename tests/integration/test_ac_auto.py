"""Mode "auto" end to end: the estimator's plan (`scripts/estimate_memory.py --plan`) against a
real step of that plan, the pipeline ranks' plans, the refusal when nothing fits, and the
trainer planning at startup. The solver and the plan class: tests/unit/test_ac_planner.py."""

import dataclasses
import subprocess
import sys

import pytest

from tests.conftest import load_script
from tests.parity import assert_parity, reference, train_for_parity
from torchtitan.config import parse_args
from torchtitan.distributed.ac_planner import RecomputeRates

pytestmark = pytest.mark.integration

em = load_script("scripts/estimate_memory.py")

SMALL = ["--training.local_batch_size", "4", "--training.seq_len", "256"]
LLAMA = ["--config", "debug_model.toml", *SMALL]
# The estimator runs MoE experts in bf16 only (`_refuse_fp32_moe`).
MOE = ["--training.mixed_precision_param", "bfloat16"]
QWEN3_MOE = ["--config", "qwen3_debug_model_moe.toml", *SMALL, *MOE]
DEEPSEEK_V3 = ["--config", "deepseek_v3_debug_model.toml", *SMALL, *MOE]
MODELS = {
    "llama3": LLAMA,
    "qwen3 moe": pytest.param(QWEN3_MOE, marks=pytest.mark.full_matrix),
    "deepseek v3": pytest.param(DEEPSEEK_V3, marks=pytest.mark.full_matrix),
}


@pytest.fixture(scope="module")
def llama_costs():
    """The planner's measurements of `LLAMA` on one rank, shared by the tests that plan it."""
    return em.rank_costs(parse_args(LLAMA, env={}), 1)[0]


def _between(costs, fraction: float) -> int:
    """A budget `fraction` of the way from full AC's peak to no AC's."""
    return round(costs.peak["full"] + fraction * (costs.peak["none"] - costs.peak["full"]))


@pytest.mark.parametrize("argv", MODELS.values(), ids=MODELS.keys())
def test_a_real_step_of_the_plan_fits_the_budget_and_its_estimate(argv, request):
    cfg = parse_args(argv, env={})
    costs = request.getfixturevalue("llama_costs") if argv is LLAMA else em.rank_costs(cfg, 1)[0]
    for fraction in (0.3, 0.7):
        budget = _between(costs, fraction)
        plan = em.plan_to_budget(cfg, 1, budget, costs=[costs])
        assert set(plan.choices.values()) - {"none"}, "a budget below no AC's peak recomputes something"
        planned = plan.ranks[""]["measured"]
        # The real step runs attention as the plan counted it: DeepSeek's MLA on the fused kernel
        # a GPU has (the CPU's math kernel would hold seq x seq scores; see gpu_attention_kernels).
        with em.gpu_attention_kernels():
            real = em.measure(em.with_block_plan(cfg, plan.choices), 1, fake=False)[em.TOTAL]
        assert real <= budget, (fraction, real, budget)
        assert abs(real - planned) <= 0.10 * planned, (fraction, real, planned)


def test_a_real_step_of_a_plan_that_offloads_fits_the_budget_and_its_estimate(llama_costs):
    # Prices under which recompute is dear and copies cost nothing: the planner offloads where
    # it can. The measurements do not depend on the prices.
    rates = RecomputeRates(
        tflops=0.001, memory_gbps=2000, host_us_per_op=0, host_us_per_rerun=0, offload_gbps=1e6
    )
    costs = dataclasses.replace(llama_costs, rates=rates)
    budget = _between(costs, 0.3)
    cfg = parse_args(LLAMA, env={})
    plan = em.plan_to_budget(cfg, 1, budget, costs=[costs])
    assert "op_offload" in plan.choices.values(), plan.spec
    planned = plan.ranks[""]["measured"]
    real = em.measure(em.with_block_plan(cfg, plan.choices), 1, fake=False)
    assert real[em.OFFLOADED] > 0
    assert real[em.TOTAL] <= budget, (real[em.TOTAL], budget)
    assert abs(real[em.TOTAL] - planned) <= 0.10 * planned, (real[em.TOTAL], planned)


def test_probing_the_blocks_leaves_the_steps_peak_as_it_is():
    # The planner reads each choice's peak from its probed step (rank_costs).
    cfg = parse_args(LLAMA + ["--activation_checkpoint.mode", "selective"], env={})
    probed = em.measure(cfg, 1, probe=True)
    assert probed[em.BLOCKS] and probed[em.TOTAL] == em.measure(cfg, 1)[em.TOTAL]


def test_a_larger_budget_never_plans_more_recompute_time(llama_costs):
    cfg, costs = parse_args(LLAMA, env={}), llama_costs
    plans = [
        em.plan_to_budget(cfg, 1, _between(costs, f), costs=[costs]) for f in (0.0, 0.25, 0.5, 0.75, 1.0)
    ]
    recompute = [plan.ranks[""]["added_ms"] for plan in plans]
    assert recompute == sorted(recompute, reverse=True)
    assert recompute[-1] == 0 < recompute[0]


@pytest.mark.full_matrix
def test_the_first_pipeline_stage_plans_at_least_the_recompute_of_the_last():
    # 1F1B on 2 stages with 4 microbatches keeps 2 in flight on the first stage and 1 on the last.
    cfg = parse_args(LLAMA + ["--parallelism.pipeline_parallel_degree", "2"], env={})
    first, last = em.rank_costs(cfg, 2)
    # The first rank's peaks hold 2 microbatches, so full AC saves it about twice the last's.
    first_saves, last_saves = (c.peak["none"] - c.peak["full"] for c in (first, last))
    assert first_saves > 1.5 * last_saves
    # The last rank needs 40% of what full AC saves it: not every block.
    budget = _between(last, 0.6)
    plan = em.plan_to_budget(cfg, 2, budget, costs=[first, last])
    assert set(plan.choices.values()) != {"full"}
    assert plan.ranks["pp 0"]["added_ms"] >= plan.ranks["pp 1"]["added_ms"] > 0
    assert all(rank["measured"] <= budget for rank in plan.ranks.values())


def _plan_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(em.__file__), "--ngpu", "1", "--plan", *LLAMA, *args]
    return subprocess.run(command, capture_output=True, text=True)


def test_the_plan_command_prints_the_plan_string_and_its_table():
    done = _plan_cli("--budget-gib", "0.15")
    assert done.returncode == 0, done.stderr
    assert 'auto_plan = "' in done.stdout
    assert "| block | choice | off the peak, MiB |" in done.stdout
    assert "budget 0.150 GiB" in done.stdout
    # Full AC fits 0.15 GiB, so full AC with offload is neither measured nor chosen.
    assert "op_offload on" in done.stdout and "full_offload" not in done.stdout


def test_a_budget_nothing_fits_exits_2_with_full_acs_peak_and_what_to_change():
    done = _plan_cli("--budget-gib", "0.01")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "full AC on every block needs" in done.stderr and "tensor_parallel_degree" in done.stderr


# The path of the two-rank test below, in one process, with its log and plan file.
@pytest.mark.full_matrix
def test_the_trainer_plans_at_startup_saves_the_plan_and_trains(tmp_path):
    argv = LLAMA + ["--activation_checkpoint.mode", "auto", "--activation_checkpoint.auto_memory_gib", "0.15",
                    "--training.steps", "2", "--job.dump_folder", str(tmp_path)]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "torchtitan.train", *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Activation checkpointing plan (mode auto), planned and saved to" in done.stderr
    assert "Activation checkpointing: mode auto," in done.stderr
    assert "step:     2" in done.stderr
    assert (tmp_path / "ac_plan.json").is_file()


def test_two_ranks_plan_at_startup_and_train_as_one_process_without_ac():
    # The parity tests' debug setup (fp32, seq_len 64, global batch 4) on FSDP 2, with a budget
    # between the layout's full-AC and no-AC peaks, so the plan mixes choices.
    argv = ["--config", "debug_model.toml", "--training.seq_len", "64", "--training.mixed_precision_param",
            "float32", "--training.global_batch_size", "4"]  # fmt: skip
    layout = argv + ["--training.local_batch_size", "2"]
    (costs,) = em.rank_costs(parse_args(layout, env={}), 2)
    budget = _between(costs, 0.5)
    plan = em.plan_to_budget(parse_args(layout, env={}), 2, budget, costs=[costs])
    assert len(set(plan.choices.values())) > 1
    auto = [
        "--activation_checkpoint.mode",
        "auto",
        "--activation_checkpoint.auto_memory_gib",
        repr(budget / 2**30),
    ]
    got = train_for_parity(layout + auto, nproc=2)
    assert_parity(got, reference(argv + ["--training.local_batch_size", "4"]))
