"""Every parallel layout trains as one process does, gradient by gradient (`tests/parity.py`).

Each layout runs the real trainer for 2 steps with an AC mode, and is compared with the same
config in one process without AC: every gradient after step 1, every parameter after step 2
and both steps' losses, each within the fp32 tolerance `tests/parity.py` derives. The configs
keep their own learning rates. Each family of checks also catches a bug planted from outside
the production code (the `plant_*` tests). Wider matrices (every AC mode on every EP layout)
are in test_expert_parallel.py and test_parallelism.py under `full_matrix`.
"""

from pathlib import Path

import pytest

from tests.parity import AC_ARGV, FP32_RTOL, assert_parity, reference, train_for_parity

pytestmark = pytest.mark.integration

CONFIGS = {
    "llama3": "debug_model.toml",
    "llama3 flex": "debug_model_flex_attn.toml",
    "qwen3": "qwen3_debug_model.toml",
    "qwen3 moe": "qwen3_debug_model_moe.toml",
    "deepseek_v3": "deepseek_v3_debug_model.toml",
    "llama3 window": "debug_model_flex_attn.toml",
    "llama3 global layers": "debug_model_flex_attn.toml",
}
# What a model entry sets besides its config file, in every layout and in its reference.
MODEL_ARGV = {
    "llama3 window": ["--model.attn_mask_type", "sliding_window", "--model.sliding_window", "24"],
    "llama3 global layers": ["--model.attn_mask_type", "chunked", "--model.attn_chunk_size", "16",
                             "--model.attn_global_every_n_layers", "2"],
}  # fmt: skip
GLOBAL_BATCH = 4
COMMON = ["--training.seq_len", "64", "--training.mixed_precision_param", "float32",
          "--training.global_batch_size", str(GLOBAL_BATCH)]  # fmt: skip

_P = "--parallelism."
TP2 = [_P + "tensor_parallel_degree", "2"]
ETP2 = [*TP2, _P + "expert_tensor_parallel_degree", "2"]
EP_OVER_TP2 = [*TP2, _P + "expert_tensor_parallel_degree", "1"]
EP2, EP4 = [_P + "expert_parallel_degree", "2"], [_P + "expert_parallel_degree", "4"]
REPLICATE2 = [_P + "data_parallel_replicate_degree", "2"]
DDP2 = [*REPLICATE2, _P + "data_parallel_shard_degree", "1"]
COMPILE = ["--compile.enable"]
COMPILE_AOT_EAGER = [*COMPILE, "--compile.backend", "aot_eager"]

# name: (model, processes, local batch, layout argv, AC mode). Every layout against the
# reference without AC; among them every AC mode, compiled and flex blocks.
LAYOUTS = {
    "1 process, 2 micro-batches": ("llama3", 1, 2, [], "selective 2"),
    "FSDP 2": ("llama3", 2, 2, [], "full"),
    "HSDP 2 x 2": ("llama3", 4, 1, REPLICATE2, "op-SAC"),
    "DDP 2, 2 micro-batches": ("llama3", 2, 1, DDP2, "none"),
    "TP 2": ("llama3", 2, 4, TP2, "selective 2"),
    "TP 2 without loss parallel": ("llama3", 2, 4, [*TP2, _P + "disable_loss_parallel"], "op-SAC"),
    "FSDP 2 x TP 2": ("llama3", 4, 2, TP2, "op-SAC"),
    "TP 2 compiled": ("llama3", 2, 4, TP2 + COMPILE, "op-SAC"),  # full_matrix (MARKS)
    "FSDP 2 compiled, flex": ("llama3 flex", 2, 2, COMPILE, "op-SAC"),
    "Qwen3 TP 2": ("qwen3", 2, 4, TP2, "full"),
    "Qwen3 MoE FSDP 2": ("qwen3 moe", 2, 2, [], "op-SAC"),
    "Qwen3 MoE EP 2": ("qwen3 moe", 2, 2, EP2, "full"),
    "Qwen3 MoE EP 2, 2 micro-batches": ("qwen3 moe", 2, 1, EP2, "op-SAC"),
    "Qwen3 MoE HSDP 2 x 2, EP 2": ("qwen3 moe", 4, 1, EP2 + REPLICATE2, "full replay"),
    "Qwen3 MoE EP 2 x ETP 2": ("qwen3 moe", 4, 2, EP2 + ETP2, "op-SAC"),
    "Qwen3 MoE EP 2 over TP 2": ("qwen3 moe", 2, 4, EP2 + EP_OVER_TP2, "full"),
    "Qwen3 MoE FSDP 4 x EP 2 x ETP 2": ("qwen3 moe", 8, 1, EP2 + ETP2, "full"),
    "DeepSeek-V3 FSDP 2": ("deepseek_v3", 2, 2, [], "full"),
    "Qwen3 MoE TP 2": ("qwen3 moe", 2, 4, ETP2, "op-SAC"),
    "DeepSeek-V3 TP 2": ("deepseek_v3", 2, 4, ETP2, "op-SAC"),
    "DeepSeek-V3 FSDP 2 x TP 2": ("deepseek_v3", 4, 2, ETP2, "full"),
    # Compiled, the shared experts' input gradient comes back whole, not a partial sum (dynamo's
    # refusal, so aot_eager shows it without inductor's C++ builds).
    "DeepSeek-V3 TP 2 compiled": (
        "deepseek_v3",
        2,
        4,
        ETP2 + COMPILE + ["--compile.backend", "aot_eager"],
        "none",
    ),
    "DeepSeek-V3 FSDP 4, EP 2": ("deepseek_v3", 4, 1, EP2, "full replay"),
    "DeepSeek-V3 FSDP 2 x TP 2, EP 4 over TP": ("deepseek_v3", 4, 2, EP4 + EP_OVER_TP2, "op-SAC"),
}


CSV = Path(__file__).with_name("looped_schedule_pp2.csv")


def _pp(degree: int, schedule: str, *extra: str) -> list[str]:
    return [_P + "pipeline_parallel_degree", str(degree), _P + "pipeline_parallel_schedule", schedule, *extra]


# Pipeline layouts (fp32, 4 microbatches of 1 per step where dp is 1), the same tolerance: a
# stage computes what the whole model computes for its blocks, and the microbatches' gradients
# add up as the batch's. Every schedule torch has, each AC mode, and PP with FSDP, TP and EP.
FULL = pytest.mark.full_matrix
PIPELINE_LAYOUTS = {
    "PP 2, 1F1B": (("llama3", 2, 4, _pp(2, "1F1B"), "op-SAC"), ()),
    "PP 2, ZBVZeroBubble": (("llama3", 2, 4, _pp(2, "ZBVZeroBubble"), "full"), ()),
    "PP 2 x FSDP 2, Interleaved1F1B": (("llama3", 4, 2, _pp(2, "Interleaved1F1B"), "selective 2"), FULL),
    "DeepSeek-V3 PP 2, 1F1B": (("deepseek_v3", 2, 4, _pp(2, "1F1B"), "full"), FULL),
    # A breadth-first schedule of 2 stages per rank, read from a CSV of per-rank actions.
    "PP 2, CSV schedule": (
        ("llama3", 2, 4, _pp(2, "LoopedBFS", _P + "pipeline_parallel_schedule_csv", str(CSV)), "full"),
        (),
    ),
    "PP 2, GPipe": (("llama3", 2, 4, _pp(2, "GPipe"), "none"), FULL),
    "PP 2, GPipe, full AC": (("llama3", 2, 4, _pp(2, "GPipe"), "full"), FULL),
    "PP 2, 1F1B, full AC": (("llama3", 2, 4, _pp(2, "1F1B"), "full"), FULL),
    "PP 2, Interleaved1F1B": (("llama3", 2, 4, _pp(2, "Interleaved1F1B"), "op-SAC"), FULL),
    "PP 2, LoopedBFS": (("llama3", 2, 4, _pp(2, "LoopedBFS"), "full"), FULL),
    "PP 2, ZBVZeroBubble, op-SAC": (("llama3", 2, 4, _pp(2, "ZBVZeroBubble"), "op-SAC"), FULL),
    "PP 2, ZBVZeroBubble, no AC": (("llama3", 2, 4, _pp(2, "ZBVZeroBubble"), "none"), FULL),
    "PP 2, DualPipeV": (("llama3", 2, 4, _pp(2, "DualPipeV"), "op-SAC"), FULL),
    "PP 2, DualPipeV, full AC": (("llama3", 2, 4, _pp(2, "DualPipeV"), "full"), FULL),
    "PP 4, InterleavedZeroBubble": (("llama3", 4, 4, _pp(4, "InterleavedZeroBubble"), "full"), FULL),
    "PP 2 x FSDP 2, 1F1B": (("llama3", 4, 2, _pp(2, "1F1B"), "op-SAC"), FULL),
    "PP 2, 1F1B, compiled blocks": (("llama3", 2, 4, _pp(2, "1F1B") + COMPILE_AOT_EAGER, "op-SAC"), FULL),
    "PP 2 x FSDP 2, ZBVZeroBubble": (("llama3", 4, 2, _pp(2, "ZBVZeroBubble"), "full"), FULL),
    "PP 2 x TP 2, 1F1B": (("llama3", 4, 4, _pp(2, "1F1B") + TP2, "op-SAC"), FULL),
    "PP 2 x TP 2, Interleaved1F1B": (("llama3", 4, 4, _pp(2, "Interleaved1F1B") + TP2, "full"), FULL),
    "Qwen3 MoE PP 2": (("qwen3 moe", 2, 4, _pp(2, "1F1B"), "op-SAC"), FULL),
    "Qwen3 MoE PP 2 x EP 2": (("qwen3 moe", 4, 2, _pp(2, "1F1B") + EP2, "full"), FULL),
    "DeepSeek-V3 PP 2 x EP 2": (("deepseek_v3", 4, 2, _pp(2, "Interleaved1F1B") + EP2, "op-SAC"), FULL),
}
LAYOUTS.update({name: layout for name, (layout, _) in PIPELINE_LAYOUTS.items()})


def _cp(method: str, *extra: str) -> list[str]:
    return [_P + "context_parallel_degree", "2", _P + "context_parallel_method", method, *extra]


# Context-parallel layouts (CP 2: each 64-token sequence split over 2 ranks, 4 chunks of 16 with
# the headtail balancer), the same tolerance: each rank computes its tokens' rows of one
# process's attention, and the FSDP average over the CP ranks is the whole sequence's mean.
CONTEXT_LAYOUTS = {
    "CP 2, allgather_kv": (("llama3", 2, 4, _cp("allgather_kv"), "op-SAC"), ()),
    "CP 2, ulysses, flex block_causal": (("llama3 flex", 2, 4, _cp("ulysses"), "full"), ()),
    "CP 2, allgather_kv, flex block_causal": (("llama3 flex", 2, 4, _cp("allgather_kv"), "none"), FULL),
    "CP 2, ulysses": (("llama3", 2, 4, _cp("ulysses"), "op-SAC"), FULL),
    "CP 2, allgather_kv, flex sliding_window": (("llama3 window", 2, 4, _cp("allgather_kv"), "op-SAC"), FULL),
    "CP 2, ulysses, flex sliding_window": (("llama3 window", 2, 4, _cp("ulysses"), "full"), FULL),
    "CP 2, ulysses, flex chunked with global layers": (
        ("llama3 global layers", 2, 4, _cp("ulysses"), "op-SAC"), FULL),
    "CP 2, contiguous chunks": (
        ("llama3", 2, 4, _cp("allgather_kv", _P + "context_parallel_load_balancer", "none"), "full"), FULL),
    "CP 2 x FSDP 2, allgather_kv": (("llama3", 4, 2, _cp("allgather_kv"), "full"), FULL),
    "CP 2 x FSDP 2, ulysses": (("llama3", 4, 2, _cp("ulysses"), "op-SAC"), FULL),
    "HSDP 2 x CP 2, ulysses": (("llama3", 4, 2, _cp("ulysses") + REPLICATE2, "full"), FULL),
    "CP 2 compiled, flex": (("llama3 flex", 2, 4, _cp("allgather_kv") + COMPILE, "op-SAC"), FULL),
    "CP 2 x TP 2, allgather_kv": (("llama3", 4, 4, _cp("allgather_kv") + TP2, "op-SAC"), FULL),
    "CP 2 x TP 2, ulysses": (("llama3", 4, 4, _cp("ulysses") + TP2, "full"), FULL),
    "Qwen3 CP 2, ulysses": (("qwen3", 2, 4, _cp("ulysses"), "op-SAC"), FULL),
    "Qwen3 MoE CP 2, allgather_kv": (("qwen3 moe", 2, 4, _cp("allgather_kv"), "full"), FULL),
    "DeepSeek-V3 CP 2, allgather_kv": (("deepseek_v3", 2, 4, _cp("allgather_kv"), "op-SAC"), FULL),
    "DeepSeek-V3 CP 2, ulysses": (("deepseek_v3", 2, 4, _cp("ulysses"), "full"), FULL),
    # The EP group takes the CP ranks (as in torchtitan): EP 2 on CP 2 is 2 ranks.
    # Full AC replays EP's all-to-alls and re-issues CP's, on a group of the same ranks.
    "Qwen3 MoE CP 2 x EP 2, ulysses": (("qwen3 moe", 2, 4, _cp("ulysses") + EP2, "full replay"), ()),
    "Qwen3 MoE CP 2 x EP 2, allgather_kv": (("qwen3 moe", 2, 4, _cp("allgather_kv") + EP2, "op-SAC"), FULL),
    "Qwen3 MoE CP 2 x EP 2, no AC": (("qwen3 moe", 2, 4, _cp("allgather_kv") + EP2, "none"), FULL),
    "Qwen3 MoE FSDP 2 x CP 2, EP 2": (("qwen3 moe", 4, 2, _cp("ulysses") + EP2, "op-SAC"), FULL),
    "Qwen3 MoE FSDP 2 x CP 2, EP 4": (("qwen3 moe", 4, 2, _cp("allgather_kv") + EP4, "full"), FULL),
    "Qwen3 MoE CP 2 x TP 2, EP 4 over TP": (("qwen3 moe", 4, 4, _cp("ulysses") + EP4 + EP_OVER_TP2, "op-SAC"),
                                            FULL),
    "DeepSeek-V3 CP 2 x EP 2, ulysses": (("deepseek_v3", 2, 4, _cp("ulysses") + EP2, "op-SAC"), FULL),
    # Every stage runs this rank's share of each sequence; 4 microbatches of 1 where dp is 1.
    "CP 2 x PP 2, 1F1B, allgather_kv": (("llama3", 4, 4, _cp("allgather_kv") + _pp(2, "1F1B"), "op-SAC"), ()),
    "CP 2 x PP 2, ZBVZeroBubble, ulysses": (
        ("llama3", 4, 4, _cp("ulysses") + _pp(2, "ZBVZeroBubble"), "full"), FULL),
    "CP 2 x PP 2, Interleaved1F1B, no AC": (
        ("llama3", 4, 4, _cp("allgather_kv") + _pp(2, "Interleaved1F1B"), "none"), FULL),
    "Qwen3 MoE CP 2 x PP 2 x EP 2": (
        ("qwen3 moe", 4, 4, _cp("ulysses") + _pp(2, "1F1B") + EP2, "full replay"), FULL),
}  # fmt: skip


def _every_ac_mode_on_each_cp_layout() -> dict:
    """Each CP layout of the wider matrix under each method and AC mode (none, full, op-SAC),
    `full_matrix`; a combination already above is not run twice."""
    bases = {
        "CP 2": ("llama3", 2, 4, []),
        "CP 2, flex block_causal": ("llama3 flex", 2, 4, []),
        "CP 2, flex sliding_window": ("llama3 window", 2, 4, []),
        "CP 2 x FSDP 2": ("llama3", 4, 2, []),
        "CP 2 x TP 2": ("llama3", 4, 4, TP2),
    }
    known = [layout for layout, _ in CONTEXT_LAYOUTS.values()]
    wider = {}
    for name, (model, nproc, local_batch, extra) in bases.items():
        for method in ("allgather_kv", "ulysses"):
            for ac in ("none", "full", "op-SAC"):
                layout = (model, nproc, local_batch, _cp(method) + extra, ac)
                if layout not in known:
                    wider[f"{name}, {method}, AC {ac}"] = (layout, FULL)
    return wider


CONTEXT_LAYOUTS.update(_every_ac_mode_on_each_cp_layout())
LAYOUTS.update({name: layout for name, (layout, _) in CONTEXT_LAYOUTS.items()})
# Activation offload (`[activation_checkpoint] offload = "saved"`), every activation of these
# models (4 KiB and more) through the host pool, the same tolerance: offload moves bytes, and the
# numbers that come back are the numbers that left (bit for bit in one process:
# tests/unit/test_activation_offload.py).
OFFLOAD = ["--activation_checkpoint.offload", "saved", "--activation_checkpoint.offload_min_bytes", "4096"]
OFFLOAD_LAYOUTS = {
    "Qwen3 MoE EP 2, offload": (("qwen3 moe", 2, 2, EP2 + OFFLOAD, "op-SAC"), ()),
    "Qwen3 MoE FSDP 2, offload": (("qwen3 moe", 2, 2, OFFLOAD, "op-SAC"), FULL),
    "Qwen3 MoE FSDP 2, offload, full AC": (("qwen3 moe", 2, 2, OFFLOAD, "full"), FULL),
    "Qwen3 MoE TP 2, offload": (("qwen3 moe", 2, 4, ETP2 + OFFLOAD, "op-SAC"), FULL),
    "Qwen3 MoE TP 2, offload, no AC": (("qwen3 moe", 2, 4, ETP2 + OFFLOAD, "none"), FULL),
    "Qwen3 MoE EP 2, offload, full AC replay": (("qwen3 moe", 2, 2, EP2 + OFFLOAD, "full replay"), FULL),
    "Qwen3 MoE EP 2, offload, no AC": (("qwen3 moe", 2, 2, EP2 + OFFLOAD, "none"), FULL),
    "Qwen3 MoE EP 2, 2 micro-batches, offload": (("qwen3 moe", 2, 1, EP2 + OFFLOAD, "op-SAC"), FULL),
    "PP 2, 1F1B, offload": (("llama3", 2, 4, _pp(2, "1F1B") + OFFLOAD, "full"), FULL),
    "CP 2, allgather_kv, offload": (("llama3", 2, 4, _cp("allgather_kv") + OFFLOAD, "op-SAC"), FULL),
    "CP 2, ulysses, offload": (("llama3", 2, 4, _cp("ulysses") + OFFLOAD, "op-SAC"), FULL),
    "FSDP 2 x TP 2, offload": (("llama3", 4, 2, TP2 + OFFLOAD, "op-SAC"), FULL),
}  # fmt: skip
LAYOUTS.update({name: layout for name, (layout, _) in OFFLOAD_LAYOUTS.items()})
# Mode "auto" with a given plan (every choice on some block: see tests/parity.py); the trainer's
# planning at startup under FSDP 2 is in test_ac_auto.py.
AUTO_LAYOUTS = {
    "FSDP 2 x TP 2, auto plan": (("llama3", 4, 2, TP2, "auto plan"), ()),
    "Qwen3 MoE EP 2, auto plan": (("qwen3 moe", 2, 2, EP2, "auto plan"), FULL),
    "DeepSeek-V3 FSDP 2, auto plan": (("deepseek_v3", 2, 2, [], "auto plan"), FULL),
    "PP 2, 1F1B, auto plan": (("llama3", 2, 4, _pp(2, "1F1B"), "auto plan"), FULL),
}  # fmt: skip
LAYOUTS.update({name: layout for name, (layout, _) in AUTO_LAYOUTS.items()})
MARKS = {
    name: marks
    for name, (_, marks) in {**PIPELINE_LAYOUTS, **CONTEXT_LAYOUTS, **OFFLOAD_LAYOUTS, **AUTO_LAYOUTS}.items()
}
# Compiled TP trains by default in test_parallelism.py (without loss parallel, and memory_budget).
MARKS["TP 2 compiled"] = MARKS["DeepSeek-V3 TP 2 compiled"] = FULL
# 8 processes; EP x ETP runs by default on 4 ("Qwen3 MoE EP 2 x ETP 2").
MARKS["Qwen3 MoE FSDP 4 x EP 2 x ETP 2"] = FULL

_references: dict = {}


def reference_of(model: str):
    """The model's config in one process without AC, on the whole global batch; once per session."""
    if model not in _references:
        _references[model] = reference(_argv(model, GLOBAL_BATCH))
    return _references[model]


def _argv(model: str, local_batch: int, extra=()) -> list[str]:
    return ["--config", CONFIGS[model], *MODEL_ARGV.get(model, ()), *COMMON,
            "--training.local_batch_size", str(local_batch), *extra]  # fmt: skip


def run_layout(name: str, plant: str = "none"):
    model, nproc, local_batch, argv, ac = LAYOUTS[name]
    return train_for_parity(_argv(model, local_batch, argv + AC_ARGV[ac]), nproc, plant=plant)


@pytest.mark.parametrize("layout", [pytest.param(name, marks=MARKS.get(name, ())) for name in LAYOUTS])
def test_layout_gives_every_gradient_and_parameter_of_one_process_without_ac(layout, record_property):
    worst = assert_parity(run_layout(layout), reference_of(LAYOUTS[layout][0]))
    record_property("worst_step_1_gradient_error", worst)
    ac = LAYOUTS[layout][4]
    print(f"\n{layout} ({ac}): worst step-1 gradient error {worst:.1e} (tolerance {FP32_RTOL:.0e})")


GRADIENT_OFF = "gradients after step 1 off by more than 1e-05; the worst: "


@pytest.mark.parametrize(
    "layout, bug, expected",
    [("TP 2", "unreduced-norm-grad", GRADIENT_OFF + "layers.0.attention_norm.weight"),
     ("Qwen3 MoE EP 2", "swapped-expert-rows", GRADIENT_OFF + "layers.0.moe.experts.w1"),
     ("FSDP 2", "scaled-shard", GRADIENT_OFF + "layers.1.attention.wq.weight"),
     # Clipping hides a uniform gradient scale; the loss, logged from the schedule, shows it.
     ("PP 2, 1F1B", "unscaled-microbatches", "losses off by more than 1e-05; the worst: loss at step"),
     ("CP 2, allgather_kv", "keys-in-rank-order", GRADIENT_OFF),
     ("Qwen3 MoE CP 2 x EP 2, allgather_kv", "experts-mean-without-cp", GRADIENT_OFF)],
    ids=["a norm weight's TP partial gradient left unreduced", "two expert rows' gradients swapped under EP",
         "one FSDP shard's gradient scaled by 1 + 1e-3", "a pipeline loss not divided by its microbatches",
         "gathered keys masked as if they were in sequence order",
         "experts' gradients averaged as if the CP ranks saw the same tokens"],
)  # fmt: skip
def test_a_planted_bug_fails_the_check_naming_what_is_off(layout, bug, expected):
    with pytest.raises(AssertionError) as failed:
        assert_parity(run_layout(layout, plant=bug), reference_of(LAYOUTS[layout][0]))
    message = str(failed.value)
    assert expected in message, message
