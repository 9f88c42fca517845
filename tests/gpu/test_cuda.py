"""What only a CUDA GPU can check: flex_attention's compiled BlockMask path against the exact
dense path (every mask type; GQA and MLA heads in bf16), the CUDA gradient norm, the bf16
grouped-matmul experts against the loop, the GPU attention kernel under op-SAC, short bf16
(sdpa, and flex with chunked and global layers) and float8 training runs, the CUDA memory
snapshots, a resume from a pinned-memory async save, the memory the optimizer saves by
stepping in backward, and pinned loader batches. Marked `gpu`; skipped without CUDA.
`scripts/gpu_check.sh` runs them with `python -m pytest -m gpu tests/gpu`.
"""

import os
import pickle
import shutil
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.conftest import read_metrics, run_trainer
from torchtitan.components.optimizer import build_optimizer
from torchtitan.config import ActivationCheckpoint
from torchtitan.config.manager import parse_args
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.grad_norm import clip_grad_norm_
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import get_train_spec
from torchtitan.models.attention import FlexAttention, build_attention_masks
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import TransformerBlock
from torchtitan.models.llama3.parallelize import LLAMA3_SAVE_LIST
from torchtitan.models.moe import GroupedExperts
from torchtitan.models.rope import precompute_rope_cache
from torchtitan.tools.op_counter import BACKWARD, OpCounter, ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU"
        + (
            " (hidden from this session: the suite runs GPU tests only with -m gpu)"
            if os.environ.get("CUDA_VISIBLE_DEVICES") == ""
            else ""
        ),  # fmt: skip
    ),
]
CUDA = torch.device("cuda")
MASK_ARGS = {
    "causal": {},
    "block_causal": {"eos_id": 0},
    "sliding_window": {"sliding_window": 64},
    "chunked": {"chunk_size": 128},
}


@pytest.mark.parametrize("mask_type", list(MASK_ARGS))
def test_compiled_flex_block_mask_equals_the_dense_path_forward_and_backward(mask_type):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 8, (2, 512), generator=generator)  # id 0 is a frequent EOS
    q, k, v = (torch.randn(2, 8, 512, 64, generator=generator) for _ in range(3))
    attention = FlexAttention()
    results = []
    for masks_device in ("cuda", "cpu"):
        masks = build_attention_masks(tokens.to(masks_device), mask_type, **MASK_ARGS[mask_type])
        if masks.dense_mask is not None:
            masks = replace(masks, dense_mask=masks.dense_mask.to(CUDA))
        inputs = [t.to(CUDA).requires_grad_() for t in (q, k, v)]
        out = attention(*inputs, masks=masks)
        out.square().sum().backward()
        results.append([out.detach(), *(t.grad for t in inputs)])
    assert results[0][0] is not None
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


# (query heads, kv heads, qk head dim, v head dim): the debug flex models' GQA, and MLA's unequal
# head dims that are not powers of 2 (DeepSeek-V3's debug model), with its softmax scale.
HEAD_SHAPES = {"gqa": (8, 2, 64, 64), "mla": (4, 4, 48, 32)}


@pytest.mark.parametrize("heads", list(HEAD_SHAPES))
def test_compiled_flex_block_mask_with_gqa_or_mla_heads_in_bf16_equals_the_dense_path(heads):
    n_q, n_kv, qk_dim, v_dim = HEAD_SHAPES[heads]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 8, (2, 512), generator=generator)
    q = torch.randn(2, n_q, 512, qk_dim, generator=generator)
    k = torch.randn(2, n_kv, 512, qk_dim, generator=generator)
    v = torch.randn(2, n_kv, 512, v_dim, generator=generator)
    results = []
    for masks_device in ("cuda", "cpu"):
        masks = build_attention_masks(tokens.to(masks_device), "block_causal", eos_id=0)
        if masks.dense_mask is not None:
            masks = replace(masks, dense_mask=masks.dense_mask.to(CUDA))
        inputs = [t.to(CUDA, torch.bfloat16).requires_grad_() for t in (q, k, v)]
        out = FlexAttention()(*inputs, masks=masks, scale=qk_dim**-0.5 * 0.9)
        out.float().square().sum().backward()
        results.append([out.detach(), *(t.grad for t in inputs)])
    assert results[0][0].shape == (2, n_q, 512, v_dim)
    for got, want in zip(*results):  # bf16 rounding is ~0.4% per element; a wrong mask is ~100%
        relative_error = (got.float() - want.float()).norm() / want.float().norm()
        assert relative_error < 2e-2, relative_error


def test_the_gradient_norm_on_cuda_equals_a_float64_norm_and_clips_to_max_norm():
    """The CUDA branch of the float64 norm (one foreach kernel) that the CPU suite never takes."""
    torch.manual_seed(0)
    sizes = [(3, torch.float32), (1 << 20, torch.float32), (4097, torch.bfloat16)]
    params = [nn.Parameter(torch.zeros(n, device=CUDA, dtype=dtype)) for n, dtype in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    grads = [p.grad.detach().double().cpu() for p in params]
    want = torch.cat(grads).norm()

    norm = clip_grad_norm_(params, max_norm=1.0)

    assert abs(norm.item() - want.item()) <= 1e-6 * want.item()
    for p, before in zip(params, grads):
        scaled = before * (1.0 / (want.item() + 1e-6))
        torch.testing.assert_close(
            p.grad.double().cpu(), scaled, rtol=1e-2 if p.dtype == torch.bfloat16 else 1e-5, atol=0
        )


def test_bf16_grouped_mm_experts_equal_the_loop_forward_and_backward():
    """Expert 1 gets no tokens: its weight gradients must be zeros (the padding of empty groups
    exists for them), and every other gradient must match the loop's."""
    torch.manual_seed(0)
    experts = GroupedExperts(dim=256, hidden_dim=512, num_experts=8).to(CUDA, torch.bfloat16)
    for weight in experts.parameters():
        nn.init.normal_(weight, std=0.02)
    x = torch.randn(1000, 256, device=CUDA, dtype=torch.bfloat16)
    counts = torch.tensor([300, 0, 200, 100, 150, 50, 100, 100], device=CUDA)
    assert experts.uses_grouped_mm(x)
    results = []
    for use_grouped_mm in (True, False):
        experts.use_grouped_mm = use_grouped_mm
        experts.zero_grad()
        inputs = x.clone().requires_grad_()
        out = experts(inputs, counts)
        out.float().square().sum().backward()
        results.append(
            [out.detach(), inputs.grad, *(w.grad.clone() for w in (experts.w1, experts.w2, experts.w3))]
        )
    for weight_grad in results[0][2:]:
        assert weight_grad[1].count_nonzero() == 0
    for got, want in zip(*results):
        relative_error = (got.float() - want.float()).norm() / want.float().norm()
        assert relative_error < 2e-2, relative_error


_ATTENTION_KERNELS = ops(
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
)


@pytest.mark.parametrize("mode, option, reruns", [("selective", "op", 0), ("full", "2", 1)])
def test_gpu_attention_kernel_is_saved_by_op_sac(mode, option, reruns):
    args = replace(llama3_flavors["debugmodel"], max_seq_len=1024)
    torch.manual_seed(0)
    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": TransformerBlock(0, args)})
    apply_ac(
        holder, ActivationCheckpoint(mode=mode, selective_ac_option=option), op_sac_save_list=LLAMA3_SAVE_LIST
    )
    block = holder.layers["0"].to(CUDA, torch.bfloat16)
    x = torch.randn(2, 1024, args.dim, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    rope = precompute_rope_cache(args.head_dim, 1024, args.rope_theta).to(CUDA)
    with OpCounter(_ATTENTION_KERNELS) as counter:
        out = block(x, rope)
        counter.start_backward()
        out.float().sum().backward()
    assert counter.count(phase=BACKWARD) == reruns


@pytest.mark.parametrize(
    "attention",
    [[], ["--model.attn_backend", "flex", "--model.attn_mask_type", "chunked",
          "--model.attn_chunk_size", "64", "--model.attn_global_every_n_layers", "2"]],
    ids=["sdpa", "chunked with global layers"],
)  # fmt: skip
def test_bf16_training_with_op_sac_and_compile_learns(tmp_path, attention):
    """The flex case runs two BlockMasks (chunked, causal) through the same compiled blocks."""
    argv = ["--config", "debug_model.toml", "--training.steps", "30", "--metrics.log_freq", "1",
            "--training.mixed_precision_param", "bfloat16",
            "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
            "--compile.enable", "--job.dump_folder", str(tmp_path), *attention]  # fmt: skip
    proc = run_trainer(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert records[-1]["loss"] <= 0.6 * records[0]["loss"], records
    assert records[-1]["mfu_pct"] is not None and records[-1]["memory/max_allocated_gib"] > 0


def test_memory_snapshots_are_written_at_the_profile_steps_with_the_allocator_history(tmp_path):
    argv = ["--config", "debug_model.toml", "--training.steps", "4", "--profiling.enable_memory_snapshot",
            "--profiling.profile_freq", "2", "--job.dump_folder", str(tmp_path)]  # fmt: skip
    proc = run_trainer(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "memory_snapshot"
    assert sorted(p.name for p in folder.iterdir()) == ["iteration_2", "iteration_4"]
    with open(folder / "iteration_4" / "rank0_memory_snapshot.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"], "no allocator segments recorded"
    assert any(trace for trace in snapshot["device_traces"]), "no allocation history recorded"


def test_a_resume_from_a_pinned_memory_async_save_repeats_the_run(tmp_path):
    """Step 5 saves but does not log: no loss.item() waits for its optimizer step before the
    stager's copy starts (the save itself must)."""
    argv = ["--config", "debug_model.toml", "--training.steps", "10", "--metrics.log_freq", "2",
            "--checkpoint.enable", "--checkpoint.interval", "5",
            "--checkpoint.async_mode", "async_with_pinned_mem"]  # fmt: skip
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    proc = run_trainer(argv + ["--job.dump_folder", str(full)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(full / "checkpoint" / "step-5", resumed / "checkpoint" / "step-5")
    proc = run_trainer(argv + ["--job.dump_folder", str(resumed)])
    assert proc.returncode == 0, proc.stderr[-3000:]

    original = {r["step"]: r["loss"] for r in read_metrics(full)}
    again = {r["step"]: r["loss"] for r in read_metrics(resumed)}
    assert sorted(again) == [6, 8, 10]
    # Not bit for bit: CUDA's embedding and attention backward accumulate with atomics. Saving
    # the next step's weights instead would move the loss by far more than this.
    assert all(abs(again[s] - original[s]) <= 1e-4 * original[s] for s in again), (again, original)


def test_float8_training_with_op_sac_and_compile_learns(tmp_path):
    argv = ["--config", "debug_model.toml", "--training.steps", "30", "--metrics.log_freq", "1",
            "--training.mixed_precision_param", "bfloat16", "--model.converters", "float8",
            "--activation_checkpoint.mode", "selective",
            "--activation_checkpoint.selective_ac_option", "op", "--compile.enable",
            "--job.dump_folder", str(tmp_path)]  # fmt: skip
    proc = run_trainer(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Float8 training (tensorwise): 42 Linear layers converted" in proc.stderr
    records = read_metrics(tmp_path)
    assert records[-1]["loss"] <= 0.6 * records[0]["loss"], records


def _second_step(early_step_in_backward: bool, device: torch.device = CUDA) -> tuple[int, float, int]:
    """The peak allocated bytes and the loss of a steady-state step (the second) of the Llama 3
    debug model in fp32 without AC, and the bytes of its gradients."""
    argv = ["--config", "debug_model.toml", "--training.max_norm", "0",
            "--activation_checkpoint.mode", "none",
            "--optimizer.early_step_in_backward", str(early_step_in_backward).lower()]  # fmt: skip
    cfg = parse_args(argv, env={})
    spec = get_train_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(spec.flavors[cfg.model.flavor])
    spec.parallelize_fn(model, ParallelDims(1, 1, 1, 1), cfg, device)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    optimizer = build_optimizer(model, cfg, device)
    tokens = torch.randint(0, 2048, (1, 33), generator=torch.Generator().manual_seed(0)).to(device)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if not early_step_in_backward:
            optimizer.step()
        return loss.item()

    step()  # creates the optimizer state
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = step()
    torch.cuda.synchronize(device)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return torch.cuda.max_memory_allocated(device), loss, grad_bytes


def test_stepping_in_backward_lowers_a_steps_peak_by_most_of_the_gradients():
    """At 1 x 32 tokens the activations are far smaller than the weights, so the usual step
    peaks at the optimizer step (weights, gradients, Adam's moments); stepping in backward
    holds only the gradients backward has not yet reached."""
    after_peak, after_loss, grad_bytes = _second_step(False)
    during_peak, during_loss, _ = _second_step(True)
    print(f"peak of a step: {after_peak / 2**20:.1f} MiB stepping after backward, "
          f"{during_peak / 2**20:.1f} MiB in it; gradients {grad_bytes / 2**20:.1f} MiB")  # fmt: skip
    assert during_loss == pytest.approx(after_loss, rel=1e-6)
    assert during_peak <= after_peak - grad_bytes // 2, (during_peak, after_peak, grad_bytes)


@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_memory_hands_the_step_page_locked_batches(tmp_path, workers):
    """`training.dataloader_pin_memory`, in the training process (packed data) and behind loader
    workers (a stream of local shards, taken as a hub dataset is)."""
    import json

    from torchtitan.components.dataloader import build_text_dataloader
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    dataset = "smoke"
    if workers:
        stream = tmp_path / "stream"
        stream.mkdir()
        for shard in range(workers):
            docs = [f"shard {shard} document {i} " * 20 for i in range(10)]
            (stream / f"part{shard}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        dataset = str(stream)
    cfg = parse_args(["--training.dataset", dataset, "--training.seq_len", "64",
                      "--training.local_batch_size", "2", "--training.dataloader_pin_memory",
                      "--training.dataloader_num_workers", str(workers)], env={})  # fmt: skip
    loader = build_text_dataloader(cfg, HuggingFaceTokenizer(cfg.model.hf_assets_path), 0, 1)
    inputs, labels = next(iter(loader))
    assert loader.num_workers == workers and loader.pin_memory
    assert inputs.is_pinned() and labels.is_pinned()
