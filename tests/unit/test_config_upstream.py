"""A config written for upstream torchtitan, current or earlier, loads here or says what to change."""

from pathlib import Path

import pytest

from torchtitan.config import ConfigError, JobConfig, parse_args
from torchtitan.config.manager import _is_own_key
from torchtitan.config.upstream import RENAMED_FOLDER_KEYS, RENAMED_KEYS, UNBUILT_KEYS
from torchtitan.train import main

EARLIER_NAMES = """
[training]
batch_size = 3
compile = true
warmup_steps = 7

[lr_scheduler]
lr_min = 0.25

[checkpoint]
enable_checkpoint = true
model_weights_only = false

[validation]
enabled = true
seq_len = 512
"""


def _load(tmp_path, text: str, *argv: str) -> JobConfig:
    path = tmp_path / "upstream.toml"
    path.write_text(text)
    return parse_args(["--config", str(path), *argv], env={})


def _error(tmp_path, text: str, *argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text, *argv)
    return str(info.value)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_earlier_key_names_in_a_file_set_the_keys_they_were_renamed_to(tmp_path):
    cfg = _load(tmp_path, EARLIER_NAMES)
    assert cfg.training.local_batch_size == 3 and cfg.compile.enable
    assert cfg.lr_scheduler.warmup_steps == 7 and cfg.lr_scheduler.min_lr_factor == 0.25
    assert cfg.checkpoint.enable and cfg.checkpoint.last_save_model_only is False
    assert cfg.validation.enable and cfg.validation.seq_len == 512


def test_each_earlier_key_name_is_warned_about_with_its_new_name(tmp_path, caplog):
    _load(tmp_path, EARLIER_NAMES)
    warnings = _warnings(caplog)
    assert len(warnings) == 7
    assert any("'training.batch_size'" in w and "as 'training.local_batch_size'" in w for w in warnings)
    assert all("rename it to silence this warning" in w for w in warnings)


def test_earlier_key_names_on_the_command_line_set_the_new_keys(tmp_path):
    cfg = _load(tmp_path, "", "--training.compile", "--checkpoint.enable_checkpoint", "true",
                "--training.batch_size", "5")  # fmt: skip
    assert cfg.compile.enable and cfg.checkpoint.enable and cfg.training.local_batch_size == 5


def test_a_key_set_under_both_names_with_different_values_is_refused(tmp_path):
    message = _error(tmp_path, "[training]\ncompile = false\n[compile]\nenable = true\n")
    assert "'training.compile' = False" in message and "'compile.enable' = True" in message
    assert "same key here ('compile.enable'); keep one" in message


def test_a_key_set_under_both_names_with_one_value_loads(tmp_path):
    assert _load(tmp_path, "[checkpoint]\nenable = true\nenable_checkpoint = true\n").checkpoint.enable


def test_an_upstream_key_of_an_unbuilt_feature_at_its_default_is_ignored_with_a_warning(tmp_path, caplog):
    text = "[parallelism]\nenable_compiled_autograd = false\n[job]\nuse_for_integration_test = true\n"
    cfg = _load(tmp_path, text)
    assert cfg.parallelism == JobConfig().parallelism and cfg.job.description == JobConfig().job.description
    warnings = _warnings(caplog)
    assert [w.split(" in ")[0] for w in warnings] == [
        "Ignoring 'parallelism.enable_compiled_autograd'",
        "Ignoring 'job.use_for_integration_test'",
    ]
    assert all("has no effect here" in w for w in warnings)


@pytest.mark.parametrize(
    "text, argv",
    [("[parallelism]\nenable_compiled_autograd = true\n", ()),
     ("", ("--parallelism.enable_compiled_autograd",))],
    ids=["file", "command-line flag"],
)  # fmt: skip
def test_an_upstream_key_of_an_unbuilt_feature_set_on_is_refused(tmp_path, text, argv):
    message = _error(tmp_path, text, *argv)
    assert "'parallelism.enable_compiled_autograd' = True" in message
    assert "compiled autograd, which this trainer does not build" in message
    assert "remove the key or set it to False" in message


def test_an_unbuilt_key_given_its_default_on_the_command_line_is_ignored(tmp_path):
    assert _load(tmp_path, "", "--model.norm_type", "rmsnorm").model == JobConfig().model
    assert "set it to 'rmsnorm'" in _error(tmp_path, "", "--model.norm_type", "layernorm")


@pytest.mark.parametrize(
    "text, fix",
    [('[model]\ntokenizer_path = "assets/tokenizer.model"\n', "set 'model.hf_assets_path' to the folder"),
     ("[float8]\nenable_float8_linear = true\n", "add \"float8\" to 'model.converters' instead"),
     ("[metrics]\nrank_0_only = false\n", "set 'metrics.save_for_all_ranks' = true instead")],
    ids=["tokenizer_path", "enable_float8_linear", "rank_0_only"],
)  # fmt: skip
def test_an_upstream_key_replaced_by_another_setting_names_that_setting(tmp_path, text, fix):
    message = _error(tmp_path, text)
    assert "which is not read here" in message and fix in message


def test_a_key_under_the_section_upstream_used_to_keep_it_in_names_its_section(tmp_path):
    message = _error(tmp_path, "[training]\ntensor_parallel_degree = 2\n")
    assert "'tensor_parallel_degree' is a key of [parallelism], not of [training]" in message
    assert "write it as 'parallelism.tensor_parallel_degree'" in message


def test_a_misspelling_near_a_key_of_its_own_section_is_not_sent_elsewhere(tmp_path):
    message = _error(tmp_path, "[checkpoint]\nintervall = 5\n")
    assert "Did you mean 'interval'?" in message and "write it as" not in message


def test_every_problem_in_a_file_is_reported_at_once(tmp_path):
    text = (
        "[training]\ntensor_parallel_degree = 2\nstepz = 3\n[parallelism]\nenable_compiled_autograd = true\n"
    )
    message = _error(tmp_path, text)
    assert message.startswith("3 problems in ")
    lines = message.splitlines()[1:]
    assert len(lines) == 3 and all(line.startswith("  - ") for line in lines)
    assert "tensor_parallel_degree" in lines[0] and "stepz" in lines[1] and "compiled_autograd" in lines[2]


def test_a_file_with_several_problems_exits_with_code_2_listing_them(tmp_path, capsys):
    path = tmp_path / "upstream.toml"
    path.write_text("[training]\nstepz = 3\nbatch_sise = 1\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "2 problems in" in err and "stepz" in err and "batch_sise" in err and "Traceback" not in err


def test_a_tokenizer_path_naming_a_folder_is_read_as_hf_assets_path(tmp_path, caplog):
    cfg = _load(tmp_path, '[model]\ntokenizer_path = "./assets/hf/deepseek-moe-16b-base/"\n')
    assert cfg.model.hf_assets_path == "./assets/hf/deepseek-moe-16b-base/"
    assert "as 'model.hf_assets_path'" in _warnings(caplog)[0]


def test_the_tables_name_only_keys_that_are_not_this_trainers_own():
    for old, new in (RENAMED_KEYS | RENAMED_FOLDER_KEYS).items():
        assert not _is_own_key(*old.partition(".")[::2]) and _is_own_key(*new.split(".")), (old, new)
    assert not [name for name in UNBUILT_KEYS if _is_own_key(*name.partition(".")[::2])]


def test_upstreams_last_toml_era_config_with_every_key_at_its_default_loads(caplog):
    """Upstream's bundled C4 sample is the one thing to change (it is not shipped here)."""
    path = Path(__file__).parent / "upstream_configs" / "last_toml_era_defaults.toml"
    cfg = parse_args(["--config", str(path), "--training.dataset", "smoke"], env={})
    assert cfg.training.seed == 42 and cfg.training.deterministic is False
    assert cfg.job.print_args is False and cfg.parallelism == JobConfig().parallelism
    assert any("Ignoring 'fault_tolerance.enable'" in w for w in _warnings(caplog))


def test_upstreams_debug_section_sets_its_keys_here(tmp_path):
    keys = (
        "seed = 7",
        "deterministic = true",
        "deterministic_warn_only = true",
        "moe_force_load_balance = true",
    )
    cfg = _load(tmp_path, "\n".join(["[debug]", *keys]))
    t = cfg.training
    assert (t.seed, t.deterministic, t.deterministic_warn_only) == (7, True, True)
    assert cfg.model.moe_force_load_balance is True


def test_upstreams_experimental_custom_import_is_read_as_job_custom_import(tmp_path, caplog):
    cfg = _load(tmp_path, '[experimental]\ncustom_import = "tests.unit.custom_model_registration"\n')
    assert cfg.job.custom_import == "tests.unit.custom_model_registration"  # parsed, not imported
    assert "as 'job.custom_import'" in _warnings(caplog)[0]


def test_an_unknown_key_of_upstreams_debug_section_lists_the_ones_read_here(tmp_path):
    message = _error(tmp_path, "[debug]\nsed = 7\n")
    assert "unknown key 'debug.sed'" in message and "understood here only for seed, deterministic" in message
    assert "Did you mean 'seed'?" in message


@pytest.mark.parametrize(
    "text, refused",
    [("[validation.dataloader]\nnum_workers = 4\n", "'validation.dataloader.num_workers' = 4"),
     ("[validation.dataloader]\npin_memory = true\n", "'validation.dataloader.pin_memory' = True"),
     ("[fault_tolerance]\nenable = true\nreplica_id = 1\n", "'fault_tolerance.enable' = True"),
     ("[parallelism]\nexpert_parallel_comm_backend = \"deepep\"\n",
      "'parallelism.expert_parallel_comm_backend' = 'deepep'")],
    ids=["validation workers", "pinned memory", "fault tolerance", "deepep"],
)  # fmt: skip
def test_an_upstream_table_of_an_unbuilt_feature_switched_on_is_refused_naming_it(tmp_path, text, refused):
    message = _error(tmp_path, text)
    assert refused in message and "which this trainer does not build" in message


def test_upstreams_fake_backend_dry_run_is_refused_pointing_at_the_memory_estimator(tmp_path):
    message = _error(tmp_path, '[comm]\nmode = "fake_backend"\n')
    assert message.startswith("'comm.mode' = 'fake_backend'")
    assert "./run_memory_estimation.sh --ngpu N with the same arguments" in message


def test_an_upstream_table_of_an_unbuilt_feature_switched_off_is_ignored(tmp_path):
    text = "[fault_tolerance]\nenable = false\nreplica_id = 3\n[validation.dataloader]\nnum_workers = 0\n"
    assert _load(tmp_path, text).training == _load(tmp_path, "").training


@pytest.mark.parametrize(
    "argv, named",
    [(("--training.dataset", "c4_test"), "use 'smoke'"),
     (("--validation.enable", "--validation.dataset", "c4_validation"), "use 'smoke_validation'")],
    ids=["training", "validation"],
)  # fmt: skip
def test_upstream_bundled_samples_name_the_bundled_corpus_here(tmp_path, argv, named):
    message = _error(tmp_path, "", *argv)
    assert "is upstream torchtitan's bundled C4 sample" in message and named in message


def test_a_disabled_validation_section_may_keep_upstreams_sample_name(tmp_path):
    cfg = _load(tmp_path, '[validation]\nenabled = false\ndataset = "c4_validation"\n')
    assert cfg.validation.dataset == "c4_validation" and cfg.validation.enable is False


def test_float8_grouped_experts_are_refused_only_with_float8_on(tmp_path):
    text = '[float8]\nmoe_fqns = ["experts"]\n'
    assert _load(tmp_path, text).float8.moe_fqns == ["experts"]
    message = _error(tmp_path, text, "--model.converters", "float8")
    assert "'float8.moe_fqns' = ['experts'] asks for float8 grouped experts" in message
    assert "set moe_fqns = []" in message


def test_a_list_written_as_a_comma_separated_string_is_read_as_on_the_command_line(tmp_path):
    cfg = _load(tmp_path, '[model]\nconverters = "float8"\n[float8]\nfilter_fqns = "output, router.gate"\n')
    assert cfg.model.converters == ["float8"] and cfg.float8.filter_fqns == ["output", "router.gate"]


def test_upstreams_training_dataloader_table_sets_the_loader_keys_here(tmp_path, caplog):
    text = "[training.dataloader]\nnum_workers = 3\npin_memory = true\npersistent_workers = true\n"
    cfg = _load(tmp_path, text)
    assert (cfg.training.dataloader_num_workers, cfg.training.dataloader_pin_memory) == (3, True)
    assert "as 'training.dataloader_num_workers', its name here" in caplog.text
    assert "Ignoring 'training.dataloader.persistent_workers'" in caplog.text


def test_a_misspelt_key_of_an_upstream_sub_table_lists_the_keys_understood_there(tmp_path):
    message = _error(tmp_path, "[training.dataloader]\nnum_worker = 0\n")
    assert "[training.dataloader] is understood here only for num_workers" in message
    assert "Did you mean 'num_workers'?" in message
