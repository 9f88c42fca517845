"""The config loader: precedence, CLI syntax, shipped files, and every bad-input message."""

import re
import subprocess
import sys

import pytest
import tomllib

from tests.conftest import load_script
from torchtitan.config import ConfigError, JobConfig, parse_args
from torchtitan.config.manager import find_config_dirs, format_help, resolve_config_path
from torchtitan.config.toml_writer import to_toml
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import get_train_spec
from torchtitan.train import main

SHIPPED = sorted(p for d in find_config_dirs() for p in d.glob("*.toml"))


def test_default_config_is_llama3_debug_model():
    cfg = parse_args([], env={})
    assert cfg.model.name == "llama3"
    assert cfg.model.flavor == "debugmodel"
    assert cfg.job.config_file.endswith("debug_model.toml")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_round_trips_through_toml(path, tmp_path):
    cfg = parse_args(["--config", str(path)], env={})
    written = tmp_path / "resolved.toml"
    written.write_text(to_toml(cfg))
    again = parse_args(["--config", str(written)], env={})
    again.job.config_file = cfg.job.config_file
    assert again == cfg


def test_strings_with_quotes_backslashes_and_control_characters_round_trip_through_toml():
    cfg = JobConfig()
    cfg.job.description = 'line one\nline two\ttab "quoted" back\\slash \r\x01\x7f end'
    assert tomllib.loads(to_toml(cfg))["job"]["description"] == cfg.job.description


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_sets_only_known_keys(path):
    data = tomllib.loads(path.read_text())
    defaults = JobConfig().to_dict()
    for section, table in data.items():
        assert set(table) <= set(defaults[section]), (section, set(table) - set(defaults[section]))


def test_command_line_overrides_file_which_overrides_defaults():
    cfg = parse_args(["--training.steps", "7"], env={})
    assert cfg.training.steps == 7  # command line beats the file's 100
    assert cfg.training.seq_len == 256  # the file beats the default 2048
    assert cfg.training.max_norm == 1.0  # default kept


def test_bare_name_finds_config_in_any_model_folder():
    cfg = parse_args(["--config", "llama3_8b.toml"], env={})
    assert cfg.model.flavor == "8B"
    assert parse_args(["--config", "llama3_70b"], env={}).model.flavor == "70B"


def test_job_config_file_and_env_variable_select_the_file():
    assert parse_args(["--job.config_file", "llama3_8b.toml"], env={}).model.flavor == "8B"
    assert parse_args([], env={"CONFIG_FILE": "llama3_405b.toml"}).model.flavor == "405B"
    assert parse_args(["--config", "llama3_8b"], env={"CONFIG_FILE": "llama3_405b"}).model.flavor == "8B"


def test_boolean_flags_and_negations():
    cfg = parse_args(["--metrics.enable_tensorboard", "--training.deterministic"], env={})
    assert cfg.metrics.enable_tensorboard is True and cfg.training.deterministic is True
    cfg = parse_args(["--metrics.enable_tensorboard", "--metrics.no_enable_tensorboard"], env={})
    assert cfg.metrics.enable_tensorboard is False
    assert parse_args(["--training.deterministic=true"], env={}).training.deterministic is True


def test_lists_are_comma_separated_and_equals_syntax_works():
    cfg = parse_args(
        [
            "--compile.components",
            "model",
            "--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns=a.b,c",
        ],
        env={},
    )
    assert cfg.compile.components == ["model"]
    assert cfg.activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns == ["a.b", "c"]


def test_optional_values_accept_none():
    cfg = parse_args(["--training.seed", "none", "--lr_scheduler.decay_ratio", "0.5"], env={})
    assert cfg.training.seed is None and cfg.lr_scheduler.decay_ratio == 0.5


def test_help_lists_every_option_with_its_default():
    text = format_help()
    for section, table in JobConfig().to_dict().items():
        for key, value in table.items():
            option = f"--{section}.{key} ("
            assert option in text
            line = text.split(option, 1)[1].split("\n", 1)[0]
            assert line.endswith(f"default {value!r})"), (section, key, line)


def _error(argv, env=None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_args(argv, env=env or {})
    return str(info.value)


def test_a_config_folder_is_refused_naming_a_toml_file_in_it():
    message = _error(["--config", "torchtitan/models/llama3/train_configs"])
    assert "is a folder; give a TOML file in it, e.g." in message and message.endswith(".toml'.")


def test_a_number_written_as_a_toml_string_is_refused_with_the_fix(tmp_path):
    config = tmp_path / "quoted.toml"
    config.write_text('[optimizer]\nlr = "3e-3"\n')
    message = _error(["--config", str(config)])
    assert "expected float (written as a string: write 3e-3 without quotes)" in message


def test_a_mistyped_number_gets_an_example_spelled_where_it_was_written(tmp_path):
    assert _error(["--training.steps", "five"]).endswith("expected int, for example --training.steps 10000.")
    config = tmp_path / "words.toml"
    config.write_text('[optimizer]\nlr = "fast"\n')
    assert _error(["--config", str(config)]).endswith("expected float, for example lr = 0.0008.")


@pytest.mark.parametrize("flavor, suggested", [("8b", "8B"), ("debugmodle", "debugmodel")])
def test_a_misspelled_flavor_gets_the_closest_one(flavor, suggested):
    from torchtitan.models import get_train_spec

    with pytest.raises(ConfigError, match=f"Did you mean '{suggested}'\\?"):
        get_train_spec("llama3").get_flavor(flavor)


@pytest.mark.parametrize("argv", [["--config", ""], ["--config="], ["--job.config_file", ""]])
def test_an_empty_config_value_is_refused_rather_than_training_the_default(argv):
    message = _error(argv, env={"CONFIG_FILE": "llama3_8b.toml"})
    assert f"{argv[0].split('=')[0]} needs a value" in message and "an empty value" in message
    assert "leave out" in message


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--profiling.enable_profiling", "--profiling.profile_freq", "2"], "'profiling.profile_freq' = 2"),
        (["--checkpoint.initial_load_path", "/x"], "acts only with checkpoint.enable = true"),
        (["--checkpoint.enable", "--checkpoint.exclude_from_loading", "modle"], "names ['modle']"),
        (["--checkpoint.enable", "--checkpoint.initial_load_in_hf"], "needs 'checkpoint.initial_load_path'"),
        (["--checkpoint.load_step", "-5"], "'checkpoint.load_step' = -5 is out of range: it must be >= -1"),
        (["--optimizer.beta2", "1.0"], "'optimizer.beta2' = 1.0 is out of range: it must be >= 0.0 and < 1"),
        (["--training.deterministic_warn_only"], "acts only with training.deterministic = true"),
        (["--checkpoint.load_only"], "'checkpoint.load_only' = true acts only with checkpoint.enable = true"),
        (["--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.last_save_in_hf"],
         "'checkpoint.last_save_in_hf' = true asks for a checkpoint to be written, but "
         "checkpoint.load_only = true saves none"),
        (["--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.async_mode", "async"],
         "'checkpoint.async_mode' = 'async' asks for a checkpoint to be written"),
        (["--job.custom_import", "my_project.models"],
         "'job.custom_import' = 'my_project.models' cannot be imported: no module named 'my_project'"),
        (["--job.custom_import", "my_project/models.py"], "is not a module name; give the dotted name"),
    ],
    ids=["profile-window", "load-path-disabled",
         "exclude-unknown", "hf-without-path", "load-step", "beta2", "warn-only-alone",
         "load-only-disabled", "load-only-hf-export", "load-only-async", "custom-import-missing",
         "custom-import-path"],
)  # fmt: skip
def test_mistakes_that_need_no_model_are_refused_when_the_config_is_parsed(argv, named):
    """So that the launchers' `config.check` stops them before torchrun starts the ranks."""
    assert named in _error(argv)


@pytest.mark.parametrize("argv", [["--checkpoint.initial_load_path", ""], ["--training.dataset_path="]])
def test_an_empty_value_for_an_optional_key_is_refused_not_read_as_unset(argv):
    message = _error(argv)
    assert "empty value" in message and "unset shell variable" in message and "'none'" in message


def test_a_config_file_named_by_config_file_says_so_when_missing():
    assert "'nope.toml' (from $CONFIG_FILE) does not exist" in _error([], env={"CONFIG_FILE": "nope.toml"})


@pytest.mark.parametrize(
    "content, named",
    [(b"[training]\nsteps = 3 # caf\xe9\n", "not UTF-8 text (byte 0xe9 on line 2)"),
     (b"\xef\xbb\xbf[training]\nsteps = 3\n", "byte-order mark")],
    ids=["latin-1", "bom"],
)  # fmt: skip
def test_a_config_file_that_is_not_plain_utf8_is_refused_naming_the_problem(tmp_path, content, named):
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    assert named in _error(["--config", str(path)])


def test_float8_and_its_upstream_section_set_to_different_values_are_refused(tmp_path):
    path = tmp_path / "f8.toml"
    path.write_text(
        '[model]\nconverters = ["float8"]\n[float8]\nrecipe_name = "rowwise"\n'
        '[quantize.linear.float8]\nrecipe_name = "tensorwise"\n'
    )
    assert "'float8.recipe_name' = 'rowwise' and 'quantize.linear.float8.recipe_name'" in _error(
        ["--config", str(path)]
    )


def test_unknown_key_on_command_line_suggests_the_closest():
    message = _error(["--training.stpes", "3"])
    assert "training.stpes" in message and "Did you mean 'steps'" in message


def test_unknown_key_in_file_names_file_and_closest(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optimizer]\nlearning_rate = 0.1\n")
    message = _error(["--config", str(bad)])
    assert str(bad) in message and "optimizer.learning_rate" in message and "'lr'" in message


def test_unknown_section_lists_valid_sections(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainning]\nsteps = 1\n")
    message = _error(["--config", str(bad)])
    assert "[trainning]" in message and "Did you mean 'training'" in message


def test_an_upstream_torchtitan_section_is_named_as_not_built(tmp_path):
    copied = tmp_path / "upstream.toml"
    copied.write_text('[experimental]\ncustom_model_path = "my.models"\n')
    message = _error(["--config", str(copied)])
    assert "[experimental]" in message and "experimental model modules" in message
    assert "remove the section" in message
    assert "Did you mean" not in message


UPSTREAM_QUANTIZE = """
[model]
converters = []

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
filter_fqns = ["output"]

[float8]
recipe_name = "rowwise"
"""


def test_upstream_float8_sections_without_the_converter_are_read_but_warned_about(tmp_path, caplog):
    copied = tmp_path / "upstream.toml"
    copied.write_text(UPSTREAM_QUANTIZE)
    cfg = parse_args(["--config", str(copied)], env={})
    assert cfg.model.converters == [] and cfg.float8.recipe_name == "rowwise"
    assert cfg.float8.filter_fqns == ["output"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "[float8] is set but has no effect" in warnings[0] and "model.converters" in warnings[0]


def test_the_upstream_quantize_linear_float8_section_and_flag_set_float8(tmp_path):
    copied = tmp_path / "upstream.toml"
    copied.write_text(
        '[model]\nconverters = ["quantize.linear.float8"]\n[quantize.linear.float8]\nemulate = true\n'
    )
    cfg = parse_args(
        ["--config", str(copied), "--quantize.linear.float8.recipe_name", "rowwise_with_gw_hp"], env={}
    )
    assert cfg.model.converters == ["quantize.linear.float8"]
    assert cfg.float8.emulate and cfg.float8.recipe_name == "rowwise_with_gw_hp"


def test_other_quantize_sections_are_still_ignored_with_a_warning(tmp_path, caplog):
    copied = tmp_path / "upstream.toml"
    copied.write_text("[quantize.linear.mx]\nrecipe_name = 'mxfp8'\n[mx]\nfilter_fqns = []\n")
    assert parse_args(["--config", str(copied)], env={}).float8 == JobConfig().float8
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [w.split(" in ")[0] for w in warnings] == ["Ignoring section [quantize]", "Ignoring section [mx]"]


@pytest.mark.parametrize(
    "converters, argv",
    [('["quantize.linear.mx"]', []), ("[]", ["--model.converters", "float8,mx"])],
    ids=["file", "command-line"],
)
def test_model_converters_that_are_not_built_are_refused(converters, argv, tmp_path):
    copied = tmp_path / "upstream.toml"
    copied.write_text(UPSTREAM_QUANTIZE.replace("converters = []", f"converters = {converters}"))
    message = _error(["--config", str(copied), *argv])
    assert "'model.converters' = " in message and "does not build" in message
    assert "the converter here is float8" in message


@pytest.mark.parametrize(
    "argv, named",
    [(["--float8.enable_fsdp_float8_all_gather", "--float8.recipe_name", "rowwise"],
      "needs recipe_name 'tensorwise'"),
     (["--float8.precompute_float8_dynamic_scale_for_fsdp"],
      "set float8.enable_fsdp_float8_all_gather = true")],
    ids=["all-gather with rowwise", "precompute without all-gather"],
)  # fmt: skip
def test_float8_options_that_cannot_work_together_are_refused(argv, named):
    assert named in _error(["--model.converters", "float8", *argv])


def test_wrong_type_names_key_value_and_expected_type(tmp_path):
    message = _error(["--training.steps", "ten"])
    assert "training.steps" in message and "'ten'" in message and "int" in message
    bad = tmp_path / "bad.toml"
    bad.write_text('[training]\nseq_len = "long"\n')
    assert "training.seq_len" in _error(["--config", str(bad)])


def test_choice_outside_its_literal_lists_the_choices():
    message = _error(["--lr_scheduler.decay_type", "exp"])
    assert "'linear', 'sqrt', 'cosine'" in message


def test_a_value_outside_the_choices_is_not_called_a_wrong_type():
    message = _error(["--activation_checkpoint.mode", "partial"])
    assert "'activation_checkpoint.mode' = 'partial'" in message
    assert "is not one of 'none', 'full', 'selective', 'memory_budget'" in message
    assert "wrong type" not in message


def test_a_section_without_a_key_on_the_command_line_asks_for_the_key():
    message = _error(["--job"])
    assert "--job needs a key: --job.KEY VALUE" in message and "dump_folder" in message
    assert "unknown section" not in message


def test_a_key_without_its_section_on_the_command_line_names_the_sections_that_have_it():
    assert "use --training.steps or --validation.steps" in _error(["--steps", "5"])


def test_a_top_level_key_in_a_file_must_be_inside_a_section(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = 10\n")
    message = _error(["--config", str(bad)])
    assert "'steps' = 10" in message and "must be inside a [section]" in message
    assert "[training]" in message and "unknown section" not in message


def test_out_of_range_value_states_the_bound():
    message = _error(["--optimizer.lr", "-1"])
    assert "optimizer.lr" in message and "> 0.0" in message
    assert ">= 0.0 and <= 1.0" in _error(["--activation_checkpoint.memory_budget", "1.5"])


@pytest.mark.parametrize(
    "key, value", [("optimizer.lr", "nan"), ("training.max_norm", "nan"), ("optimizer.eps", "inf")]
)
def test_non_finite_floats_are_refused_naming_key_and_value(key, value):
    message = _error([f"--{key}", value])
    assert f"'{key}' = {value}" in message and "not a finite number" in message


def test_non_finite_float_in_a_file_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[lr_scheduler]\ndecay_ratio = nan\n")
    assert "'lr_scheduler.decay_ratio' = nan is not a finite number" in _error(["--config", str(bad)])


def test_missing_config_file_lists_where_it_looked():
    message = _error(["--config", "nope.toml"])
    assert "nope.toml" in message and "train_configs" in message


def test_ambiguous_bare_name_lists_the_matches(tmp_path, monkeypatch):
    for model in ("a", "b"):
        folder = tmp_path / model / "train_configs"
        folder.mkdir(parents=True)
        (folder / "same.toml").write_text("")
    monkeypatch.setattr(
        "torchtitan.config.manager.find_config_dirs", lambda: sorted(tmp_path.glob("*/train_configs"))
    )
    monkeypatch.setattr("torchtitan.config.manager.PROJECT_ROOT", tmp_path)
    message = _error(["--config", "same.toml"])
    assert (
        "ambiguous" in message
        and "a/train_configs/same.toml" in message
        and "b/train_configs/same.toml" in message
    )


def test_a_list_of_lists_on_the_command_line_separates_the_lists_with_semicolons():
    cfg = parse_args(
        ["--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0;layers.1,norm,output"], env={}
    )
    assert cfg.parallelism.module_fqns_per_model_part == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "norm", "output"],
    ]


def test_validation_seq_len_beyond_training_seq_len_is_refused():
    message = _error(["--validation.enable", "--validation.seq_len", "512"])  # training.seq_len 256
    assert "'validation.seq_len' = 512" in message and "'training.seq_len' = 256" in message
    assert "Set validation.seq_len to at most 256" in message


def test_validation_on_a_hub_dataset_is_refused_before_the_ranks_start():
    message = _error(["--validation.enable", "--validation.dataset", "c4"])
    assert "'validation.dataset' = 'c4' would stream from the hub" in message
    assert "set 'validation.dataset_path'" in message


def test_validation_on_local_files_may_keep_any_dataset_name():
    argv = ["--validation.enable", "--validation.dataset", "c4", "--validation.dataset_path", "val.jsonl"]
    assert parse_args(argv, env={}).validation.dataset_path == "val.jsonl"


def test_disabled_validation_may_keep_a_seq_len_beyond_training():
    assert parse_args(["--validation.seq_len", "512"], env={}).validation.seq_len == 512


@pytest.mark.parametrize("steps", ["0", "-2"])
def test_validation_steps_other_than_positive_or_minus_one_are_refused(steps):
    message = _error(["--validation.steps", steps])
    assert f"'validation.steps' = {steps}" in message and "-1 for every whole global batch" in message


def test_shipped_bare_config_names_are_unique():
    names = [p.name for p in SHIPPED]
    assert len(names) == len(set(names))
    for name in names:
        assert resolve_config_path(name).name == name


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--model.name", "gpt9"], "Registered models: deepseek_v3, llama3, qwen3"),
        (["--model.flavor", "9B"], "Valid flavors: debugmodel, 1B, 3B, 8B, 70B, 405B"),
        (["--training.global_batch_size", "12"], "not a multiple"),
    ],
    ids=["unknown-model", "unknown-flavor", "indivisible-global-batch"],
)
def test_trainer_errors_exit_2_with_one_paragraph(argv, expected, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv + ["--job.dump_folder", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_a_ranks_config_error_reaches_torchruns_failure_summary(tmp_path, monkeypatch):
    """torchrun's summary reads each rank's error file; without it a rank hidden by LOG_RANK
    would fail with exit code 2 and no reason."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(SystemExit):
        main(["--model.flavor", "9B", "--job.dump_folder", str(tmp_path)])
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    assert failure.message.startswith("error: unknown flavor 'model.flavor' = '9B'"), failure.message


def test_a_misspelt_flavor_fails_before_the_run_writes_or_logs_its_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--model.flavor", "debugmdel", "--job.dump_folder", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Did you mean 'debugmodel'?" in err
    assert "Resolved config" not in err and not (tmp_path / "config.toml").exists()


def test_bad_input_from_the_shell_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan.train", "--training.stpes", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Did you mean 'steps'" in proc.stderr and "Traceback" not in proc.stderr


def test_help_exits_0_and_prints_options(capsys):
    main(["--help"])
    assert "--activation_checkpoint.mode" in capsys.readouterr().out


def test_config_reference_doc_is_generated_from_the_schema():
    gen = load_script("scripts/gen_config_reference.py")
    assert gen.OUT.read_text() == gen.render(), "run: python scripts/gen_config_reference.py"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_names_a_flavor_and_degrees_that_fit_the_gpus_its_header_names(path):
    """A production config says "on N GPUs" in its header; its parallel degrees must lay out on
    N ranks and its expert parallel degree divide the flavor's experts (debug configs: 1 rank)."""
    cfg = parse_args(["--config", str(path)], env={})
    flavor = get_train_spec(cfg.model.name).get_flavor(cfg.model.flavor)
    named = re.search(r"on (\d+)\+? GPUs", path.read_text())
    dims = ParallelDims.from_config(cfg.parallelism, int(named.group(1)) if named else 1)
    if dims.ep_enabled:
        assert flavor.moe_args.num_experts % dims.ep == 0


@pytest.mark.parametrize("seed", ["18446744073709551616", "-9223372036854775809"])
def test_a_seed_torch_cannot_take_is_refused_when_the_config_is_parsed(seed):
    assert _error(["--training.seed", seed]).startswith(f"'training.seed' = {seed} is out of range")


def test_a_list_option_takes_space_separated_items_as_upstream():
    argv = ["--compile.enable", "--compile.components", "model", "loss", "--training.steps", "3"]
    cfg = parse_args(argv, env={})
    assert cfg.compile.components == ["model", "loss"] and cfg.training.steps == 3


def test_a_second_word_after_a_single_value_option_names_that_option():
    with pytest.raises(ConfigError, match=r"'4' after --training.steps 3, which takes one value"):
        parse_args(["--training.steps", "3", "4"], env={})


@pytest.mark.parametrize(
    "argv, section, key",
    [(["--quantize.linear.float8.filter_fqns", "output", "router.gate"], "float8", "filter_fqns"),
     (["--float8.moe_fqns_prototype", "experts", "shared"], "float8", "moe_fqns")],
)  # fmt: skip
def test_upstream_spellings_of_list_options_take_space_separated_items_too(argv, section, key):
    assert getattr(getattr(parse_args(argv, env={}), section), key) == argv[1:]


@pytest.mark.parametrize("key", ["job.dump_folder", "checkpoint.folder", "metrics.save_tb_folder"])
def test_an_empty_folder_usually_an_unset_shell_variable_is_refused(key):
    message = _error([f"--{key}", ""])
    assert f"'{key}' is empty, often an unset shell variable" in message


def test_a_dump_folder_inside_a_file_is_refused_naming_the_file(tmp_path):
    (tmp_path / "afile").touch()
    message = _error(["--job.dump_folder", str(tmp_path / "afile" / "out")])
    assert f"'job.dump_folder' = '{tmp_path / 'afile' / 'out'}' cannot be used" in message
    assert f"{tmp_path / 'afile'} is not a folder" in message


def test_numbers_in_a_list_of_names_are_refused_not_read_as_names(tmp_path):
    path = tmp_path / "numbers.toml"
    path.write_text("[compile]\ncomponents = [1, 2]\n")
    message = _error(["--config", str(path)])
    assert "'compile.components' = [1, 2]" in message and "expected a list of str" in message


def test_a_key_set_twice_in_a_toml_file_is_named_with_both_lines(tmp_path):
    """tomllib says only "Cannot overwrite a value (at line 4, column 10)"."""
    config = tmp_path / "twice.toml"
    config.write_text("[training]\nsteps = 3\nseq_len = 64\nsteps = 5\n")
    with pytest.raises(ConfigError, match=r"sets 'training.steps' twice \(lines 2 and 4\); keep one of them"):
        parse_args(["--config", str(config)], env={})


def test_two_config_files_on_the_command_line_are_refused_naming_both():
    with pytest.raises(
        ConfigError, match=r"two config files are given: 'debug_model.toml' and --job.config_file 'x.toml'"
    ):
        parse_args(["--config", "debug_model.toml", "--job.config_file", "x.toml"], env={})


def test_an_empty_config_file_warns_that_every_default_is_taken(tmp_path, caplog):
    config = tmp_path / "empty.toml"
    config.write_text("")
    parse_args(["--config", str(config)], env={})
    assert f"config file {config} is empty: the run takes every default" in caplog.text


def test_more_loss_chunks_than_the_tokens_of_a_forward_are_refused():
    message = _error(["--training.local_batch_size", "2", "--training.loss_chunks", "1024"])  # seq_len 256
    assert "'training.loss_chunks' = 1024 exceeds the 512 tokens of one forward" in message
    assert "set training.loss_chunks to at most 512" in message


def test_loss_chunks_under_pipeline_parallelism_count_a_microbatchs_tokens():
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--training.loss_chunks", "512"]
    message = _error(pp)  # microbatches of 1 sequence of 256 tokens
    assert "exceeds the 256 tokens of a pipeline microbatch (1 sequence(s) x seq_len 256)" in message
