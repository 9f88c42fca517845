"""Flex attention in every model: the `[model]` attention keys, masks built once per batch, numerics
against sdpa, document isolation under block_causal, and every AC mode (CPU: the dense-mask path)."""

from dataclasses import replace

import pytest
import torch

from tests.model_testing import init_on_cpu, next_token_loss_and_grads
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.config import ActivationCheckpoint, ConfigError, parse_args
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import get_train_spec, layers
from torchtitan.models.deepseek_v3.parallelize import DEEPSEEK_V3_SAVE_LIST
from torchtitan.models.llama3.parallelize import LLAMA3_SAVE_LIST
from torchtitan.models.qwen3.parallelize import QWEN3_MOE_SAVE_LIST, QWEN3_SAVE_LIST
from torchtitan.models.rope import YaRNScaling
from torchtitan.train import main

SEQ_LEN = 32
# (config file, flavor, op-SAC save list): the dense, MoE and MLA variants of the debug models.
MODELS = {
    "llama3": ("debug_model.toml", "debugmodel", LLAMA3_SAVE_LIST),
    "qwen3": ("qwen3_debug_model.toml", "debugmodel", QWEN3_SAVE_LIST),
    "qwen3_moe": ("qwen3_debug_model_moe.toml", "debugmodel_moe", QWEN3_MOE_SAVE_LIST),
    "deepseek_v3": ("deepseek_v3_debug_model.toml", "debugmodel", DEEPSEEK_V3_SAVE_LIST),
}
FLEX_CONFIGS = {
    "llama3": "debug_model_flex_attn.toml",
    "qwen3": "qwen3_debug_model_flex_attn.toml",
    "deepseek_v3": "deepseek_v3_debug_model_flex_attn.toml",
}
AC_MODES = {
    "none": ActivationCheckpoint(mode="none"),
    "full": ActivationCheckpoint(mode="full"),
    "selective op": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
}


def _config(model: str, *overrides: str):
    toml, flavor, _ = MODELS[model]
    argv = ["--config", toml, "--model.flavor", flavor, "--training.seq_len", str(SEQ_LEN), *overrides]
    return parse_args(argv, env={})


def _args(model: str, *overrides: str):
    """The flavor's args after `update_from_config`, as the trainer builds them."""
    cfg = _config(model, *overrides)
    return get_train_spec(cfg.model.name).get_flavor(cfg.model.flavor).update_from_config(cfg)


def _build(model: str, args, ac: ActivationCheckpoint = AC_MODES["none"]):
    """The model for `args` in fp32 on the CPU, seeded, with `ac` applied as parallelize does."""
    spec = get_train_spec(_config(model).model.name)
    module = spec.build_meta_model(args, torch.float32)
    apply_ac(module, ac, use_flex_attn=args.attn_backend == "flex", op_sac_save_list=MODELS[model][2])
    return init_on_cpu(module)


def _documents(eos_id: int, seed: int = 1) -> torch.Tensor:
    """``[2, SEQ_LEN + 1]`` ids of packed documents: random non-EOS ids, an EOS ending a document
    at position 9 in both rows and at 20 in the second (documents of different lengths per row)."""
    tokens = torch.randint(eos_id + 1, 2048, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(seed))
    tokens[:, 9] = eos_id
    tokens[1, 20] = eos_id
    return tokens


# ----- config keys -> model args -----------------------------------------------------------


def test_unset_keys_keep_the_flavors_backend_and_mask():
    assert (_args("llama3").attn_backend, _args("llama3").attn_mask_type) == ("sdpa", "causal")
    flex = _args("llama3", "--model.flavor", "debugmodel_flex_attn")
    assert (flex.attn_backend, flex.attn_mask_type) == ("flex", "block_causal")


def test_config_keys_override_backend_mask_window_and_chunk():
    args = _args(
        "qwen3", "--model.attn_backend", "flex", "--model.attn_mask_type", "sliding_window",
        "--model.sliding_window", "8", "--model.attn_chunk_size", "16",
    )  # fmt: skip
    assert (args.attn_backend, args.attn_mask_type, args.sliding_window, args.attn_chunk_size) == (
        "flex",
        "sliding_window",
        8,
        16,
    )
    assert args.max_seq_len == SEQ_LEN  # the RoPE sizing still applies


def test_block_causal_takes_the_eos_id_of_the_runs_tokenizer():
    cfg = _config("deepseek_v3", "--model.attn_backend", "flex", "--model.attn_mask_type", "block_causal")
    args = get_train_spec("deepseek_v3").get_flavor("debugmodel").update_from_config(cfg)
    assert args.eos_id is not None and args.eos_id == build_hf_tokenizer(cfg).eos_id


def test_split_documents_takes_the_eos_id_of_the_runs_tokenizer():
    cfg = _config("qwen3", "--model.attn_backend", "flex", "--model.attn_mask_type", "chunked",
                  "--model.attn_split_documents")  # fmt: skip
    args = get_train_spec("qwen3").get_flavor("debugmodel").update_from_config(cfg)
    assert args.split_documents and args.eos_id == build_hf_tokenizer(cfg).eos_id


FLEX = ["--model.attn_backend", "flex"]


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        (["--model.attn_mask_type", "causal"],
         'set model.attn_backend = "flex" and model.attn_mask_type = "block_causal"'),
        ([*FLEX, "--model.attn_mask_type", "causal"], 'set model.attn_mask_type = "block_causal"'),
        ([*FLEX, "--model.attn_mask_type", "block_causal"], "always splits documents: drop the key"),
    ],
)  # fmt: skip
def test_split_documents_with_a_mask_it_does_not_split_is_refused_naming_the_fix(overrides, fix):
    with pytest.raises(ConfigError) as info:
        parse_args(["--model.attn_split_documents", *overrides], env={})
    message = str(info.value)
    assert "'model.attn_split_documents' = true" in message and f"is '{overrides[-1]}'" in message
    assert fix in message


def test_split_documents_on_a_flavor_whose_mask_it_does_not_split_is_refused():
    with pytest.raises(ConfigError, match="is 'block_causal' \\(the flavor's when unset\\)"):
        _args("llama3", "--model.flavor", "debugmodel_flex_attn", "--model.attn_split_documents")
    with pytest.raises(ConfigError, match="is 'causal' .* set model.attn_backend = \"flex\" and"):
        _args("llama3", "--model.attn_split_documents")  # an sdpa flavor


def test_the_startup_log_names_the_backend_the_mask_its_size_and_the_document_split():
    eos = _args("qwen3", "--model.attn_backend", "flex", "--model.attn_mask_type", "block_causal").eos_id
    flex = ("--model.attn_backend", "flex", "--model.attn_mask_type")
    described = {
        ("--model.attn_backend", "sdpa"): "sdpa, causal",
        ("--model.attn_backend", "flex"): "flex, causal",
        (*flex, "block_causal"): f"flex, block_causal, split at EOS id {eos}",
        (*flex, "chunked", "--model.attn_chunk_size", "16"): "flex, chunked of 16",
        (*flex, "sliding_window", "--model.sliding_window", "8", "--model.attn_split_documents"):
            f"flex, sliding_window of 8, split at EOS id {eos}",
        (*flex, "chunked", "--model.attn_chunk_size", "16", "--model.attn_global_every_n_layers", "2"):
            "flex, chunked of 16; causal on every 2nd layer",
        (*flex, "sliding_window", "--model.attn_split_documents", "--model.attn_global_every_n_layers", "4"):
            f"flex, sliding_window of 4096, split at EOS id {eos}; block_causal on every 4th layer",
    }  # fmt: skip
    for overrides, line in described.items():
        assert _args("qwen3", *overrides).describe_attention() == line


@pytest.mark.parametrize(
    "overrides, message",
    [(["--model.attn_mask_type", "causal"], "is 'causal': global layers interleave with local ones"),
     (["--model.attn_mask_type", "block_causal"], "set model.attn_mask_type = \"sliding_window\" or"),
     (["--model.attn_mask_type", "chunked", "--model.attn_global_every_n_layers", "1"],
      "makes every layer global, which is causal attention"),
     (["--model.attn_global_every_n_layers", "-1"], "attn_global_every_n_layers")],
    ids=["causal", "block_causal", "every layer", "negative"],
)  # fmt: skip
def test_global_layers_without_local_ones_to_interleave_are_refused_when_the_config_is_parsed(
    overrides, message
):
    argv = ["--model.attn_backend", "flex", "--model.attn_global_every_n_layers", "2", *overrides]
    with pytest.raises(ConfigError, match=message):
        parse_args(argv, env={})


def test_global_layers_with_the_flavors_mask_or_more_than_its_layers_are_refused():
    with pytest.raises(ConfigError, match="is 'block_causal' \\(the flavor's when unset\\): global layers"):
        _args("llama3", "--model.flavor", "debugmodel_flex_attn", "--model.attn_global_every_n_layers", "2")
    chunked = ["--model.attn_backend", "flex", "--model.attn_mask_type", "chunked"]
    with pytest.raises(ConfigError, match="= 7 leaves all 6 layers of this flavor local .* at most 6"):
        _args("llama3", *chunked, "--model.attn_global_every_n_layers", "7")
    assert _args("llama3", *chunked, "--model.attn_global_every_n_layers", "6").is_global_layer(5)


def test_flex_flavor_exists_for_every_model_and_its_config_selects_it():
    for model, toml in FLEX_CONFIGS.items():
        cfg = parse_args(["--config", toml], env={})
        assert (cfg.model.name, cfg.model.flavor) == (model, "debugmodel_flex_attn")
        assert cfg.activation_checkpoint.mode == "selective"
        assert cfg.activation_checkpoint.selective_ac_option == "op"
    assert get_train_spec("qwen3").get_flavor("debugmodel_moe_flex_attn").moe_args is not None


@pytest.mark.parametrize("model", ["llama3", "qwen3", "deepseek_v3"])
@pytest.mark.parametrize("mask_type", ["block_causal", "sliding_window", "chunked"])
def test_a_non_causal_mask_with_sdpa_is_refused_naming_the_keys_and_the_fix(model, mask_type):
    with pytest.raises(ConfigError) as info:
        _args(model, "--model.attn_mask_type", mask_type)
    message = str(info.value)
    assert f"'model.attn_mask_type' = '{mask_type}'" in message and "'model.attn_backend'" in message
    assert 'model.attn_backend = "flex"' in message


def test_forcing_sdpa_on_a_flex_flavor_is_refused_before_training(tmp_path, capsys):
    argv = ["--config", "debug_model_flex_attn.toml", "--model.attn_backend", "sdpa"]
    with pytest.raises(SystemExit) as info:
        main(argv + ["--job.dump_folder", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "'model.attn_mask_type' = 'block_causal'" in err and "Traceback" not in err


def test_sdpa_with_a_non_causal_mask_both_set_is_refused_when_the_config_is_parsed():
    """So that `python -m torchtitan.config.check` sees it, before any rank starts."""
    with pytest.raises(ConfigError, match="'model.attn_mask_type' = 'chunked' needs the flex"):
        parse_args(["--model.attn_backend", "sdpa", "--model.attn_mask_type", "chunked"], env={})


def test_unknown_backend_or_mask_type_is_refused_when_the_config_is_parsed():
    with pytest.raises(ConfigError, match="model.attn_backend"):
        parse_args(["--model.attn_backend", "flash"], env={})
    with pytest.raises(ConfigError, match="model.attn_mask_type"):
        parse_args(["--model.attn_mask_type", "bidirectional"], env={})


# ----- masks are built once per batch ------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_masks_are_built_once_per_forward_and_every_layer_gets_the_same(model, monkeypatch):
    args = _args(model, "--model.attn_backend", "flex", "--model.attn_mask_type", "block_causal")
    module = _build(model, args)
    build, built = layers.build_attention_masks, []

    def counting(*a, **kw):
        built.append(build(*a, **kw))
        return built[-1]

    monkeypatch.setattr(layers, "build_attention_masks", counting)
    seen = []
    for block in module.layers.values():
        block.attention.sdpa.register_forward_pre_hook(
            lambda m, a, kw: seen.append(kw["masks"]), with_kwargs=True
        )
    module(_documents(args.eos_id)[:, :-1])
    assert len(built) == 1
    assert len(seen) == args.n_layers and all(masks is built[0] for masks in seen)


@pytest.mark.parametrize("split", [False, True], ids=["causal", "split documents"])
def test_the_last_of_every_n_layers_gets_the_one_global_mask_and_the_rest_the_local_one(split, monkeypatch):
    split_flag = ["--model.attn_split_documents"] if split else []
    args = _args("llama3", "--model.attn_backend", "flex", "--model.attn_mask_type", "chunked",
                 "--model.attn_chunk_size", "8", "--model.attn_global_every_n_layers", "3",
                 *split_flag)  # fmt: skip
    module = _build("llama3", args)
    build, built = layers.build_attention_masks, []

    def counting(*a, **kw):
        built.append(build(*a, **kw))
        return built[-1]

    monkeypatch.setattr(layers, "build_attention_masks", counting)
    seen = {}
    for layer_id, block in module.layers.items():
        block.attention.sdpa.register_forward_pre_hook(
            lambda m, a, kw, layer_id=int(layer_id): seen.update({layer_id: kw["masks"]}), with_kwargs=True
        )
    module(_documents(args.eos_id or 1)[:, :-1])
    local, whole = built
    assert [seen[i] is whole for i in range(6)] == [False, False, True, False, False, True]
    assert all(seen[i] is local for i in (0, 1, 3, 4))
    assert (local.mask_type, whole.mask_type) == ("chunked", "block_causal" if split else "causal")


def test_sdpa_builds_no_masks(monkeypatch):
    calls = []
    monkeypatch.setattr(layers, "build_attention_masks", lambda *a, **kw: calls.append(a))
    seen = []
    module = _build("llama3", _args("llama3"))
    module.layers["0"].attention.sdpa.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["masks"]), with_kwargs=True
    )
    module(_documents(1)[:, :-1])
    assert calls == [] and seen == [None]


# ----- numerics ----------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_flex_with_a_causal_mask_gives_the_sdpa_loss(model):
    sdpa = _args(model)
    flex = _args(model, "--model.attn_backend", "flex", "--model.attn_mask_type", "causal")
    tokens = _documents(eos_id=1)
    sdpa_loss, _ = next_token_loss_and_grads(_build(model, sdpa), tokens)
    flex_loss, _ = next_token_loss_and_grads(_build(model, flex), tokens)
    torch.testing.assert_close(flex_loss, sdpa_loss, atol=1e-5, rtol=0)


def test_yarn_softmax_scale_reaches_flex_as_it_reaches_sdpa():
    """DeepSeek with YaRN applied passes a softmax scale to the attention backend; flex (dense
    mask on the CPU) must use it as SDPA does."""
    yarn = YaRNScaling(factor=4.0, original_max_position_embeddings=SEQ_LEN // 2, mscale_all_dim=0.7)
    sdpa = replace(_args("deepseek_v3"), rope_scaling=yarn)
    flex = replace(sdpa, attn_backend="flex", attn_mask_type="causal")
    tokens = _documents(eos_id=1)[:, :-1]
    flex_model = _build("deepseek_v3", flex)
    with torch.no_grad():
        flex_logits, sdpa_logits = flex_model(tokens), _build("deepseek_v3", sdpa)(tokens)
        for module in flex_model.modules():
            if hasattr(module, "softmax_scale"):
                module.softmax_scale = None
        unscaled_logits = flex_model(tokens)
    backend_gap = (flex_logits - sdpa_logits).abs().max().item()
    scale_gap = (flex_logits - unscaled_logits).abs().max().item()
    assert backend_gap <= 1e-5 and scale_gap > 100 * max(backend_gap, 1e-8), (backend_gap, scale_gap)


@pytest.mark.parametrize("mask_type", ["sliding_window", "chunked"])
def test_a_window_or_chunk_covering_the_sequence_is_causal(mask_type):
    causal = _args("llama3", "--model.attn_backend", "flex")
    covering = ["--model.sliding_window", str(SEQ_LEN), "--model.attn_chunk_size", str(SEQ_LEN)]
    wide = _args("llama3", "--model.attn_backend", "flex", "--model.attn_mask_type", mask_type, *covering)
    narrow = replace(wide, sliding_window=4, attn_chunk_size=4)
    tokens = _documents(eos_id=1)
    causal_loss, _ = next_token_loss_and_grads(_build("llama3", causal), tokens)
    assert torch.equal(next_token_loss_and_grads(_build("llama3", wide), tokens)[0], causal_loss)
    assert not torch.allclose(next_token_loss_and_grads(_build("llama3", narrow), tokens)[0], causal_loss)


@pytest.mark.parametrize("model", ["llama3", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("mask_type", ["sliding_window", "chunked"])
def test_flops_count_the_window_or_chunk_not_the_whole_sequence(model, mask_type):
    """A window of 8 in a 32-token sequence costs less than causal attention over it, and a
    window covering the sequence what causal costs."""
    limits = lambda n: ["--model.sliding_window", str(n), "--model.attn_chunk_size", str(n)]  # noqa: E731
    causal = _args(model, "--model.attn_backend", "flex")
    masked = _args(model, "--model.attn_backend", "flex", "--model.attn_mask_type", mask_type, *limits(8))
    covering = _args(model, "--model.attn_backend", "flex", "--model.attn_mask_type", mask_type, *limits(64))
    module = _build(model, causal)
    flops = lambda args, seq_len: args.num_flops_per_token(module, seq_len)[1]  # noqa: E731
    assert flops(causal, 8) < flops(masked, SEQ_LEN) < flops(causal, SEQ_LEN)
    assert flops(covering, SEQ_LEN) == flops(causal, SEQ_LEN)


@pytest.mark.parametrize(
    "mask_type, size", [("causal", 0), ("sliding_window", 5), ("sliding_window", 32), ("chunked", 5),
                        ("chunked", 8), ("chunked", 40)],
)  # fmt: skip
def test_every_mask_is_counted_at_the_share_of_pairs_it_allows_as_causal_is(mask_type, size):
    """Causal counts seq_len keys per query for its seq_len x (seq_len + 1) / 2 pairs; every mask
    counts its real pairs the same way, so MFU compares across mask types."""
    args = replace(_args("llama3", "--model.attn_backend", "flex"), attn_mask_type=mask_type,
                   sliding_window=size, attn_chunk_size=size)  # fmt: skip
    tokens = torch.ones(1, SEQ_LEN, dtype=torch.long)
    pairs = args.build_masks(tokens).dense_mask.sum().item()
    assert args.attention_span(SEQ_LEN) == pytest.approx(2 * pairs / (SEQ_LEN + 1), rel=1e-12)
    if mask_type == "causal":
        assert args.attention_span(SEQ_LEN) == SEQ_LEN


def test_global_layers_are_counted_at_causal_pairs_and_local_ones_at_their_own():
    args = _args("llama3", "--model.attn_backend", "flex", "--model.attn_mask_type", "sliding_window",
                 "--model.sliding_window", "5", "--model.attn_global_every_n_layers", "2")  # fmt: skip
    tokens = torch.ones(1, SEQ_LEN, dtype=torch.long)
    pairs = sum(masks.dense_mask.sum().item() for masks in args.build_layer_masks(tokens))
    mean_span = 2 * pairs / args.n_layers / (SEQ_LEN + 1)
    assert args.attention_span(SEQ_LEN) == pytest.approx(mean_span, rel=1e-12)
    assert _args("llama3", "--model.attn_backend", "flex", "--model.attn_mask_type", "sliding_window",
                 "--model.sliding_window", "5").attention_span(SEQ_LEN) < mean_span < SEQ_LEN  # fmt: skip


@pytest.mark.parametrize("model", ["llama3", "qwen3", "deepseek_v3"])
def test_global_layers_let_a_later_chunk_see_an_earlier_one_that_chunked_alone_hides(model):
    chunked = _args(model, "--model.attn_backend", "flex", "--model.attn_mask_type", "chunked",
                    "--model.attn_chunk_size", "8")  # fmt: skip
    with_global = replace(chunked, attn_global_every_n_layers=2)
    tokens = _documents(eos_id=1)[:, :-1]
    edited = tokens.clone()
    edited[:, :8] = torch.randint(2, 2048, (2, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        local_only, interleaved = _build(model, chunked), _build(model, with_global)
        torch.testing.assert_close(local_only(edited)[:, 8:], local_only(tokens)[:, 8:], atol=1e-5, rtol=0)
        changed = (interleaved(edited)[:, 8:] - interleaved(tokens)[:, 8:]).abs().amax(dim=-1)
        assert (changed > 1e-3).all()  # every later position, in every later chunk


@pytest.mark.parametrize("model", ["llama3", "qwen3", "deepseek_v3"])
def test_block_causal_keeps_a_later_document_blind_to_an_earlier_one(model):
    # Causality alone already hides later documents from earlier ones; block_causal must also
    # hide earlier documents from later ones. The EOS at position 9 ends row 0's first document.
    args = _args(model, "--model.attn_backend", "flex", "--model.attn_mask_type", "block_causal")
    block_causal, causal = _build(model, args), _build(model, replace(args, attn_mask_type="causal"))
    tokens = _documents(args.eos_id)[:, :-1]
    edited = tokens.clone()
    edited[0, 2:9] = torch.randint(args.eos_id + 1, 2048, (7,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        before, after = block_causal(tokens), block_causal(edited)
        torch.testing.assert_close(after[0, 10:], before[0, 10:], atol=1e-5, rtol=0)
        assert not torch.allclose(after[0, :9], before[0, :9])  # the edited document itself changed
        assert not torch.allclose(causal(edited)[0, 10:], causal(tokens)[0, 10:])  # plain causal leaks


@pytest.mark.parametrize("model", ["llama3", "qwen3", "deepseek_v3"])
@pytest.mark.parametrize("mask_type", ["sliding_window", "chunked"])
def test_split_documents_keeps_a_window_or_chunk_blind_to_the_previous_document(model, mask_type):
    # Window and chunk of 16 reach from positions 10..15 back across the EOS at position 9.
    sizes = ["--model.sliding_window", "16", "--model.attn_chunk_size", "16"]
    args = _args(model, "--model.attn_backend", "flex", "--model.attn_mask_type", mask_type, *sizes,
                 "--model.attn_split_documents")  # fmt: skip
    split, unsplit = _build(model, args), _build(model, replace(args, split_documents=False))
    tokens = _documents(args.eos_id)[:, :-1]
    edited = tokens.clone()
    edited[0, 2:9] = torch.randint(args.eos_id + 1, 2048, (7,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(split(edited)[0, 10:], split(tokens)[0, 10:], atol=1e-5, rtol=0)
        assert not torch.allclose(unsplit(edited)[0, 10:16], unsplit(tokens)[0, 10:16])


# ----- activation checkpointing ------------------------------------------------------------


@pytest.fixture(scope="module")
def flex_reference():
    """Per model: flex args (block_causal), its packed batch, and the loss and grads without AC."""
    cache = {}

    def get(model):
        if model not in cache:
            args = _args(model, "--model.attn_backend", "flex", "--model.attn_mask_type", "block_causal")
            tokens = _documents(args.eos_id)
            cache[model] = args, tokens, next_token_loss_and_grads(_build(model, args), tokens)
        return cache[model]

    return get


@pytest.mark.parametrize("mode", list(AC_MODES))
@pytest.mark.parametrize("model", list(MODELS))
def test_every_ac_mode_under_flex_keeps_loss_and_gradients(model, mode, flex_reference):
    args, tokens, (ref_loss, ref_grads) = flex_reference(model)
    module = _build(model, args, AC_MODES[mode])
    if mode == "selective op":
        # flex without compile: the attention branch under full AC, the MLP branch under op-SAC.
        assert all("attention_branch" in vars(b) for b in module.layers.values())
    loss, grads = next_token_loss_and_grads(module, tokens)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert torch.equal(grads[name], grad), name  # CPU kernels are deterministic: bit for bit


def _train_interleaved_chunked(compiled: bool) -> list[float]:
    """Losses of 3 AdamW steps on one batch: Llama 3 debug, 4 layers, chunks of 8 with every 2nd
    layer global, op-SAC, parallelized as the trainer does (compiled blocks or eager)."""
    argv = ["--model.attn_backend", "flex", "--model.attn_mask_type", "chunked",
            "--model.attn_chunk_size", "8", "--model.attn_global_every_n_layers", "2",
            "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
            *(["--compile.enable"] if compiled else [])]  # fmt: skip
    cfg = _config("llama3", *argv)
    spec = get_train_spec("llama3")
    args = replace(spec.get_flavor(cfg.model.flavor).update_from_config(cfg), n_layers=4)
    model = spec.build_meta_model(args, torch.float32)
    spec.parallelize_fn(model, ParallelDims(1, 1, 1, 1), cfg, torch.device("cpu"))
    init_on_cpu(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = _documents(eos_id=1)
    losses = []
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        loss, _ = next_token_loss_and_grads(model, tokens)
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_compiled_blocks_with_local_and_global_layers_train_as_eager_ones():
    """Each compiled block must take its own layer's mask: a compiled graph that kept the mask
    it was traced with would give the other layers the wrong one and change the loss."""
    eager = _train_interleaved_chunked(compiled=False)
    assert eager[-1] < eager[0]
    torch.testing.assert_close(_train_interleaved_chunked(compiled=True), eager, rtol=1e-4, atol=0)
