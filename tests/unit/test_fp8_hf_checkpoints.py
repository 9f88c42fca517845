"""Hugging Face checkpoints with block-scaled fp8 weights, as DeepSeek-V3 publishes them, load
as their dequantized values, through the trainer's `initial_load_in_hf` and the conversion
script; anything else quantized is refused with a message naming the fix."""

import json
import logging
import math
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import load_script
from tests.unit.test_checkpoint_loading import _hf_loading_manager, _model
from torchtitan.components.checkpoint import TrainState
from torchtitan.components.hf_io import (
    CONFIG_FILE,
    DEFAULT_FP8_BLOCK,
    HFQuantizationError,
    dequantize_fp8,
    fp8_block_size,
    load_hf,
    save_hf,
)
from torchtitan.config.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def _blocks(shape, block):
    """(block row, block column, row slice, column slice) of every block of a 2-D `shape`."""
    for i in range(math.ceil(shape[0] / block[0])):
        for j in range(math.ceil(shape[1] / block[1])):
            rows = slice(i * block[0], (i + 1) * block[0])
            yield i, j, rows, slice(j * block[1], (j + 1) * block[1])


def _quantize(weight: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's encoding: each block's largest magnitude maps to e4m3's largest value, and the
    scale stored is the multiplier that maps it back."""
    quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(weight.shape[0] / block[0]), math.ceil(weight.shape[1] / block[1]))
    for i, j, rows, columns in _blocks(weight.shape, block):
        scale = weight[rows, columns].abs().max().clamp(min=1e-12) / E4M3_MAX
        quantized[rows, columns] = (weight[rows, columns] / scale).to(torch.float8_e4m3fn)
        scales[i, j] = scale
    return quantized, scales


def _dequantized_by_blocks(quantized: torch.Tensor, scales: torch.Tensor, block) -> torch.Tensor:
    weight = torch.empty(quantized.shape)
    for i, j, rows, columns in _blocks(quantized.shape, block):
        weight[rows, columns] = quantized[rows, columns].float() * scales[i, j]
    return weight


def _publish_fp8(
    model,
    adapter,
    folder,
    block=DEFAULT_FP8_BLOCK,
    config_block=None,
    mtp_layer=False,
    scale_dtype=torch.float32,
):
    """Write `model` as DeepSeek publishes V3 (and Qwen3 its -FP8 releases): every projection
    weight fp8 with its ``weight_scale_inv``, embeddings, norms and routers in bf16, and with
    `mtp_layer` a copy of the last layer past it, where DeepSeek stores its multi-token
    prediction. DeepSeek stores the scales in float32; other releases use bfloat16. Returns the
    HF tensors the loader should produce (dequantized by explicit block loops, the MTP layer
    left out)."""
    hf = {key: tensor.to(torch.bfloat16) for key, tensor in adapter.to_hf(model.state_dict()).items()}
    hf = {
        key: tensor.float() if key.endswith("e_score_correction_bias") else tensor
        for key, tensor in hf.items()
    }
    n_layers = adapter.model_args.n_layers
    if mtp_layer:
        last = f"model.layers.{n_layers - 1}."
        hf.update(
            {
                key.replace(last, f"model.layers.{n_layers}."): t
                for key, t in hf.items()
                if key.startswith(last)
            }
        )
    published, expected = {}, {}
    for key, tensor in hf.items():
        if key.endswith("_proj.weight"):
            quantized, scales = _quantize(tensor.float(), block)
            scales = scales.to(scale_dtype)
            published[key], published[f"{key}_scale_inv"] = quantized, scales
            expected[key] = _dequantized_by_blocks(quantized, scales, block)
        else:
            published[key] = expected[key] = tensor
    config = {**adapter.hf_config(torch.bfloat16), "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(config_block or block)}}  # fmt: skip
    save_hf(published, config, folder)
    is_mtp = re.compile(rf"model\.layers\.{n_layers}\.")
    return {key: tensor for key, tensor in expected.items() if not is_mtp.match(key)}


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    """(the model, its adapter, an fp8 HF folder of it, our state dict the loader should give)."""
    model, adapter = _model("deepseek_v3")
    folder = tmp_path_factory.mktemp("deepseek_fp8")
    expected_hf = _publish_fp8(model, adapter, folder, mtp_layer=True)
    return model, adapter, folder, adapter.from_hf(expected_hf)


def _set_config(folder, **changes):
    config = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps({**config, **changes}))


def _copy(folder, tmp_path, drop=()):
    """The checkpoint in `folder` rewritten into `tmp_path`, without the keys in `drop`."""
    tensors = {key: t for key, t in load_hf(folder).items() if key not in drop}
    save_hf(tensors, json.loads((folder / CONFIG_FILE).read_text()), tmp_path)
    return tmp_path


def test_each_block_is_multiplied_by_its_own_scale_including_the_ragged_edges():
    weight = torch.randn(5, 7)
    quantized, _ = _quantize(weight, (2, 3))
    scales = torch.rand(3, 3) + 0.5  # 3 x 3 blocks: the last row and column of blocks are partial

    got = dequantize_fp8({"w.weight": quantized, "w.weight_scale_inv": scales, "b": torch.ones(2)}, (2, 3))

    assert sorted(got) == ["b", "w.weight"]
    assert got["w.weight"].dtype == torch.float32
    assert torch.equal(got["w.weight"], _dequantized_by_blocks(quantized, scales, (2, 3)))


def test_an_fp8_deepseek_checkpoint_loads_as_its_dequantized_weights(deepseek_fp8, tmp_path):
    model, adapter, folder, expected = deepseek_fp8
    target, _ = _model("deepseek_v3", seed=1)

    assert _hf_loading_manager(tmp_path, folder, target, adapter).load(TrainState())

    loaded = target.state_dict()
    assert sorted(loaded) == sorted(expected)
    for key, want in expected.items():
        assert torch.equal(loaded[key], want.to(loaded[key].dtype)), key
    # fp8 keeps 3 mantissa bits: every weight within 1/16 of its tensor's largest magnitude.
    original = model.state_dict()
    worst = max((loaded[k] - original[k]).abs().max() / original[k].abs().max() for k in loaded)
    assert 0 < worst <= 1 / 16, worst


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_an_fp8_qwen3_checkpoint_with_bf16_scales_loads_as_its_dequantized_weights(flavor, tmp_path):
    model, adapter = _model("qwen3", flavor)
    expected = adapter.from_hf(_publish_fp8(model, adapter, tmp_path / "hf", scale_dtype=torch.bfloat16))
    target, _ = _model("qwen3", flavor, seed=1)

    _hf_loading_manager(tmp_path, tmp_path / "hf", target, adapter).load(TrainState())

    loaded = target.state_dict()
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[key], want.to(loaded[key].dtype)) for key, want in expected.items())


def test_an_fp8_load_logs_the_dequantization_and_never_reads_the_mtp_layer(
    deepseek_fp8, tmp_path, monkeypatch, caplog
):
    import torchtitan.components.hf_load as hf_load

    _, adapter, folder, _ = deepseek_fp8
    reads, real_read = [], hf_load.load_hf_tensors
    monkeypatch.setattr(
        hf_load, "load_hf_tensors", lambda layout, keys: reads.extend(keys) or real_read(layout, keys)
    )
    target, _ = _model("deepseek_v3", seed=1)

    with caplog.at_level(logging.INFO):
        _hf_loading_manager(tmp_path, folder, target, adapter).load(TrainState())

    n_layers = adapter.model_args.n_layers
    read_layers = {int(m.group(1)) for key in reads if (m := re.match(r"model\.layers\.(\d+)\.", key))}
    assert read_layers == set(range(n_layers))
    scales = sum(key.endswith("_scale_inv") for key in load_hf(folder) if f"layers.{n_layers}." not in key)
    assert f"Dequantizing {scales} fp8 weights (128 x 128 blocks) to float32" in caplog.text


def test_the_block_size_comes_from_config_json_and_defaults_to_128(tmp_path):
    model, adapter = _model("deepseek_v3")
    expected = adapter.from_hf(_publish_fp8(model, adapter, tmp_path / "hf", block=(64, 32)))
    target, _ = _model("deepseek_v3", seed=1)

    _hf_loading_manager(tmp_path, tmp_path / "hf", target, adapter).load(TrainState())

    assert fp8_block_size(tmp_path / "hf") == (64, 32)
    assert fp8_block_size(tmp_path) == DEFAULT_FP8_BLOCK  # no config.json
    loaded = target.state_dict()
    assert all(torch.equal(loaded[key], want.to(loaded[key].dtype)) for key, want in expected.items())


def test_a_block_size_that_does_not_fit_the_scales_is_refused_naming_the_key(tmp_path):
    model, adapter = _model("deepseek_v3")
    _publish_fp8(model, adapter, tmp_path / "hf", block=(128, 128), config_block=(64, 64))
    target, _ = _model("deepseek_v3", seed=1)
    manager = _hf_loading_manager(tmp_path, tmp_path / "hf", target, adapter)

    with pytest.raises(ConfigError, match=r"'model\.layers\.\d+\.\S+_proj\.weight_scale_inv' has shape .* "
                                          r"in blocks of 64 x 64 needs .*weight_block_size"):  # fmt: skip
        manager.load(TrainState())


def test_a_float8_weight_without_its_scale_is_refused_before_any_weight_loads(deepseek_fp8, tmp_path):
    _, adapter, folder, _ = deepseek_fp8
    unscaled = "model.layers.2.self_attn.o_proj.weight"
    broken = _copy(folder, tmp_path / "hf", drop=[f"{unscaled}_scale_inv"])
    target, _ = _model("deepseek_v3", seed=1)
    before = {key: tensor.clone() for key, tensor in target.state_dict().items()}

    with pytest.raises(ConfigError, match=rf"'{re.escape(unscaled)}' is torch.float8_e4m3fn without a"):
        _hf_loading_manager(tmp_path, broken, target, adapter).load(TrainState())

    assert all(torch.equal(target.state_dict()[key], tensor) for key, tensor in before.items())


def test_a_scale_without_its_weight_is_refused_naming_both(deepseek_fp8, tmp_path):
    _, adapter, folder, _ = deepseek_fp8
    weight = "model.layers.1.mlp.experts.3.up_proj.weight"
    broken = _copy(folder, tmp_path / "hf", drop=[weight])
    target, _ = _model("deepseek_v3", seed=1)

    with pytest.raises(
        ConfigError, match=rf"'{re.escape(weight)}_scale_inv' scales '{re.escape(weight)}', which"
    ):
        _hf_loading_manager(tmp_path, broken, target, adapter).load(TrainState())


@pytest.mark.parametrize(
    "quantization, message",
    [
        (
            {"quant_method": "gptq", "bits": 4},
            r"quant_method = 'gptq' is not supported.*Convert the checkpoint",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128]},
            r"weight_block_size = \[128\] is not two positive",
        ),
    ],
)
def test_a_quantization_config_that_cannot_be_read_is_refused_naming_the_key(
    deepseek_fp8, tmp_path, quantization, message
):
    _, adapter, folder, _ = deepseek_fp8
    copied = _copy(folder, tmp_path / "hf")
    _set_config(copied, quantization_config=quantization)
    target, _ = _model("deepseek_v3", seed=1)

    with pytest.raises(
        ConfigError, match=r"'checkpoint.initial_load_path' = .*config\.json: quantization_config\." + message
    ):
        _hf_loading_manager(tmp_path, copied, target, adapter).load(TrainState())


def _convert_from_hf(hf_folder, dcp_folder) -> int:
    script = load_script("scripts/checkpoint_conversion/convert_from_hf.py")
    common = ["--model", "deepseek_v3", "--flavor", "debugmodel"]
    return script.main([*common, "--hf", str(hf_folder), "--out", str(dcp_folder)])


def test_the_conversion_script_writes_the_dequantized_weights(deepseek_fp8, tmp_path):
    _, _, folder, expected = deepseek_fp8

    assert _convert_from_hf(folder, tmp_path / "dcp") == 0

    back = {key: torch.empty(tensor.shape) for key, tensor in expected.items()}
    dcp.load({"model": back}, checkpoint_id=str(tmp_path / "dcp"))
    assert all(torch.equal(back[key], tensor.float()) for key, tensor in expected.items())


def test_the_conversion_script_refuses_another_quantization_with_exit_2(deepseek_fp8, tmp_path, capsys):
    _, _, folder, _ = deepseek_fp8
    copied = _copy(folder, tmp_path / "hf")
    _set_config(copied, quantization_config={"quant_method": "awq"})

    assert _convert_from_hf(copied, tmp_path / "dcp") == 2

    assert "quant_method = 'awq' is not supported" in capsys.readouterr().err
    assert not (tmp_path / "dcp").exists()


def test_dequantizing_meta_tensors_checks_shapes_without_data():
    weight = torch.empty(300, 200, dtype=torch.float8_e4m3fn, device="meta")

    got = dequantize_fp8(
        {"w.weight": weight, "w.weight_scale_inv": torch.empty(3, 2, device="meta")}, (128, 128)
    )

    assert got["w.weight"].shape == (300, 200) and got["w.weight"].device.type == "meta"
    with pytest.raises(HFQuantizationError, match=r"has shape \(2, 2\), but 'w.weight' \(300, 200\)"):
        dequantize_fp8(
            {"w.weight": weight, "w.weight_scale_inv": torch.empty(2, 2, device="meta")}, (128, 128)
        )


def test_a_scale_beside_a_weight_that_is_not_float8_is_refused():
    with pytest.raises(HFQuantizationError, match=r"'w.weight' is torch.bfloat16, not float8, yet has a"):
        dequantize_fp8(
            {"w.weight": torch.ones(4, 4, dtype=torch.bfloat16), "w.weight_scale_inv": torch.ones(1, 1)},
            (128, 128),
        )
