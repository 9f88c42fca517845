"""Checkpoints that do not fit the model are refused with a message, never half-loaded; exports
keep buffers in their dtype and replace an older export whole."""

import gc
import json
import logging
import re
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan.components.checkpoint import CheckpointManager, TrainState
from torchtitan.components.hf_io import INDEX_FILE, load_hf, save_hf
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.models import get_train_spec

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(name: str = "llama3", flavor: str = "debugmodel", seed: int = 0):
    spec = get_train_spec(name)
    args = spec.get_flavor(flavor)
    torch.manual_seed(seed)
    model = spec.build_meta_model(args, torch.float32)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    return model, spec.state_dict_adapter(args)


def _manager(tmp_path, argv: list[str], model=None, adapter=None) -> CheckpointManager:
    cfg = parse_args(["--job.dump_folder", str(tmp_path), *argv], env={})
    return CheckpointManager(
        cfg, model, None, None, None, dp_rank=0, dp_degree=1, device=torch.device("cpu"), hf_adapter=adapter
    )


def _export(model, adapter, folder) -> None:
    save_hf(adapter.to_hf(model.state_dict()), adapter.hf_config(), folder)


def _hf_loading_manager(tmp_path, hf_folder, model, adapter) -> CheckpointManager:
    argv = [
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(hf_folder),
    ]
    return _manager(tmp_path / "run", argv, model, adapter)


def test_an_hf_checkpoint_missing_a_tensor_is_refused_naming_it(tmp_path):
    model, adapter = _model()
    _export(model, adapter, tmp_path / "hf")
    shards = load_hf(tmp_path / "hf")
    del shards["model.layers.3.self_attn.q_proj.weight"]
    save_hf(shards, adapter.hf_config(), tmp_path / "hf_missing")
    target, _ = _model(seed=1)
    manager = _hf_loading_manager(tmp_path, tmp_path / "hf_missing", target, adapter)

    with pytest.raises(ConfigError, match=r"missing keys: layers\.3\.attention\.wq\.weight"):
        manager.load(TrainState())


def test_a_whole_hf_checkpoint_loads_every_tensor(tmp_path):
    model, adapter = _model()
    _export(model, adapter, tmp_path / "hf")
    target, _ = _model(seed=1)
    assert not torch.equal(target.tok_embeddings.weight, model.tok_embeddings.weight)

    assert _hf_loading_manager(tmp_path, tmp_path / "hf", target, adapter).load(TrainState())

    for (name, got), want in zip(target.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_an_hf_load_reads_one_decoder_layer_at_a_time(tmp_path, monkeypatch):
    import torchtitan.components.hf_load as hf_load

    model, adapter = _model()
    _export(model, adapter, tmp_path / "hf")
    reads = []
    real_read = hf_load.load_hf_tensors
    monkeypatch.setattr(
        hf_load, "load_hf_tensors", lambda layout, keys: reads.append(keys) or real_read(layout, keys)
    )
    target, _ = _model(seed=1)

    _hf_loading_manager(tmp_path, tmp_path / "hf", target, adapter).load(TrainState())

    layers_per_read = [
        {re.search(r"layers\.(\d+)\.", k).group(1) for k in keys if "layers." in k} for keys in reads
    ]
    assert len(reads) == 1 + len(model.layers)  # embedding, final norm and output, then each layer
    assert all(len(layers) <= 1 for layers in layers_per_read), layers_per_read
    assert sum(len(keys) for keys in reads) == len(load_hf(tmp_path / "hf"))
    assert torch.equal(target.layers["5"].attention.wq.weight, model.layers["5"].attention.wq.weight)


def test_an_hf_config_with_other_rope_settings_is_named_in_a_warning(tmp_path, caplog):
    model, adapter = _model()
    _export(model, adapter, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_theta"] = 1_000_000.0
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 40.0}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    target, _ = _model(seed=1)

    with caplog.at_level(logging.WARNING):
        _hf_loading_manager(tmp_path, tmp_path / "hf", target, adapter).load(TrainState())

    warning = " ".join(r.message for r in caplog.records if r.levelno == logging.WARNING)
    assert "rope_theta: checkpoint 1000000.0, this run 500000" in warning, warning
    assert "rope_scaling: checkpoint {'rope_type': 'yarn', 'factor': 40.0}, this run None" in warning


def test_an_hf_config_matching_the_model_gives_no_warning(tmp_path, caplog):
    model, adapter = _model()
    _export(model, adapter, tmp_path / "hf")
    target, _ = _model(seed=1)

    with caplog.at_level(logging.WARNING):
        _hf_loading_manager(tmp_path, tmp_path / "hf", target, adapter).load(TrainState())

    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_untied_hf_checkpoint_for_a_tied_flavor_is_refused_before_any_weight_loads(tmp_path):
    untied, adapter = _model()
    _export(untied, adapter, tmp_path / "hf")
    tied_args = replace(adapter.model_args, tie_word_embeddings=True)
    target = get_train_spec("llama3").build_meta_model(tied_args, torch.float32)
    target.to_empty(device="cpu")
    target.init_weights(buffer_device=torch.device("cpu"))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    tied_adapter = get_train_spec("llama3").state_dict_adapter(tied_args)
    manager = _hf_loading_manager(tmp_path, tmp_path / "hf", target, tied_adapter)

    with pytest.raises(ConfigError, match=r"is not a llama3 debugmodel checkpoint: lm_head.weight differs"):
        manager.load(TrainState())
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


def test_an_hf_checkpoint_of_another_model_is_refused_naming_the_flavor_key(tmp_path):
    qwen, qwen_adapter = _model("qwen3")
    _export(qwen, qwen_adapter, tmp_path / "hf_qwen3")
    llama, llama_adapter = _model()
    manager = _hf_loading_manager(tmp_path, tmp_path / "hf_qwen3", llama, llama_adapter)

    with pytest.raises(ConfigError, match=r"is not a llama3 debugmodel checkpoint.*model\.flavor"):
        manager.load(TrainState())


def test_a_dcp_checkpoint_of_another_model_is_refused_naming_a_wrong_shape(tmp_path):
    qwen, _ = _model("qwen3")
    folder = tmp_path / "run" / "checkpoint" / "step-0"
    dcp.save({"model": qwen.state_dict()}, checkpoint_id=str(folder))
    llama, _ = _model()
    manager = _manager(tmp_path / "run", ["--checkpoint.enable"], llama)

    with pytest.raises(
        ConfigError, match=r"checkpoint\.folder: .*step-0 was saved from another model.*wrong shapes"
    ):
        manager.load(TrainState())


@pytest.mark.parametrize(
    "argv, named",
    [(["--checkpoint.initial_load_path", "/x"], "'checkpoint.initial_load_path' = '/x'"),
     (["--checkpoint.load_step", "3"], "'checkpoint.load_step' = 3"),
     (["--checkpoint.exclude_from_loading", "model"], "'checkpoint.exclude_from_loading' = [\"model\"]"),
     (["--checkpoint.last_save_in_hf"], "'checkpoint.last_save_in_hf' = true")],
    ids=["initial_load_path", "load_step", "exclude_from_loading", "last_save_in_hf"],
)  # fmt: skip
def test_a_key_that_acts_only_with_checkpointing_enabled_is_refused_without_it(tmp_path, argv, named):
    with pytest.raises(ConfigError, match=re.escape(f"{named} acts only with checkpoint.enable = true")):
        parse_args(["--job.dump_folder", str(tmp_path), *argv], env={})


def test_an_hf_initial_load_that_asks_for_the_optimizer_state_is_refused(tmp_path):
    argv = ["--checkpoint.enable", "--checkpoint.initial_load_path", "/x", "--checkpoint.initial_load_in_hf"]
    with pytest.raises(
        ConfigError, match="'checkpoint.initial_load_model_only' = false asks for the optimizer"
    ):
        parse_args([*argv, "--checkpoint.no_initial_load_model_only"], env={})


def test_an_hf_last_save_that_should_be_resumable_is_refused(tmp_path):
    argv = ["--checkpoint.enable", "--checkpoint.last_save_in_hf", "--checkpoint.no_last_save_model_only"]
    with pytest.raises(
        ConfigError, match="'checkpoint.last_save_in_hf' = true writes the model weights only"
    ):
        parse_args(argv, env={})


def test_a_final_hf_export_that_cannot_be_written_is_refused_at_startup(tmp_path):
    spec = get_train_spec("llama3")
    flavor = spec.get_flavor("debugmodel")
    sliding = type(flavor)(**{**flavor.__dict__, "attn_backend": "flex", "attn_mask_type": "sliding_window"})
    argv = ["--checkpoint.enable", "--checkpoint.last_save_in_hf"]

    with pytest.raises(
        ConfigError, match=r"'checkpoint.last_save_in_hf' = true.*sliding_window.*Set it to false"
    ):
        _manager(tmp_path, argv, adapter=spec.state_dict_adapter(sliding))


def _saved_dtypes(folder) -> dict:
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    return {key: meta.properties.dtype for key, meta in metadata.state_dict_metadata.items()
            if hasattr(meta, "properties")}  # fmt: skip


def test_a_model_only_export_keeps_buffers_in_their_dtype(tmp_path):
    model, _ = _model("qwen3", "debugmodel_moe")
    manager = _manager(tmp_path, ["--checkpoint.enable", "--checkpoint.export_dtype", "bfloat16"], model)

    manager.save(TrainState(step=1), last=True)  # model only: last_save_model_only's default
    exported = _saved_dtypes(manager.folder / "step-1")

    assert exported["model.layers.0.moe.expert_bias"] == torch.float32
    assert exported["model.layers.0.moe.router.gate.weight"] == torch.bfloat16


def test_an_hf_export_replaces_an_older_one_without_leaving_its_shards(tmp_path):
    model, adapter = _model()
    folder = tmp_path / "checkpoint" / "step-5-hf"
    save_hf(adapter.to_hf(model.state_dict()), adapter.hf_config(), folder, max_shard_bytes=1)
    old_shards = len(list(folder.glob("*.safetensors")))
    manager = _manager(tmp_path, ["--checkpoint.enable", "--checkpoint.last_save_in_hf"], model, adapter)

    manager._save_hf(folder)

    listed = set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values())
    assert old_shards > len(listed)  # so every old shard name differs from the new ones
    assert sorted(p.name for p in folder.iterdir()) == sorted([INDEX_FILE, "config.json", *listed])
    assert not folder.with_name("step-5-hf.partial").exists()


def test_excluding_train_state_still_restores_the_data_position(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from torchtitan.datasets.text_datasets import PackedTokenDataset

    def manager(*argv):
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        dataset = PackedTokenDataset(torch.arange(1000).numpy(), 4, 0, 1, 2)
        loader = StatefulDataLoader(dataset, batch_size=2, num_workers=0)
        cfg = parse_args(["--job.dump_folder", str(tmp_path), "--checkpoint.enable",
                          "--training.local_batch_size", "2", *argv], env={})  # fmt: skip
        return CheckpointManager(cfg, model, optimizer, scheduler, loader, dp_rank=0, dp_degree=1,
                                 device=torch.device("cpu"))  # fmt: skip

    saving = manager()
    batches = iter(saving.dataloader)
    next(batches), next(batches)  # windows 0-3
    saving.save(TrainState(step=2))
    resuming = manager("--checkpoint.exclude_from_loading", "train_state")

    resuming.load(TrainState())

    assert next(iter(resuming.dataloader))[0][:, 0].tolist() == [16, 20]  # windows 4 and 5


def _lr_run(tmp_path, *argv) -> CheckpointManager:
    """A checkpointing run of a Linear under the warmup schedule (peak 1.0 at step 3)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from torchtitan.components.lr_scheduler import build_lr_scheduler
    from torchtitan.datasets.text_datasets import PackedTokenDataset

    cfg = parse_args(["--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--optimizer.lr", "1.0",
                      "--lr_scheduler.warmup_steps", "3", "--lr_scheduler.decay_ratio", "none",
                      "--training.steps", "10", "--training.local_batch_size", "2", *argv],
                     env={})  # fmt: skip
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr)
    loader = StatefulDataLoader(PackedTokenDataset(torch.arange(100).numpy(), 4, 0, 1, 2), batch_size=2)
    return CheckpointManager(cfg, model, optimizer, build_lr_scheduler(optimizer, cfg), loader, dp_rank=0,
                             dp_degree=1, device=torch.device("cpu"))  # fmt: skip


def _save_after_five_steps(tmp_path) -> float:
    """Save a run after step 5; the lr its step 6 uses."""
    run = _lr_run(tmp_path)
    for _ in range(5):
        run.optimizer.step()
        run.lr_scheduler.step()
    run.save(TrainState(step=5))
    return run.lr_scheduler.get_last_lr()[0]


@pytest.mark.parametrize("excluded", ["optimizer", "lr_scheduler"])
def test_after_loading_optimizer_or_scheduler_alone_the_next_step_uses_the_logged_lr(tmp_path, excluded):
    step_6_lr = _save_after_five_steps(tmp_path)
    resumed = _lr_run(tmp_path, "--checkpoint.exclude_from_loading", excluded)

    resumed.load(TrainState())

    logged = resumed.lr_scheduler.get_last_lr()[0]
    assert logged == pytest.approx(step_6_lr if excluded == "optimizer" else 1 / 3)  # a fresh step 1
    assert resumed.optimizer.param_groups[0]["lr"] == logged


def test_a_full_resume_keeps_the_saved_runs_next_lr(tmp_path):
    step_6_lr = _save_after_five_steps(tmp_path)
    resumed = _lr_run(tmp_path)

    resumed.load(TrainState())

    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(step_6_lr)


def _data_run(tmp_path, data, *argv, workers: int = 0) -> CheckpointManager:
    """A checkpointing run of a Linear whose loader streams `data` (a dataset of local files,
    taken by the streaming path as a hub dataset is) in 16-token windows, 2 per batch, read by
    `workers` loader worker processes."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.datasets.text_datasets import StreamingTokenDataset

    cfg = parse_args(["--job.dump_folder", str(tmp_path), "--checkpoint.enable",
                      "--training.local_batch_size", "2", *argv], env={})  # fmt: skip
    dataset = StreamingTokenDataset(str(data), HuggingFaceTokenizer(cfg.model.hf_assets_path), 16, 0, 1)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = StatefulDataLoader(dataset, batch_size=2, num_workers=workers)
    return CheckpointManager(cfg, model, optimizer, scheduler, loader, dp_rank=0, dp_degree=1,
                             device=torch.device("cpu"))  # fmt: skip


def test_a_streaming_datasets_position_resumes_exactly_through_a_checkpoint(tmp_path):
    data = tmp_path / "stream"
    data.mkdir()
    docs = [f"document {i} says " + "word " * (3 + i % 5) for i in range(40)]
    (data / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    saving = _data_run(tmp_path, data)
    batches = iter(saving.dataloader)
    for _ in range(5):
        next(batches)
    saving.save(TrainState(step=5))
    following = [next(batches)[0] for _ in range(3)]
    resuming = _data_run(tmp_path, data)

    resuming.load(TrainState())

    resumed = iter(resuming.dataloader)
    assert all(torch.equal(next(resumed)[0], want) for want in following)


@pytest.fixture
def _shut_down_loader_workers():
    """Collect the test's loaders, so that their worker processes exit now: one left to a
    later collection may be collected in the next test's forked workers, which then stall."""
    yield
    gc.collect()


def _sharded_stream(tmp_path, shards: int = 2):
    data = tmp_path / "stream"
    data.mkdir()
    for shard in range(shards):
        docs = [f"shard {shard} document {i} says " + "word " * (3 + i % 5) for i in range(20)]
        (data / f"part{shard}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return data


@pytest.mark.usefixtures("_shut_down_loader_workers")
def test_a_stream_read_by_loader_workers_resumes_exactly_through_a_checkpoint(tmp_path):
    data = _sharded_stream(tmp_path)
    saving = _data_run(tmp_path, data, workers=2)
    batches = iter(saving.dataloader)
    for _ in range(5):
        next(batches)
    saving.save(TrainState(step=5))
    following = [next(batches)[0] for _ in range(4)]
    resuming = _data_run(tmp_path, data, workers=2)

    resuming.load(TrainState())

    resumed = iter(resuming.dataloader)
    assert all(torch.equal(next(resumed)[0], want) for want in following)


@pytest.mark.usefixtures("_shut_down_loader_workers")
@pytest.mark.parametrize("saved, resumed", [(2, 0), (0, 2), (2, 1)])
def test_resuming_a_stream_with_another_worker_count_is_refused_naming_the_key(tmp_path, saved, resumed):
    data = _sharded_stream(tmp_path)
    saving = _data_run(tmp_path, data, workers=saved)
    next(iter(saving.dataloader))
    saving.save(TrainState(step=1))

    with pytest.raises(ConfigError) as raised:
        _data_run(tmp_path, data, workers=resumed).load(TrainState())

    assert f"('training.dataloader_num_workers' = {saved}) and this run sets {resumed}" in str(raised.value)
    assert "exclude_from_loading" in str(raised.value)


@pytest.mark.usefixtures("_shut_down_loader_workers")
def test_a_stream_position_saved_by_loader_workers_is_refused_by_a_packed_dataset(tmp_path):
    saving = _data_run(tmp_path, _sharded_stream(tmp_path), workers=2)
    next(iter(saving.dataloader))
    saving.save(TrainState(step=1))

    with pytest.raises(ConfigError, match=r"data position of a streamed dataset.*exclude_from_loading"):
        _lr_run(tmp_path).load(TrainState())


def test_resuming_a_packed_datasets_position_into_a_streamed_dataset_is_refused_naming_the_fix(tmp_path):
    _save_after_five_steps(tmp_path)  # a packed dataset's loader
    data = tmp_path / "stream"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"text": "one document " * 20}) + "\n")

    with pytest.raises(ConfigError, match=r"data position of a packed dataset.*exclude_from_loading"):
        _data_run(tmp_path, data).load(TrainState())


def _initial_load(tmp_path, path, *argv) -> None:
    model, adapter = _model()
    argv = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(path), *argv]
    _manager(tmp_path / "run", argv, model, adapter).load(TrainState())


def test_an_hf_folder_as_initial_load_without_initial_load_in_hf_is_refused_naming_the_key(tmp_path):
    model, adapter = _model()
    _export(model, adapter, tmp_path / "hf")
    message = r"is not a DCP checkpoint.*set checkpoint.initial_load_in_hf = true"
    with pytest.raises(ConfigError, match=message):
        _initial_load(tmp_path, tmp_path / "hf")


def test_a_checkpoint_folder_as_initial_load_is_refused_naming_its_newest_step(tmp_path):
    model, _ = _model()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "checkpoint" / "step-3"))
    message = r"is not a DCP checkpoint.*point it at one of its checkpoints, e.g. '.*checkpoint/step-3'"
    with pytest.raises(ConfigError, match=message):
        _initial_load(tmp_path, tmp_path / "checkpoint")


@pytest.mark.parametrize("model_only", [True, False], ids=["model only", "with optimizer"])
def test_an_initial_load_whose_metadata_is_damaged_is_refused_naming_the_key(tmp_path, model_only):
    model, _ = _model()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "step-3"))
    (tmp_path / "step-3" / ".metadata").write_bytes(b"")
    flag = "--checkpoint.initial_load_model_only" if model_only else "--checkpoint.no_initial_load_model_only"
    message = r"step-3 cannot be read \(EOFError.*Point checkpoint.initial_load_path at another checkpoint"
    with pytest.raises(ConfigError, match=message):
        _initial_load(tmp_path, tmp_path / "step-3", flag)


def test_an_export_as_initial_load_with_its_optimizer_asked_for_is_refused_naming_the_key(tmp_path):
    model, _ = _model()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "step-3"))
    with pytest.raises(ConfigError, match=r"holds model weights only.*set initial_load_model_only = true"):
        _initial_load(tmp_path, tmp_path / "step-3", "--checkpoint.no_initial_load_model_only")


@pytest.mark.parametrize(
    "model_name, flavor, warned", [("qwen3", "debugmodel_moe", True), ("llama3", "debugmodel", False)]
)
def test_a_final_hf_export_that_would_leave_out_state_is_warned_about_at_startup(
    tmp_path, caplog, model_name, flavor, warned
):
    model, adapter = _model(model_name, flavor)
    _manager(tmp_path, ["--checkpoint.enable", "--checkpoint.last_save_in_hf"], model, adapter)
    message = r"export leaves out layers\.\d+\.moe\.expert_bias and \d+ more like it"
    assert bool(re.search(message, caplog.text)) is warned, caplog.text
