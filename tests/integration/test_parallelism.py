"""Parallel layouts on CPU with gloo: what they log, the collectives they issue, gradient
reduction and timeouts. Their parity with one process is test_layout_parity.py's; the full AC x
2-D matrix is marked `full_matrix` and runs with `python -m pytest -m full_matrix`.
"""

import functools

import pytest

from tests.conftest import read_metrics, run_trainer
from tests.integration.workers import run_worker
from tests.parity import AC_ARGV, assert_parity, reference, train_for_parity

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


# Trained through the trainer for the metrics it logs; every layout's parity with one process,
# gradient by gradient, is test_layout_parity.py's.
LAYOUTS = {
    "tp2": (2, 1, ["--parallelism.tensor_parallel_degree", "2"]),
    "hsdp2x2": (4, 4, ["--parallelism.data_parallel_replicate_degree", "2"]),
}


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


AC_MODES = {name: AC_ARGV[name] for name in ("none", "full", "op-SAC", "selective 2")}
PARITY = ["--config", "debug_model.toml", "--training.seq_len", "64", "--training.mixed_precision_param",
          "float32", "--training.global_batch_size", str(GLOBAL_BATCH)]  # fmt: skip


@pytest.fixture(scope="module")
def parity_reference():
    return reference(PARITY + ["--training.local_batch_size", str(GLOBAL_BATCH)])


@pytest.mark.full_matrix
@pytest.mark.parametrize("mode", list(AC_MODES))
def test_fsdp2_tp2_with_each_ac_mode_gives_one_process_gradients(mode, parity_reference):
    tp = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "2"]
    assert_parity(train_for_parity(PARITY + tp + AC_MODES[mode], nproc=4), parity_reference)


@pytest.mark.full_matrix
@pytest.mark.parametrize(
    "argv, nproc",
    [(["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
       "--training.local_batch_size", "2"], 2),
     (["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--parallelism.disable_loss_parallel",
       "--training.local_batch_size", "4"], 2),
     # The budgeted partitioner sizes the TP DeviceMesh, a graph input of every block.
     (["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--training.local_batch_size", "4",
       "--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", "0.5"], 2)],
    ids=["ddp2", "tp2 compiled without loss parallel", "tp2 compiled, memory_budget"],
)  # fmt: skip
def test_more_layouts_give_one_process_gradients(argv, nproc, parity_reference):
    assert_parity(train_for_parity(PARITY + argv, nproc=nproc), parity_reference)


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


def test_a_chunked_loss_head_gathers_and_reduces_the_output_weight_once(fsdp_comm_report):
    """The 16 chunks run inside the root's forward, so FSDP sees one forward and one backward of
    the output weight: the counts equal the unchunked step's, whatever the root's policy."""
    report = fsdp_comm_report
    for base in ("none", "reshard always", "reshard never"):
        assert report[f"{base}, 16 loss chunks"] == report[base], base


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


@pytest.mark.parametrize("method", ["allgather_kv", "ulysses"])
def test_op_sac_keeps_context_parallel_exchanges_and_full_ac_reissues_them(method):
    report = _cp_comm_report()[method]
    none, full, op_sac = report["none"], report["full"], report["selective op"]
    # Per block: the keys' and values' all-gathers, or Ulysses' four all-to-alls (q, k, v, out).
    assert (
        none["forward"] == full["forward"] == op_sac["forward"] == 6 * (2 if method == "allgather_kv" else 4)
    )
    assert full["backward"] - none["backward"] == none["forward"]
    assert op_sac["backward"] == none["backward"]


@functools.cache
def _cp_comm_report() -> dict:
    return run_worker("cp_comm_worker")


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
    assert report["raised"], report  # the late rank came 6 s late: within the startup timeout


@pytest.mark.parametrize("group", ["tp", pytest.param("dp", marks=pytest.mark.full_matrix)])
def test_the_startup_timeout_reaches_every_mesh_group(group):
    """comm.init_timeout_seconds is every mesh group's timeout until the first step ends, not
    only the default group's: torch gives the groups a mesh creates its own default (10 min on
    NCCL, 30 on gloo), so a hang in loading or step 1 on a TP or FSDP group waited that long."""
    report = run_worker("timeout_worker", nproc=4, argv=[group, "startup"])
    assert report["raised"], report  # torch's default group timeout (30 min on gloo) would wait


def test_a_group_the_timeout_change_keeps_waits_for_a_late_rank():
    """The checkpointer's async-save group: its background collectives wait for the slowest
    rank's write, which may take longer than the training timeout."""
    report = run_worker("timeout_worker", nproc=4, argv=["kept"])
    assert not report["raised"], report
