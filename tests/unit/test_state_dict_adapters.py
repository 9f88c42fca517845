"""State-dict adapters, checked against transformers itself: the HF keys and shapes, the
config.json, the logits either way, the safetensors files, and the conversion scripts."""

import json
import logging
import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from tests.conftest import launch_ranks, load_script
from tests.model_testing import init_on_cpu
from torchtitan.components.hf_io import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, load_hf, save_hf
from torchtitan.config.manager import parse_args
from torchtitan.config.toml_writer import to_toml
from torchtitan.models import build_state_dict_adapter, get_train_spec
from torchtitan.models.rope import RoPEScaling, YaRNScaling
from torchtitan.protocols.state_dict_adapter import (
    HFConfigError,
    StateDictMismatchError,
    describe_mismatch,
    half_split_to_interleaved,
    hf_config_differences,
    interleaved_to_half_split,
)
from torchtitan.protocols.train_spec import import_custom_module

# The tests save and load DCP checkpoints in one process on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "checkpoint_conversion"

# name -> (model, flavor, arg overrides). Together they take every adapter path: GQA with the
# rotary permutation (plus Llama 3.1 scaling), Qwen3's q/k norms, tied embeddings, routed
# experts, and MLA with and without the query bottleneck. The scaled RoPE's short original
# context puts the debug model's frequencies in all three bands of Llama 3.1 scaling.
CASES = {
    "llama3": ("llama3", "debugmodel", {}),
    "llama3_rope_scaling": (
        "llama3", "debugmodel", {"rope_scaling": RoPEScaling(factor=8.0, original_max_position_embeddings=64)}
    ),
    "qwen3": ("qwen3", "debugmodel", {}),
    "qwen3_tied": ("qwen3", "debugmodel", {"tie_word_embeddings": True}),
    "qwen3_moe": ("qwen3", "debugmodel_moe", {}),
    "deepseek_v3": ("deepseek_v3", "debugmodel", {}),
    "deepseek_v3_q_lora": ("deepseek_v3", "debugmodel", {"q_lora_rank": 32}),
    # YaRN over an original 512 positions (the RoPE table is longer): the 8 rotary frequencies
    # span the kept, blended and interpolated bands, and unequal mscales make both the cos/sin
    # factor and the softmax scale differ from 1.
    "deepseek_v3_yarn": ("deepseek_v3", "debugmodel", {"rope_scaling": YaRNScaling(
        factor=4.0, original_max_position_embeddings=512, mscale=1.0, mscale_all_dim=0.7)}),
    # Softmax routing (the 16B flavor's): exported as transformers' DeepseekV2ForCausalLM.
    "deepseek_v2": ("deepseek_v3", "debugmodel", {"moe_args": replace(
        get_train_spec("deepseek_v3").get_flavor("debugmodel").moe_args, score_func="softmax",
        route_norm=False, num_expert_groups=None, num_limited_groups=None)}),
}  # fmt: skip
# Models whose HF counterpart has no expert bias: it stays zero here, as from_hf leaves it.
WITHOUT_HF_EXPERT_BIAS = {"qwen3_moe", "deepseek_v2"}
BIAS_NAMES = ("expert_bias", "e_score_correction_bias")


def _args(case: str):
    model, flavor, overrides = CASES[case]
    return replace(get_train_spec(model).get_flavor(flavor), **overrides)


def _adapter(case: str):
    return get_train_spec(CASES[case][0]).state_dict_adapter(_args(case))


def _meta_model(case: str) -> torch.nn.Module:
    return get_train_spec(CASES[case][0]).build_meta_model(_args(case), torch.float32)


def _random_state_dict(case: str) -> dict[str, torch.Tensor]:
    """Distinct random values everywhere, so that a misplaced row, head or expert shows. HF
    Qwen3-MoE has no expert bias (see `test_qwen3_moe_expert_bias_has_no_hf_slot`): zero there."""
    torch.manual_seed(0)
    state_dict = {key: torch.randn(t.shape) for key, t in _meta_model(case).state_dict().items()}
    if case in WITHOUT_HF_EXPERT_BIAS:
        for key in [key for key in state_dict if key.endswith("expert_bias")]:
            state_dict[key].zero_()
    return state_dict


@torch.no_grad()
def _initialized_model(case: str) -> torch.nn.Module:
    """Our model after the trainer's init, with the norm weights (all ones after init, so blind to
    their order) and DeepSeek's expert bias (which HF adds too) made random."""
    model = _meta_model(case)
    init_on_cpu(model)
    for name, tensor in model.state_dict().items():
        if name.endswith("norm.weight"):
            tensor.mul_(1 + 0.3 * torch.randn_like(tensor))
        elif name.endswith("expert_bias") and case not in WITHOUT_HF_EXPERT_BIAS:
            tensor.copy_(0.05 * torch.randn_like(tensor))
    return model


@torch.no_grad()
def _well_scaled_random_(hf_model: torch.nn.Module) -> None:
    """Random weights of unit-scale activations: transformers' own init (std 0.02) leaves
    attention nearly uniform, where a RoPE layout error would hardly show."""
    torch.manual_seed(1)
    for name, tensor in hf_model.state_dict().items():
        if name.endswith(BIAS_NAMES):
            tensor.copy_(0.05 * torch.randn_like(tensor))
        elif tensor.dim() == 1:
            tensor.copy_(1 + 0.3 * torch.randn_like(tensor))
        else:
            tensor.copy_(torch.randn_like(tensor) * tensor.shape[-1] ** -0.5)


def _tokens(case: str) -> torch.Tensor:
    return torch.randint(0, _args(case).vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))


def _shapes(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {key: tuple(tensor.shape) for key, tensor in state_dict.items()}


@pytest.fixture(scope="module")
def transformers():
    transformers = pytest.importorskip("transformers", minversion="5.0")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


@pytest.fixture(scope="module")
def hf_checkpoints(transformers, tmp_path_factory):
    """case -> (folder of a checkpoint that transformers' `save_pretrained` wrote for the
    architecture of `hf_config()`, that model's logits on `_tokens(case)`); made once per case."""
    made = {}

    def make(case: str):
        if case not in made:
            config = transformers.AutoConfig.for_model(**_adapter(case).hf_config())
            hf_model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
            _well_scaled_random_(hf_model)
            folder = tmp_path_factory.mktemp(case)
            hf_model.save_pretrained(folder)
            with torch.no_grad():
                made[case] = folder, hf_model(_tokens(case)).logits
        return made[case]

    return make


def _load_script(name: str):
    return load_script(f"scripts/checkpoint_conversion/{name}.py")


@pytest.fixture(scope="module")
def from_hf_script():
    return _load_script("convert_from_hf")


@pytest.fixture(scope="module")
def to_hf_script():
    return _load_script("convert_to_hf")


# --- the adapters ---------------------------------------------------------------------------


def test_rope_permutation_moves_our_pairs_to_hf_halves_per_head():
    # Two heads of width 4: our pairs (0,1),(2,3) become HF's (0,2),(1,3), per head.
    rows = torch.arange(8)
    assert interleaved_to_half_split(rows, head_dim=4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    weight = torch.randn(8, 3)
    assert torch.equal(half_split_to_interleaved(interleaved_to_half_split(weight, 4), 4), weight)


@pytest.mark.parametrize("case", list(CASES))
def test_from_hf_inverts_to_hf_bitwise(case):
    adapter, state_dict = _adapter(case), _random_state_dict(case)
    back = adapter.from_hf(adapter.to_hf(state_dict))
    assert back.keys() == state_dict.keys()
    for key, tensor in state_dict.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


@pytest.mark.parametrize("case", list(CASES))
def test_to_hf_gives_the_keys_and_shapes_transformers_saves(case, hf_checkpoints):
    folder, _ = hf_checkpoints(case)
    ours = _adapter(case).to_hf(_random_state_dict(case))
    assert _shapes(ours) == _shapes(load_hf(folder))


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_reproduces_our_logits(case, transformers, tmp_path):
    model, adapter = _initialized_model(case), _adapter(case)
    save_hf(adapter.to_hf(model.state_dict()), adapter.hf_config(), tmp_path)
    hf_model, loading = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        ours, theirs = model(_tokens(case)), hf_model(_tokens(case)).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_checkpoint_gives_its_logits_here(case, hf_checkpoints):
    folder, hf_logits = hf_checkpoints(case)
    model = _initialized_model(case)  # for its RoPE cache, which is not in the state dict
    model.load_state_dict(_adapter(case).from_hf(load_hf(folder)), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens(case)), hf_logits, atol=1e-4, rtol=1e-4)


# Values from the published config.json of meta-llama/Llama-3.1-8B, Qwen/Qwen3-30B-A3B,
# deepseek-ai/DeepSeek-V3 and (the 16B flavor's shapes) deepseek-ai/DeepSeek-V2-Lite.
PUBLISHED_CONFIGS = {
    ("llama3", "8B"): {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    ("qwen3", "30B-A3B"): {
        "model_type": "qwen3_moe", "hidden_size": 2048, "head_dim": 128, "moe_intermediate_size": 768,
        "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    },
    ("deepseek_v3", "671B"): {
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
        "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8,
        "topk_group": 4, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "vocab_size": 129280,
    },
    ("deepseek_v3", "16B"): {
        "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "first_k_dense_replace": 1,
        "num_attention_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "topk_method": "greedy", "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "vocab_size": 102400,
    },
}  # fmt: skip


# deepseek-ai/DeepSeek-V3's config.json; transformers applies it at any length, this model (like
# DeepSeek's reference code and torchtitan) when training.seq_len exceeds the original 4096.
PUBLISHED_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"}  # fmt: skip


@pytest.mark.parametrize("seq_len, yarn", [(4096, None), (8192, PUBLISHED_YARN)])
def test_deepseek_v3_671b_exports_the_published_yarn_only_when_it_applies(seq_len, yarn):
    args = replace(get_train_spec("deepseek_v3").get_flavor("671B"), max_seq_len=seq_len)
    config = get_train_spec("deepseek_v3").state_dict_adapter(args).hf_config()
    if yarn is None:
        assert "rope_scaling" not in config
    else:
        assert hf_config_differences(config, {"rope_scaling": yarn}) == []
        assert hf_config_differences(config, {"rope_scaling": {**yarn, "factor": 8}}) != []


@pytest.mark.parametrize("seq_len, yarn", [(None, None), (4096, None), (8192, PUBLISHED_YARN)])
def test_an_export_of_deepseek_v3_trained_past_4096_tokens_carries_the_yarn_it_trained_with(seq_len, yarn):
    config = build_state_dict_adapter("deepseek_v3", "671B", seq_len=seq_len).hf_config()
    assert config.get("rope_scaling") == (None if yarn is None else {**yarn, "rope_type": "yarn"})
    # With YaRN, the context it extends to (40 x 4096), as published.
    assert config["max_position_embeddings"] == (4096 if yarn is None else 163840)


def test_an_export_of_deepseek_v3_run_with_always_apply_yarn_carries_the_published_yarn():
    args = replace(get_train_spec("deepseek_v3").get_flavor("671B"), always_apply_yarn=True)
    config = get_train_spec("deepseek_v3").state_dict_adapter(args).hf_config()
    assert (
        hf_config_differences(config, {"rope_scaling": PUBLISHED_YARN, "max_position_embeddings": 163840})
        == []
    )


def test_an_export_trained_within_the_published_context_keeps_it():
    config = build_state_dict_adapter("llama3", "8B", seq_len=8192).hf_config()
    assert config["max_position_embeddings"] == 131072


@pytest.mark.parametrize("model, flavor", list(PUBLISHED_CONFIGS))
def test_hf_config_of_published_flavors_matches_their_config_json(model, flavor):
    config = build_state_dict_adapter(model, flavor).hf_config(torch.bfloat16)
    published = PUBLISHED_CONFIGS[model, flavor]
    assert {key: config[key] for key in published} == published
    assert config["torch_dtype"] == "bfloat16"


def test_hf_config_takes_token_ids_from_the_assets_config(tmp_path):
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 3], "x": 0}))
    config = build_state_dict_adapter("llama3", "debugmodel", tmp_path).hf_config()
    assert (config["bos_token_id"], config["eos_token_id"], "x" in config) == (1, [2, 3], False)


FLEX_SLIDING_WINDOW = {"attn_backend": "flex", "attn_mask_type": "sliding_window"}


@pytest.mark.parametrize(
    "model, flavor, overrides, moe_overrides, reason",
    [
        # Softmax routing exports as DeepSeek-V2, which never renormalizes and groups otherwise.
        ("deepseek_v3", "16B", {}, {"route_norm": True}, "route_norm"),
        ("deepseek_v3", "16B", {}, {"num_expert_groups": 8, "num_limited_groups": 4}, "num_expert_groups"),
        ("qwen3", "debugmodel_moe", {}, {"route_scale": 2.0}, "route_scale"),
        ("qwen3", "debugmodel_moe", {}, {"num_shared_experts": 1}, "num_shared_experts"),
        ("qwen3", "debugmodel", {"qk_norm": False}, {}, "qk_norm"),
        ("llama3", "debugmodel", FLEX_SLIDING_WINDOW, {}, "sliding_window"),
    ],
)
def test_hf_config_refuses_what_hf_cannot_express(model, flavor, overrides, moe_overrides, reason):
    args = replace(get_train_spec(model).get_flavor(flavor), **overrides)
    if moe_overrides:
        args = replace(args, moe_args=replace(args.moe_args, **moe_overrides))
    with pytest.raises(HFConfigError, match=reason):
        get_train_spec(model).state_dict_adapter(args).hf_config()


def test_qwen3_moe_expert_bias_has_no_hf_slot(caplog):
    adapter, state_dict = _adapter("qwen3_moe"), _random_state_dict("qwen3_moe")
    state_dict["layers.0.moe.expert_bias"] += 0.1
    with caplog.at_level(logging.WARNING):
        hf = adapter.to_hf(state_dict)
    assert "layers.0.moe.expert_bias is nonzero" in caplog.text
    assert not any("bias" in key for key in hf)
    back = adapter.from_hf(hf)
    assert torch.equal(back["layers.0.moe.expert_bias"], torch.zeros(8))


def test_from_hf_names_unknown_keys_and_missing_experts():
    adapter = _adapter("deepseek_v3")
    hf = adapter.to_hf(_random_state_dict("deepseek_v3"))
    with pytest.raises(StateDictMismatchError, match="model.layers.0.self_attn.q_proj.bias"):
        adapter.from_hf({**hf, "model.layers.0.self_attn.q_proj.bias": torch.zeros(1)})
    del hf["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(
        StateDictMismatchError, match=r"layers.1.moe.experts.w3' lacks the slices \(experts\) 3"
    ):
        adapter.from_hf(hf)


def test_from_hf_skips_the_deepseek_mtp_layer_and_derived_buffers():
    adapter = _adapter("deepseek_v3")
    hf = adapter.to_hf(_random_state_dict("deepseek_v3"))
    extra = dict.fromkeys(["model.layers.6.eh_proj.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"])
    assert adapter.from_hf({**hf, **extra}).keys() == adapter.from_hf(hf).keys()


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3"])
def test_a_rank_holding_some_experts_reads_only_theirs_and_gets_exactly_their_slice(case):
    adapter = _adapter(case)
    state_dict = _random_state_dict(case)
    hf = adapter.to_hf(state_dict)

    renamed = adapter.experts_to_read(hf, range(4, 8))

    experts_read = {int(m.group(1)) for key in renamed if (m := re.search(r"\.experts\.(\d+)\.", key))}
    assert experts_read == {4, 5, 6, 7}
    assert (
        renamed["model.layers.1.mlp.experts.5.up_proj.weight"]
        == "model.layers.1.mlp.experts.1.up_proj.weight"
    )
    assert all(renamed[key] == key for key in hf if ".experts." not in key)
    ours = adapter.from_hf({renamed[key]: hf[key] for key in renamed})
    for key, tensor in state_dict.items():
        assert torch.equal(ours[key], tensor[4:8] if ".experts." in key else tensor), key


def test_to_hf_names_keys_it_does_not_know():
    with pytest.raises(StateDictMismatchError, match="layers.0.attention.extra"):
        _adapter("llama3").to_hf({"layers.0.attention.extra": torch.zeros(1)})


# --- safetensors files ----------------------------------------------------------------------


def test_sharded_save_round_trips_and_its_index_lists_every_key(tmp_path):
    adapter = _adapter("qwen3_moe")
    hf = adapter.to_hf(_random_state_dict("qwen3_moe"))  # experts are views of stacked tensors
    save_hf(hf, adapter.hf_config(), tmp_path, max_shard_bytes=4 * 1024**2)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and all((tmp_path / shard).is_file() for shard in shards)
    assert index["weight_map"].keys() == hf.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in hf.values())
    assert json.loads((tmp_path / CONFIG_FILE).read_text()) == adapter.hf_config()
    loaded = load_hf(tmp_path)
    assert loaded.keys() == hf.keys() and all(torch.equal(loaded[k], hf[k]) for k in hf)


def test_shards_get_the_umasks_permissions_as_config_json_does(tmp_path):
    previous = os.umask(0o022)
    try:
        save_hf({"w": torch.zeros(2)}, {"model_type": "llama"}, tmp_path)
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_shards_stay_under_the_limit_unless_one_tensor_exceeds_it(tmp_path):
    tensors = {"a": torch.zeros(100), "b": torch.zeros(100), "c": torch.zeros(300), "d": torch.zeros(10)}
    save_hf(tensors, {}, tmp_path, max_shard_bytes=800)  # 400, 400, 1200, 40 bytes
    weight_map = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    assert weight_map == {
        "a": "model-00001-of-00003.safetensors",
        "b": "model-00001-of-00003.safetensors",
        "c": "model-00002-of-00003.safetensors",
        "d": "model-00003-of-00003.safetensors",
    }


def test_load_hf_reads_a_single_file_checkpoint(tmp_path):
    save_file({"w": torch.arange(4.0)}, tmp_path / SINGLE_FILE)
    assert torch.equal(load_hf(tmp_path)["w"], torch.arange(4.0))


def test_load_hf_refuses_a_folder_without_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=INDEX_FILE):
        load_hf(tmp_path)


# --- the conversion scripts -----------------------------------------------------------------


@pytest.mark.parametrize("case", ["llama3", "deepseek_v3"])
def test_dcp_to_hf_to_dcp_is_lossless(case, tmp_path, from_hf_script, to_hf_script):
    model, flavor, _ = CASES[case]
    state_dict = _random_state_dict(case)
    dcp.save({"model": state_dict}, checkpoint_id=str(tmp_path / "dcp"))
    common = ["--model", model, "--flavor", flavor]
    assert to_hf_script.main([*common, "--dcp", str(tmp_path / "dcp"), "--out", str(tmp_path / "hf")]) == 0
    assert from_hf_script.main([*common, "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    back = {key: torch.empty_like(tensor) for key, tensor in state_dict.items()}
    dcp.load({"model": back}, checkpoint_id=str(tmp_path / "back"))
    assert all(torch.equal(back[key], state_dict[key]) for key in state_dict)


def test_to_hf_dtype_casts_parameters_and_keeps_the_expert_bias_fp32(tmp_path, to_hf_script):
    dcp.save({"model": _random_state_dict("deepseek_v3")}, checkpoint_id=str(tmp_path / "dcp"))
    argv = ["--model", "deepseek_v3", "--flavor", "debugmodel", "--dcp", str(tmp_path / "dcp")]
    assert to_hf_script.main([*argv, "--out", str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    hf = load_hf(tmp_path / "hf")
    is_bias = {key: key.endswith("e_score_correction_bias") for key in hf}
    assert {key: t.dtype for key, t in hf.items() if is_bias[key]} == dict.fromkeys(
        [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(1, 6)], torch.float32
    )
    assert {t.dtype for key, t in hf.items() if not is_bias[key]} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / CONFIG_FILE).read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("seq_len, context", [([], 4096), (["--seq_len", "8192"], 8192)])
def test_to_hf_seq_len_sets_the_exported_context(tmp_path, to_hf_script, seq_len, context):
    dcp.save({"model": _random_state_dict("deepseek_v3")}, checkpoint_id=str(tmp_path / "dcp"))
    argv = ["--model", "deepseek_v3", "--flavor", "debugmodel", "--dcp", str(tmp_path / "dcp"), *seq_len]
    assert to_hf_script.main([*argv, "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / CONFIG_FILE).read_text())["max_position_embeddings"] == context


def test_to_hf_names_the_keys_of_a_checkpoint_of_another_model(tmp_path, to_hf_script, capsys):
    dcp.save({"model": _random_state_dict("llama3")}, checkpoint_id=str(tmp_path / "dcp"))
    argv = ["--model", "qwen3", "--flavor", "debugmodel", "--dcp", str(tmp_path / "dcp")]
    assert to_hf_script.main([*argv, "--out", str(tmp_path / "hf")]) == 2
    assert "missing keys: layers.0.attention.q_norm.weight" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def _run_script(name: str, *argv: str) -> subprocess.CompletedProcess:
    """`python scripts/checkpoint_conversion/<name>.py argv` (forked, see tests/forked_launcher.py)."""
    return launch_ranks(("script", str(SCRIPTS / f"{name}.py")), list(argv), 1, timeout=120, cwd=REPO)


@pytest.fixture(scope="module")
def llama_hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_hf")
    adapter = _adapter("llama3")
    save_hf(adapter.to_hf(_random_state_dict("llama3")), adapter.hf_config(), folder)
    return folder


@pytest.mark.parametrize(
    "script, model, flavor, source, message",
    [
        ("convert_from_hf", "llama3", "debugmodel", "missing", "folder '.*missing' does not exist"),
        ("convert_from_hf", "llama3", "no_such_flavor", "llama_hf", "unknown flavor --flavor 'no_such"),
        ("convert_from_hf", "no_such_model", "debugmodel", "llama_hf", "unknown model --model 'no_such"),
        ("convert_to_hf", "llama3", "no_such_flavor", "missing", "unknown flavor --flavor 'no_such_flavor'"),
        # A Llama checkpoint read as Qwen3: the first few missing keys are named.
        ("convert_from_hf", "qwen3", "debugmodel", "llama_hf", "missing keys: layers.0.attention.q_norm"),
        ("convert_to_hf", "llama3", "debugmodel", "missing", "'.*missing' is not a DCP checkpoint folder"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_one_paragraph_and_no_traceback(
    script, model, flavor, source, message, llama_hf_folder, tmp_path
):
    folder = llama_hf_folder if source == "llama_hf" else tmp_path / source
    source_flag = "--hf" if script == "convert_from_hf" else "--dcp"
    argv = ["--model", model, "--flavor", flavor, source_flag, str(folder), "--out", str(tmp_path / "out")]
    done = _run_script(script, *argv)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "\n" not in done.stderr.strip()
    assert re.search(message, done.stderr), done.stderr


def test_a_model_registered_by_custom_import_round_trips_through_hf(
    custom_model_module, tmp_path, from_hf_script, to_hf_script
):
    module = custom_model_module
    common = ["--custom_import", module, "--model", "my_llama", "--flavor", "tiny"]
    import_custom_module(module)
    spec = get_train_spec("my_llama")
    meta = spec.build_meta_model(spec.flavors["tiny"], torch.float32)
    torch.manual_seed(0)
    state_dict = {key: torch.randn(t.shape) for key, t in meta.state_dict().items()}
    dcp.save({"model": state_dict}, checkpoint_id=str(tmp_path / "dcp"))
    assert to_hf_script.main([*common, "--dcp", str(tmp_path / "dcp"), "--out", str(tmp_path / "hf")]) == 0
    assert from_hf_script.main([*common, "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    back = {key: torch.empty_like(tensor) for key, tensor in state_dict.items()}
    dcp.load({"model": back}, checkpoint_id=str(tmp_path / "back"))
    assert all(torch.equal(back[key], state_dict[key]) for key in state_dict)


def test_a_custom_import_that_cannot_be_found_exits_2_naming_the_option(tmp_path):
    argv = ["--custom_import", "my_project.models", "--model", "my_model", "--flavor", "small",
            "--dcp", str(tmp_path), "--out", str(tmp_path / "hf")]  # fmt: skip
    done = _run_script("convert_to_hf", *argv)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--custom_import my_project.models cannot be imported: no module named 'my_project'" in done.stderr


def _run_config(tmp_path, *argv: str) -> Path:
    """The config.toml a run of the DeepSeek-V3 debug model with `argv` writes to its dump folder."""
    path = tmp_path / "config.toml"
    path.write_text(to_toml(parse_args(["--config", "deepseek_v3_debug_model.toml", *argv], env={})))
    return path


def test_to_hf_with_the_runs_config_exports_what_the_run_trained(tmp_path, to_hf_script):
    dcp.save({"model": _random_state_dict("deepseek_v3")}, checkpoint_id=str(tmp_path / "dcp"))
    run = _run_config(tmp_path, "--training.seq_len", "8192")
    argv = ["--run_config", str(run), "--dcp", str(tmp_path / "dcp"), "--out", str(tmp_path / "hf")]
    assert to_hf_script.main(argv) == 0
    assert json.loads((tmp_path / "hf" / CONFIG_FILE).read_text())["max_position_embeddings"] == 8192


def test_to_hf_with_the_runs_config_refuses_an_attention_mask_hf_cannot_run(tmp_path, to_hf_script, capsys):
    """As the trainer's own export does: the run's [model] keys reach the adapter."""
    dcp.save({"model": _random_state_dict("deepseek_v3")}, checkpoint_id=str(tmp_path / "dcp"))
    run = _run_config(tmp_path, "--model.attn_backend", "flex", "--model.attn_mask_type", "sliding_window")
    argv = ["--run_config", str(run), "--dcp", str(tmp_path / "dcp"), "--out", str(tmp_path / "hf")]
    assert to_hf_script.main(argv) == 2
    assert "attn_mask_type 'sliding_window' has no Hugging Face config equivalent" in capsys.readouterr().err


def test_to_hf_refuses_a_flavor_other_than_the_runs(tmp_path, to_hf_script, capsys):
    run = _run_config(tmp_path)
    argv = [
        "--run_config",
        str(run),
        "--flavor",
        "16B",
        "--dcp",
        str(tmp_path / "dcp"),
        "--out",
        str(tmp_path / "hf"),
    ]
    assert to_hf_script.main(argv) == 2
    assert "--flavor 16B is not the run's (debugmodel" in capsys.readouterr().err


def test_from_hf_warns_when_config_json_computes_something_else(
    tmp_path, llama_hf_folder, from_hf_script, caplog
):
    folder = tmp_path / "hf"
    folder.mkdir()
    for file in llama_hf_folder.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps({**config, "rope_theta": 10.0}))
    argv = [
        "--model",
        "llama3",
        "--flavor",
        "debugmodel",
        "--hf",
        str(folder),
        "--out",
        str(tmp_path / "out"),
    ]
    with caplog.at_level(logging.WARNING):
        assert from_hf_script.main(argv) == 0
    assert "rope_theta: checkpoint 10.0" in caplog.text and "choose the matching --flavor" in caplog.text


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", ["output is a file", "truncated shard", "index without weight_map"])
def test_from_hf_bad_files_exit_2_naming_the_file(tmp_path, llama_hf_folder, from_hf_script, capsys, damage):
    folder = tmp_path / "hf"
    folder.mkdir()
    for file in llama_hf_folder.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    out = tmp_path / "out"
    if damage == "output is a file":
        out.touch()
    elif damage == "truncated shard":
        _truncate(next(folder.glob("*.safetensors")))
    else:
        (folder / INDEX_FILE).write_text("{}")
    argv = ["--model", "llama3", "--flavor", "debugmodel", "--hf", str(folder), "--out", str(out)]
    assert from_hf_script.main(argv) == 2
    err = capsys.readouterr().err
    named = {"output is a file": "is a file", "truncated shard": "not a readable safetensors file",
             "index without weight_map": "has no 'weight_map'"}[damage]  # fmt: skip
    assert named in err, err
    assert not (tmp_path / "out.partial").exists()


def test_to_hf_a_dcp_with_a_truncated_shard_exits_2_and_writes_nothing(tmp_path, to_hf_script, capsys):
    dcp.save({"model": _random_state_dict("llama3")}, checkpoint_id=str(tmp_path / "dcp"))
    _truncate(next((tmp_path / "dcp").glob("*.distcp")))
    argv = ["--model", "llama3", "--flavor", "debugmodel", "--dcp", str(tmp_path / "dcp")]
    assert to_hf_script.main([*argv, "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {tmp_path / 'dcp'} cannot be read" in err
    assert "Point --dcp at another checkpoint" in err
    assert not (tmp_path / "hf").exists()


def test_a_conversion_that_fails_while_writing_leaves_no_output(tmp_path, to_hf_script, monkeypatch):
    dcp.save({"model": _random_state_dict("llama3")}, checkpoint_id=str(tmp_path / "dcp"))

    def write_one_shard_then_fail(folder, state, files, process_group=None):
        save_hf(dict(list(state.items())[:1]), {}, folder)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(to_hf_script, "write_hf_tensors_from_all_ranks", write_one_shard_then_fail)
    argv = ["--model", "llama3", "--flavor", "debugmodel", "--dcp", str(tmp_path / "dcp")]
    with pytest.raises(OSError, match="No space left"):
        to_hf_script.main([*argv, "--out", str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


@pytest.mark.parametrize("case", ["llama3", "qwen3_moe"])
def test_a_conversion_on_two_ranks_writes_what_one_process_writes(tmp_path, case):
    name, flavor, _ = CASES[case]
    dcp.save({"model": _random_state_dict(case)}, checkpoint_id=str(tmp_path / "dcp"))
    argv = ["--model", name, "--flavor", flavor, "--dcp", str(tmp_path / "dcp"), "--dtype", "bfloat16"]
    one = _run_script("convert_to_hf", *argv, "--out", str(tmp_path / "one"))
    script = ("script", str(SCRIPTS / "convert_to_hf.py"))
    two = launch_ranks(script, [*argv, "--out", str(tmp_path / "two")], 2, timeout=120, cwd=REPO)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    got, want = load_hf(tmp_path / "two"), load_hf(tmp_path / "one")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (tmp_path / "two" / CONFIG_FILE).read_text() == (tmp_path / "one" / CONFIG_FILE).read_text()
    assert not (tmp_path / "two.partial").exists()


def test_a_conversion_gives_each_rank_whole_layers_and_every_rank_some(to_hf_script):
    template = _meta_model("llama3").state_dict()
    writers = to_hf_script._writer_of_each_key(template, 4)
    assert set(writers.values()) == {0, 1, 2, 3}
    by_layer = {}
    for key, rank in writers.items():
        if key.startswith("layers."):
            by_layer.setdefault(key.split(".")[1], set()).add(rank)
    assert all(len(ranks) == 1 for ranks in by_layer.values())


def test_to_hf_refuses_an_hf_assets_folder_without_config_json(tmp_path, to_hf_script, capsys):
    argv = ["--model", "llama3", "--flavor", "debugmodel", "--dcp", str(tmp_path),
            "--out", str(tmp_path / "hf"), "--hf_assets", str(tmp_path / "missing")]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        to_hf_script.main(argv)
    assert exit_info.value.code == 2
    assert "holds no config.json to take the token ids from" in capsys.readouterr().err


def test_an_moe_checkpoint_read_as_a_dense_flavor_names_the_router_keys_as_unexpected():
    """No AttributeError on the dense flavor's missing moe_args: the load's mismatch names them."""
    hf = _adapter("qwen3_moe").to_hf(_random_state_dict("qwen3_moe"))
    ours = _adapter("qwen3").from_hf(hf)
    expected = {key: tensor.shape for key, tensor in _meta_model("qwen3").state_dict().items()}
    assert "unexpected keys: layers.0.moe.router.gate.weight" in describe_mismatch(
        expected, {key: tensor.shape for key, tensor in ours.items()}
    )


@pytest.mark.parametrize(
    "theirs, difference",
    [({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}, "rope_theta: checkpoint 10000.0"),
     ({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "yarn", "factor": 40.0}},
      "rope_scaling: checkpoint {'rope_type': 'yarn', 'factor': 40.0}, this run None")],
)  # fmt: skip
def test_config_differences_read_transformers_5s_rope_parameters(theirs, difference):
    ours = {"rope_theta": 500000, "rope_scaling": None}
    assert [d[: len(difference)] for d in hf_config_differences(ours, theirs)] == [difference]


def test_config_differences_find_nothing_in_rope_parameters_that_agree():
    theirs = {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
    assert hf_config_differences({"rope_theta": 500000, "rope_scaling": None}, theirs) == []


def test_a_tied_flavor_drops_a_stored_lm_head_equal_to_the_embedding_and_refuses_another():
    adapter = _adapter("qwen3_tied")
    hf = adapter.to_hf(_random_state_dict("qwen3_tied"))
    tied = {**hf, "lm_head.weight": hf["model.embed_tokens.weight"].clone()}
    assert adapter.from_hf(tied).keys() == adapter.from_hf(hf).keys()
    untied = {**hf, "lm_head.weight": hf["model.embed_tokens.weight"] + 1}
    with pytest.raises(StateDictMismatchError, match="the checkpoint has its own output projection"):
        adapter.from_hf(untied)


@pytest.mark.parametrize("text", ['{"hidden_size": 4', "[1, 2]"], ids=["truncated", "not an object"])
def test_an_unreadable_config_json_is_a_config_error_naming_it(text, tmp_path):
    from torchtitan.components.hf_io import fp8_block_size
    from torchtitan.config.manager import ConfigError

    (tmp_path / CONFIG_FILE).write_text(text)
    with pytest.raises(ConfigError, match="config.json"):
        fp8_block_size(tmp_path)
    with pytest.raises(ConfigError, match="fetch it again"):
        build_state_dict_adapter("llama3", "debugmodel", tmp_path).hf_config()


def test_hf_config_takes_token_ids_from_the_tokenizer_when_the_assets_have_no_config(tmp_path):
    adapter = build_state_dict_adapter("llama3", "debugmodel", tmp_path)
    adapter.use_tokenizer_ids(bos_id=0, eos_id=1)
    assert (adapter.hf_config()["bos_token_id"], adapter.hf_config()["eos_token_id"]) == (0, 1)
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"bos_token_id": 5, "eos_token_id": 6}))
    assert (adapter.hf_config()["bos_token_id"], adapter.hf_config()["eos_token_id"]) == (5, 6)


@pytest.mark.parametrize(
    "model, flavor, changed",
    [("qwen3", "30B-A3B", {"num_experts_per_tok": 4}), ("qwen3", "30B-A3B", {"norm_topk_prob": False}),
     ("deepseek_v3", "671B", {"routed_scaling_factor": 1.0}), ("deepseek_v3", "671B", {"topk_group": 8}),
     ("deepseek_v3", "671B", {"rope_interleave": False}), ("llama3", "8B", {"hidden_act": "gelu"})],
)  # fmt: skip
def test_config_differences_name_routing_rotary_layout_and_activation_constants(model, flavor, changed):
    """Each of these changes the logits (by 0.2-1.0 of their norm) with no tensor shape changed."""
    ours = build_state_dict_adapter(model, flavor).hf_config()
    [(key, value)] = changed.items()
    expected = f"{key}: checkpoint {value}, this run {ours[key]}"
    assert hf_config_differences(ours, {**ours, **changed}) == [expected]
    assert hf_config_differences(ours, ours) == []


def test_a_config_without_rope_interleave_is_compared_as_transformers_default_true():
    ours = build_state_dict_adapter("deepseek_v3", "671B").hf_config()
    theirs = {k: v for k, v in ours.items() if k != "rope_interleave"}
    assert hf_config_differences(ours, theirs) == []
    assert hf_config_differences({**ours, "rope_interleave": False}, theirs) == [
        "rope_interleave: checkpoint True, this run False"
    ]


def test_keys_this_model_does_not_write_are_not_compared():
    ours = build_state_dict_adapter("llama3", "8B").hf_config()
    assert hf_config_differences(ours, {**ours, "num_experts_per_tok": 8, "rope_interleave": False}) == []
