"""scripts/estimate_memory.py: fake-mode estimates against real runs of the same step, what the
table shows, and the inputs it refuses."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from tests.conftest import load_script
from torchtitan.config import parse_args
from torchtitan.models import attention
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.tools.op_counter import OpCounter

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "estimate_memory.py"
DEBUG = ["--config", "debug_model.toml", "--training.local_batch_size", "4", "--training.seq_len", "256"]
# Two FSDP ranks, bf16 compute, full AC and a tiny batch: the peak falls in grad clipping and the
# optimizer step, where DTensor ops run on every gradient.
FSDP_SMALL = ["--config", "debug_model.toml", "--training.local_batch_size", "1", "--training.seq_len", "32"]
FSDP_SMALL += ["--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "full"]


em = load_script("scripts/estimate_memory.py")


def _config(argv: list[str], mode: str | None = None):
    cfg = parse_args(argv, env={})
    return cfg if mode is None else em.with_ac(cfg, em.AC_MODES[mode])


def _table_row(table: str, name: str) -> dict[str, float]:
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("| GiB per rank |"))
    row = next(line for line in lines if line.startswith(f"| {name} |"))
    modes = [c.strip() for c in header.strip("|").split("|")][1:]
    return dict(zip(modes, (float(c.strip(" *")) for c in row.strip("|").split("|")[1:])))


@pytest.mark.parametrize("mode", ["none", "selective op"])
def test_estimate_is_within_10_percent_of_a_real_run(mode):
    cfg = _config(DEBUG, mode)
    estimated = em.measure(cfg, 1, fake=True)[em.TOTAL]
    measured = em.measure(cfg, 1, fake=False)[em.TOTAL]
    assert measured > 50 * 2**20  # the debug model's step really held something
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


def test_the_estimator_builds_a_float8_config_converted():
    cfg = _config(DEBUG + ["--model.converters", "float8"])
    model = em.build_model(cfg, em.parallel_dims_for(cfg, 1), torch.device("cpu"))
    assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == 42


# The path is the default one's plus torchao's float8 tensors, which fake mode runs slowly.
@pytest.mark.full_matrix
def test_a_float8_estimate_is_within_10_percent_of_a_real_run():
    cfg = _config(DEBUG + ["--model.converters", "float8"], "selective op")
    estimated = em.measure(cfg, 1, fake=True)[em.TOTAL]
    measured = em.measure(cfg, 1, fake=False)[em.TOTAL]
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


def test_fsdp_estimate_ignores_dtensor_shape_propagation():
    # DTensor caches output shapes per op; clear them so that this run derives them again.
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    cfg = _config(FSDP_SMALL)
    estimated = em.measure(cfg, 2, fake=True)[em.TOTAL]
    measured = em.measure(cfg, 2, fake=False)[em.TOTAL]
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


def test_fsdp_reports_fp32_shards_and_bf16_gathered_copies():
    with torch.device("meta"):
        model = Transformer(llama3_flavors["debugmodel"])
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.layers["0"].parameters())
    embedding = model.tok_embeddings.weight.numel()  # a unit of its own, freed after its forward
    root = total - len(model.layers) * block - embedding  # the final norm and the output
    rows = em.measure(_config(DEBUG + ["--training.mixed_precision_param", "bfloat16"]), 2)
    assert rows["parameters"] == 4 * total // 2  # each of 2 ranks holds half, in float32
    gathered = rows["gathered parameters"]  # root (kept after forward) + any gathered blocks, 2 bytes each
    assert gathered >= 2 * root and (gathered - 2 * root) % (2 * block) == 0, gathered


MOE = ["--config", "qwen3_debug_model_moe.toml", "--training.local_batch_size", "1",
       "--training.seq_len", "64", "--training.mixed_precision_param", "bfloat16"]  # fmt: skip
EP2 = ["--parallelism.expert_parallel_degree", "2"]


def test_expert_parallel_estimate_holds_the_share_of_the_experts_fsdp_would():
    """The experts split over EP 2 take the memory FSDP 2 would shard them to, and count as
    parameters, not optimizer state (FSDP's tracker does not know them)."""
    fsdp = em.measure(_config(MOE), 2)
    expert_parallel = em.measure(_config(MOE + EP2), 2)
    assert expert_parallel["parameters"] == fsdp["parameters"] > 0
    assert expert_parallel["optimizer state"] <= 3 * fsdp["parameters"]  # 2 Adam moments + step temporaries


@pytest.mark.full_matrix  # cosmetic, and 10 s
def test_fsdp_sharded_experts_estimate_without_fsdp_view_warning(recwarn):
    """EP 2 on 4 ranks shards each expert over 2 ranks with FSDP, whose view warning the fake
    all-to-all would raise on every estimate (a real run does not)."""
    em.measure(_config(MOE + EP2), 4)
    assert not [w for w in recwarn if "returned a view tensor" in str(w.message)]


# Both under full_matrix (a 4-rank estimate each, 15-18 s): expert parallelism's estimate is
# checked by default on 2 ranks above and against a real run in test_memory_estimator_ep.py.
@pytest.mark.parametrize(
    "layout",
    [pytest.param([*EP2, "--parallelism.expert_tensor_parallel_degree", "2"], marks=pytest.mark.full_matrix),
     pytest.param(["--parallelism.expert_parallel_degree", "4", "--parallelism.expert_tensor_parallel_degree",
                   "1"], marks=pytest.mark.full_matrix)],
    ids=["EP 2 x TP 2", "EP 4 over FSDP 2 x TP 2"],
)  # fmt: skip
def test_expert_parallel_with_tensor_parallel_estimate_holds_a_quarter_on_4_ranks(layout):
    # Its own process: a second TP layout estimated in one process got DTensor parameters on the
    # first layout's (destroyed) process groups (torch 2.13), so each runs alone.
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *MOE, *layout, "--parallelism.tensor_parallel_degree", "2",
         "--ngpu", "4"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "CONFIG_FILE": ""},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "estimated with balanced routing" in proc.stderr
    whole_model_gib = 12_861_056 * 4 / 2**30  # fp32 weights of debugmodel_moe
    assert _table_row(proc.stdout, "parameters")["selective op"] == pytest.approx(
        whole_model_gib / 4, abs=1e-3
    )


def test_gradient_accumulation_holds_the_accumulated_gradients_during_the_next_micro_batch():
    # The whole logits put the peak at the start of backward, before the first gradient; with a
    # chunked head the peak falls later, in backward, where some gradients already exist.
    whole = DEBUG + ["--training.loss_chunks", "1"]
    single = em.measure(_config(whole, "none"), 1)
    accumulated = em.measure(_config(whole + ["--training.global_batch_size", "8"], "none"), 1)
    assert single["gradients"] == 0  # the peak comes before the first gradient
    assert accumulated["gradients"] == single["parameters"]  # float32 gradients of every parameter
    assert accumulated[em.TOTAL] == single[em.TOTAL] + accumulated["gradients"]


def test_all_ac_modes_table_orders_activations_full_then_op_then_none(capsys):
    em.main(DEBUG + ["--ngpu", "1", "--all-ac-modes"])
    activations = _table_row(capsys.readouterr().out, "activations")
    assert list(activations) == list(em.AC_MODES)
    assert activations["full"] < activations["selective op"] < activations["none"]


def test_a_misspelled_estimator_option_is_named_not_taken_for_a_config_key(capsys):
    with pytest.raises(SystemExit) as info:
        em.main(DEBUG + ["--ngpu", "1", "--all-ac-mode"])
    assert info.value.code == 2
    assert "unrecognized option --all-ac-mode; did you mean --all-ac-modes?" in capsys.readouterr().err


def test_bad_config_from_the_shell_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--ngpu", "1", "--training.stpes", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CONFIG_FILE": ""},
    )
    assert proc.returncode == 2
    assert "Did you mean 'steps'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--ngpu", "3", "--parallelism.data_parallel_shard_degree", "2"], "but the world size is 3"),
        (
            ["--ngpu", "1", "--activation_checkpoint.mode", "memory_budget", "--compile.enable"],
            "does not run",
        ),
        (["--ngpu", "2", "--parallelism.data_parallel_replicate_degree", "2"], "cannot run under Fake"),
        (["--ngpu", "2", "--training.enable_cpu_offload"], "less its 'parameters', 'gradients' and"),
        (
            [
                "--ngpu",
                "2",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
            ],
            "estimator cannot follow (torch's MemTracker fails under autograd.grad",
        ),
    ],
    ids=[
        "degrees-do-not-fit-ngpu",
        "memory-budget-needs-compile",
        "ddp-needs-real-storage",
        "cpu-offload",
        "pipeline-split-backward",
    ],
)
def test_config_refused_after_parsing_exits_2_with_its_message(argv, expected, capsys):
    with pytest.raises(SystemExit) as info:
        em.main(["--config", "debug_model.toml", *argv])
    assert info.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--config", "debug_model.toml", "--ngpu", "1", "--ep-imbalance", "2"], "needs expert parallelism"),
        ([*MOE, *EP2, "--ngpu", "2", "--ep-imbalance", "2.5"], "Use a value in [1, 2]"),
        ([*MOE, *EP2, "--ngpu", "2", "--ep-imbalance", "2", "--model.moe_force_load_balance"],
         "contradicts 'model.moe_force_load_balance' = true"),
    ],
    ids=["without-expert-parallelism", "above-the-ep-degree", "with-forced-balance"],
)  # fmt: skip
def test_ep_imbalance_the_layout_cannot_have_exits_2_with_its_message(argv, expected, capsys):
    with pytest.raises(SystemExit) as info:
        em.main(argv)
    assert info.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0.5", "many"])
def test_ep_imbalance_below_1_or_not_a_number_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as info:
        em.main([*MOE, *EP2, "--ngpu", "2", "--ep-imbalance", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "--ep-imbalance" in err


def test_the_title_names_the_routing_the_estimate_assumed():
    cfg = _config(MOE + EP2)
    assert em.describe(cfg, 2).endswith("; balanced expert routing")
    assert em.describe(cfg, 2, 1.5).endswith("; this rank receives 1.5x its balanced share of routed rows")


@pytest.mark.parametrize("argv", [[], ["--ngpu", "0"], ["--ngpu", "two"]], ids=["missing", "zero", "text"])
def test_ngpu_missing_or_below_1_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as info:
        em.main(["--config", "debug_model.toml", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "--ngpu" in err


def test_wrapper_script_forwards_its_arguments():
    proc = subprocess.run(
        [str(ROOT / "run_memory_estimation.sh"), *FSDP_SMALL, "--ngpu", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "debugmodel, local batch" in proc.stdout
    assert "on 2 rank(s): dp_replicate 1 x dp_shard 2 x tp 1, FSDP;" in proc.stdout
    assert _table_row(proc.stdout, "**peak total**")["full"] > 0


def test_attention_with_another_value_head_dim_is_estimated_on_a_fused_kernel_with_equal_output():
    """DeepSeek's MLA (queries and keys 192 wide, values 128): the CPU would run SDPA's math
    kernel and the estimate would count its seq x seq scores, which a GPU's fused kernel never
    holds. Under the estimator, the CPU's fused kernel runs instead, and gives the same output."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 4, 64, 48, generator=generator) for _ in range(2))
    v = torch.randn(1, 4, 64, 32, generator=generator)
    math = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with em.gpu_attention_kernels(), OpCounter() as counter:
        fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert counter.count("_scaled_dot_product_flash_attention_for_cpu") == 1
    assert counter.count("bmm") == 0
    torch.testing.assert_close(fused, math, rtol=1e-5, atol=1e-6)
    assert F.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"  # restored


@pytest.mark.parametrize("mask_type", ["block_causal", "sliding_window"])
def test_flex_attention_is_estimated_as_its_gpu_kernel_holding_no_seq_by_seq_mask(mask_type):
    """On the CPU flex runs as SDPA with a dense mask, holding a float seq x seq copy per layer;
    a GPU's flex kernel holds what the fused causal kernel does, so the estimates are equal."""
    base = DEBUG[:2] + ["--training.local_batch_size", "1", "--training.seq_len", "1024"]
    flex = ["--model.attn_backend", "flex", "--model.attn_mask_type", mask_type]
    sdpa_peak = em.measure(_config(base, "none"), 1)[em.TOTAL]
    flex_peak = em.measure(_config(base + flex, "none"), 1)[em.TOTAL]
    assert flex_peak == sdpa_peak


def test_masks_made_for_the_estimate_and_for_training_are_never_mixed():
    """Masks that do not read the tokens are kept for reuse; the estimator's one-element
    stand-ins must not reach a real run (there they would mask nothing), nor real masks it."""
    tokens = torch.ones(1, 32, dtype=torch.long)
    real = attention.build_attention_masks(tokens, "causal")
    with em.gpu_attention_kernels():
        estimated = attention.build_attention_masks(tokens, "causal")
    assert estimated.dense_mask.numel() == 1 and real.dense_mask.shape[-2:] == (32, 32)
    assert attention.build_attention_masks(tokens, "causal").dense_mask.shape[-2:] == (32, 32)


def test_async_tensor_parallel_is_estimated_as_plain_tensor_parallel_with_a_note(capsys):
    tp2 = ["--config", "debug_model.toml", "--ngpu", "2", "--parallelism.tensor_parallel_degree", "2"]
    tp2 += ["--parallelism.data_parallel_shard_degree", "1", "--training.seq_len", "64"]
    em.main(tp2)
    plain = capsys.readouterr().out
    em.main(tp2 + ["--parallelism.enable_async_tensor_parallel", "--compile.enable"])
    out, err = capsys.readouterr()
    assert out == plain
    assert "async tensor parallelism is estimated as plain tensor parallelism" in err


def test_ac_wraps_blocks_as_the_compiled_run_does_though_the_step_runs_eagerly():
    """Op-SAC with flex attention checkpoints the attention and MLP branches as separate regions
    only when compile is off; a compiled run wraps the whole block, as with sdpa."""
    base = DEBUG[:2] + ["--training.local_batch_size", "1", "--training.seq_len", "512"]
    flex = ["--model.attn_backend", "flex", "--model.attn_mask_type", "block_causal"]
    sdpa_peak = em.measure(_config(base, "selective op"), 1)[em.TOTAL]
    flex_compiled = em.measure(_config(base + flex + ["--compile.enable"], "selective op"), 1)[em.TOTAL]
    flex_eager = em.measure(_config(base + flex, "selective op"), 1)[em.TOTAL]
    # block_causal's int64 ids per token; the 1-element stand-in mask, boolean and additive (fp32)
    document_ids, stand_in_mask = 512 * 8, 1 + 4
    assert flex_compiled == sdpa_peak + document_ids + stand_in_mask
    # Uncompiled, the attention branch is under full AC: it keeps less than block op-SAC.
    assert flex_eager < flex_compiled


def test_rms_norm_is_estimated_as_the_gpus_fused_kernel_with_equal_output_and_gradients():
    """On the CPU `F.rms_norm` decomposes, and backward holds the input upcast to fp32 and the
    fp32 normalized product; a GPU's fused kernel holds only the input, the per-row rstd and
    the weight. Under the estimator the norm holds those three, and computes the same."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 64, generator=generator).bfloat16().requires_grad_()
    weight = (1 + torch.randn(64, generator=generator) / 4).bfloat16().requires_grad_()
    grad = torch.randn(2, 8, 64, generator=generator).bfloat16()

    def held_and_grads():
        held = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
            out = F.rms_norm(x, [64], weight, 1e-6)
        return out, held, torch.autograd.grad(out, (x, weight), grad)

    cpu_out, cpu_held, cpu_grads = held_and_grads()
    with em.gpu_norm_kernel():
        gpu_out, gpu_held, gpu_grads = held_and_grads()
    assert sum(t.nbytes for t in cpu_held) > 5 * x.nbytes  # two fp32 copies of x, and more
    assert [(tuple(t.shape), t.dtype) for t in gpu_held] == [
        ((2, 8, 64), torch.bfloat16),
        ((2, 8, 1), torch.float32),
        ((64,), torch.bfloat16),
    ]
    assert torch.equal(gpu_out, cpu_out)
    for gpu, cpu in zip(gpu_grads, cpu_grads):
        torch.testing.assert_close(gpu, cpu, rtol=1e-2, atol=1e-2)  # bf16 rounding
    assert F.rms_norm.__name__ == "rms_norm"  # restored


def test_rms_norm_with_a_weight_of_another_dtype_stays_decomposed_as_on_a_gpu():
    x, weight = torch.randn(4, 16).bfloat16().requires_grad_(), torch.ones(16, requires_grad=True)
    with em.gpu_norm_kernel():
        held = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
            F.rms_norm(x, [16], weight, 1e-6)
    assert any(t.dtype == torch.float32 and t.shape == x.shape for t in held)


def test_max_seq_len_finds_the_longest_sequence_whose_peak_fits():
    cfg = _config(["--config", "debug_model.toml", "--training.local_batch_size", "1"], "full")
    budget = 200 * 2**20
    seq_len, peak = em.longest_seq_len(cfg, 1, budget)
    assert seq_len % em.seq_len_step(cfg) == 0 and peak <= budget
    assert em.peak_at(cfg, 1, seq_len + em.seq_len_step(cfg), None, 1.0) > budget


def test_max_seq_len_that_fits_nothing_exits_2_naming_what_the_shortest_needs(capsys):
    with pytest.raises(SystemExit) as info:
        em.main(["--config", "debug_model.toml", "--ngpu", "1", "--max-seq-len", "0.01"])
    assert info.value.code == 2
    assert "the shortest sequence searched, 1024 tokens, needs" in capsys.readouterr().err


OFFLOAD = ["--activation_checkpoint.offload", "saved", "--activation_checkpoint.offload_min_bytes", "1024"]


FULL_MATRIX = pytest.mark.full_matrix


@pytest.mark.parametrize(
    "mode", [pytest.param("none", marks=FULL_MATRIX), pytest.param("full", marks=FULL_MATRIX), "selective op"]
)
def test_offload_sends_the_bytes_a_real_run_sends_and_leaves_the_device_peak(mode):
    cfg = _config(DEBUG + OFFLOAD, mode)
    estimated = em.measure(cfg, 1, fake=True)
    measured = em.measure(cfg, 1, fake=False)
    without = em.measure(_config(DEBUG, mode), 1, fake=True)
    assert estimated[em.OFFLOADED] == measured[em.OFFLOADED] > 0
    assert estimated["activations"] < without["activations"]
    # Under full AC the debug model's peak is one block's recompute, which offload leaves as is.
    assert estimated[em.TOTAL] <= without[em.TOTAL]
    if mode != "full":
        assert estimated[em.TOTAL] < without[em.TOTAL]


def test_an_offloading_estimate_reports_the_bytes_and_their_copy_time(capsys):
    em.main(DEBUG + OFFLOAD + ["--ngpu", "1", "--offload-gbps", "10"])
    table = capsys.readouterr().out
    sent = _table_row(table, em.OFFLOADED)["selective op"]
    assert sent > 0
    copy_ms = _table_row(table, "copy time each way at 10 GB/s, ms")["selective op"]
    assert copy_ms == pytest.approx(1000 * sent * 2**30 / 10e9, abs=0.05)
