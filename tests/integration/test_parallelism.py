"""Parallel layouts on CPU with gloo: the same losses and gradient norms as one process.

The CI matrix is small and representative; the full AC x 2-D matrix is marked `full_matrix`
and runs with `python -m pytest -m full_matrix`.
"""

import pytest

from tests.conftest import assert_metrics_match, read_metrics, run_trainer
from tests.integration.workers import run_worker

pytestmark = pytest.mark.integration

SMALL = ["--training.seq_len", "64", "--training.steps", "5", "--metrics.log_freq", "1",
         "--lr_scheduler.warmup_steps", "2", "--training.mixed_precision_param", "float32"]  # fmt: skip
GLOBAL_BATCH = 4


def _run(tmp_path, name, nproc, split, extra=()) -> list[dict]:
    """Train with the global batch split `split` ways (data-parallel degree x micro-batches)."""
    local = ["--training.local_batch_size", str(GLOBAL_BATCH // split)]
    proc = run_trainer(SMALL + local + list(extra) + ["--job.dump_folder", str(tmp_path / name)], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # DTensor warns when a reduction takes one collective per mesh dim (the 2-D gradient norm did).
    assert "sequential all_reduce" not in proc.stderr, proc.stderr[-3000:]
    return read_metrics(tmp_path / name)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), "single", 1, 1)


LAYOUTS = {
    "tp2": (2, 1, ["--parallelism.tensor_parallel_degree", "2"]),
    "tp2_without_loss_parallel": (2, 1, ["--parallelism.tensor_parallel_degree", "2",
                                         "--parallelism.disable_loss_parallel"]),
    "fsdp2_tp2": (4, 2, ["--parallelism.tensor_parallel_degree", "2"]),
    "hsdp2x2": (4, 4, ["--parallelism.data_parallel_replicate_degree", "2"]),
    "ddp2": (2, 2, ["--parallelism.data_parallel_replicate_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "1"]),
    # Compiled blocks and loss (op-SAC, the default): the embedding's asynchronous
    # reduce-scatter enters compiled block 0, and without loss parallel the logits' all-gather
    # enters the compiled loss.
    "tp2_compiled": (2, 1, ["--parallelism.tensor_parallel_degree", "2", "--compile.enable"]),
    "tp2_compiled_without_loss_parallel": (2, 1, ["--parallelism.tensor_parallel_degree", "2",
                                                  "--compile.enable", "--parallelism.disable_loss_parallel"]),
    # The budgeted partitioner sizes the TP DeviceMesh, a graph input of every block.
    "tp2_compiled_memory_budget": (2, 1, ["--parallelism.tensor_parallel_degree", "2", "--compile.enable",
                                          "--activation_checkpoint.mode", "memory_budget",
                                          "--activation_checkpoint.memory_budget", "0.5"]),
    # Local batch 1 on 2 replicas: 2 micro-batches per step, gradients reduced on the last.
    "ddp2_accumulating": (2, 4, ["--parallelism.data_parallel_replicate_degree", "2",
                                 "--parallelism.data_parallel_shard_degree", "1",
                                 "--training.global_batch_size", str(GLOBAL_BATCH)]),
}  # fmt: skip


# Under full_matrix: plain DDP 2 (ddp2_accumulating takes the same path, plus accumulation), and
# the two compiled TP variants (17-20 s each on 2 cores; tp2_compiled covers compiled TP blocks, and
# tests/integration/test_memory_budget.py the budgeted partitioner without TP).
FULL_MATRIX_LAYOUTS = ("ddp2", "tp2_compiled_without_loss_parallel", "tp2_compiled_memory_budget")


@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=pytest.mark.full_matrix) if k in FULL_MATRIX_LAYOUTS else k for k in LAYOUTS],
)
def test_layout_matches_single_process_losses_and_grad_norms(layout, single_process, layout_runs):
    assert_metrics_match(layout_runs(layout), single_process)


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """layout -> its training records, each layout trained once per module."""
    cache = {}

    def get(layout: str) -> list[dict]:
        if layout not in cache:
            nproc, split, extra = LAYOUTS[layout]
            cache[layout] = _run(tmp_path_factory.mktemp(layout), layout, nproc, split, extra)
        return cache[layout]

    return get


def test_max_loss_is_the_largest_rank_loss(single_process, layout_runs):
    """`max_loss` (TensorBoard's loss_metrics/global_max_loss) is the mean loss where every rank
    sees the same batch (one process, TP) and above it where data-parallel ranks do not."""
    assert all(r["max_loss"] == r["loss"] for r in single_process + layout_runs("tp2"))
    assert all(r["max_loss"] > r["loss"] for r in layout_runs("hsdp2x2"))


def test_tokens_per_second_counts_each_devices_share_of_the_global_batch(single_process, layout_runs):
    """tps x step time is the tokens one device processed in the step: tensor-parallel ranks share
    their batch (so tps and MFU are not inflated by the TP degree), data-parallel ranks split it."""
    seq_len = 64
    expected = {"single": GLOBAL_BATCH * seq_len, "tp2": GLOBAL_BATCH * seq_len // 2, "hsdp2x2": seq_len}
    runs = {"single": single_process, "tp2": layout_runs("tp2"), "hsdp2x2": layout_runs("hsdp2x2")}
    for name, records in runs.items():
        tokens = [r["tps"] * r["step_seconds"] for r in records]
        assert tokens == pytest.approx([expected[name]] * 5, rel=1e-9), name


_AC = "--activation_checkpoint."
AC_MODES = {
    "none": [_AC + "mode", "none"],
    "full": [_AC + "mode", "full"],
    "selective op": [_AC + "mode", "selective", _AC + "selective_ac_option", "op"],
    "selective 2": [_AC + "mode", "selective", _AC + "selective_ac_option", "2"],
}


@pytest.mark.full_matrix
@pytest.mark.parametrize("mode", list(AC_MODES))
def test_fsdp2_tp2_with_each_ac_mode_matches_single_process(mode, single_process, tmp_path):
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    assert_metrics_match(_run(tmp_path, mode.replace(" ", "_"), 4, 2, tp + AC_MODES[mode]), single_process)


@pytest.fixture(scope="module")
def fsdp_comm_report():
    return run_worker("fsdp_comm_worker")


def test_ac_adds_no_fsdp_communication(fsdp_comm_report):
    # Six blocks gathered for forward, and again for backward (recompute included) all but the
    # last, which stays gathered; the embedding, freed after its forward, twice too; the root
    # (norm, output) once; one reduce-scatter per FSDP unit.
    expected = {"all_gather": 6 + 5 + 2 + 1, "reduce_scatter": 6 + 1 + 1}
    modes = {mode: fsdp_comm_report[mode] for mode in ("none", "full", "selective op")}
    assert modes == {"none": expected, "full": expected, "selective op": expected}


def test_fsdp_reshard_after_forward_policies_gather_what_they_free(fsdp_comm_report):
    """Policy "always" frees the last block and the root too, so backward gathers all eight
    units (six blocks, the embedding, the root) again; "never" gathers each unit once per step."""
    report = fsdp_comm_report
    assert report["reshard always"] == {"all_gather": 2 * (6 + 2), "reduce_scatter": 6 + 2}
    assert report["reshard never"] == {"all_gather": 6 + 2, "reduce_scatter": 6 + 2}


def test_op_sac_recommunicates_only_the_sequence_parallel_all_gathers():
    report = run_worker("tp_comm_worker")
    none, full, op_sac = report["none"], report["full"], report["selective op"]
    assert none["forward"] == full["forward"] == op_sac["forward"]
    assert none["forward"]["all_gather"] > 0 and none["forward"]["reduce_scatter"] > 0
    # Full AC recomputes each block's forward, collectives included (the root's embedding and
    # output are not recomputed), up to the block's last reduce-scatter, which early_stop (the
    # default) never reaches: one fewer per block. Op-SAC re-gathers the two norm outputs of
    # each of the 6 blocks and keeps the reduce-scatters.
    full_back, none_back, none_fwd = (
        sum(c.values()) for c in (full["backward"], none["backward"], none["forward"])
    )
    assert full_back == none_back + none_fwd - 2 - 6
    assert op_sac["backward"]["all_gather"] - none["backward"]["all_gather"] == 2 * 6
    assert op_sac["backward"]["reduce_scatter"] == none["backward"]["reduce_scatter"]


def test_accumulated_micro_batches_reduce_across_replicas_once_per_step():
    report = run_worker("grad_sync_worker", nproc=4)
    # After the first micro-batch, nothing has crossed the replicas yet.
    assert report["ddp4"]["after_first"] == "local"
    assert report["hsdp2x2"]["after_first"] == "held"
    # One all-reduce per FSDP unit (six blocks, the embedding and the root) for the step, not
    # per micro-batch.
    assert report["hsdp2x2"]["all_reduces"] == 6 + 2
    for layout in ("ddp4", "hsdp2x2"):
        assert report[layout]["max_rel_error"] < 1e-5, (layout, report[layout])


def test_the_gradient_norm_sums_tensor_parallel_partial_gradients_in_one_all_reduce():
    """The norm weights' gradients under sequence parallel are partial sums (13 in the debug
    model): one all-reduce sums them all, and one more reduces the TP-sharded squares; one
    redistribute each took 14. The norm equals one from the full gradients."""
    report = run_worker("grad_norm_worker")
    assert report["partial_grads"] == 13 and report["left_partial"] == 0 and report["all_dtensors"]
    assert report["all_reduces"] == 2, report
    assert report["norm"] == pytest.approx(report["reference"], rel=1e-12)


# The FSDP groups' cases run under full_matrix: the timeout reaches every group by one loop.
@pytest.mark.parametrize("group", ["tp", pytest.param("dp_shard", marks=pytest.mark.full_matrix)])
def test_the_training_timeout_reaches_every_mesh_group(group):
    """comm.train_timeout_seconds replaces init_timeout_seconds on the FSDP and TP groups too,
    not only the default group (a hung FSDP collective waited the startup timeout)."""
    report = run_worker("timeout_worker", nproc=4, argv=[group])
    assert report["raised"] and report["seconds"] < 3, report


@pytest.mark.parametrize("group", ["tp", pytest.param("dp", marks=pytest.mark.full_matrix)])
def test_the_startup_timeout_reaches_every_mesh_group(group):
    """comm.init_timeout_seconds is every mesh group's timeout until the first step ends, not
    only the default group's: torch gives the groups a mesh creates its own default (10 min on
    NCCL, 30 on gloo), so a hang in loading or step 1 on a TP or FSDP group waited that long."""
    report = run_worker("timeout_worker", nproc=4, argv=[group, "startup"])
    assert report["raised"] and report["seconds"] < 3, report


def test_a_group_the_timeout_change_keeps_waits_for_a_late_rank():
    """The checkpointer's async-save group: its background collectives wait for the slowest
    rank's write, which may take longer than the training timeout."""
    report = run_worker("timeout_worker", nproc=4, argv=["kept"])
    assert not report["raised"] and report["seconds"] > 3, report
