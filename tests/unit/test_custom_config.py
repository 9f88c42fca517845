"""job.custom_config_module: a module's JobConfig dataclass adds keys of one's own to the schema."""

import sys
import textwrap
from dataclasses import replace

import pytest
import torch

from torchtitan.config import ConfigError, JobConfig, parse_args
from torchtitan.config.check import main as check_main
from torchtitan.config.manager import _is_own_key
from torchtitan.config.toml_writer import to_toml
from torchtitan.models import get_train_spec
from torchtitan.protocols import train_spec
from torchtitan.train import main

EXTENSION = "tests.unit.custom_config_extension"


def _load(tmp_path, text: str, *argv: str) -> JobConfig:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return parse_args(["--config", str(path), *argv], env={})


def _error(tmp_path, text: str, *argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text, *argv)
    return str(info.value)


@pytest.fixture
def module_of_one_s_own(tmp_path, monkeypatch):
    """Write module `name` with `source` into a folder on sys.path; forgotten afterwards."""
    folder = tmp_path / "modules"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    written = []

    def write(name: str, source: str) -> str:
        (folder / f"{name}.py").write_text(
            "from dataclasses import dataclass, field\n" + textwrap.dedent(source)
        )
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


def test_a_toml_file_that_names_the_module_sets_its_sections_and_the_extended_ones(tmp_path):
    cfg = _load(
        tmp_path,
        f'[job]\ncustom_config_module = "{EXTENSION}"\n[training]\ncurriculum = "short_first"\nseq_len = 64\n'
        "[probe]\nenable = true\nlayers = [1, 3]\ntemperature = 0.5\n",
    )
    assert isinstance(cfg, JobConfig)
    assert (cfg.probe.enable, cfg.probe.layers, cfg.probe.temperature, cfg.probe.note) == (
        True,
        [1, 3],
        0.5,
        None,
    )
    assert (cfg.training.curriculum, cfg.training.seq_len) == ("short_first", 64)
    assert (
        cfg.model.name == "llama3" and cfg.training.local_batch_size == JobConfig().training.local_batch_size
    )


def test_the_command_line_names_the_module_and_sets_its_keys(tmp_path):
    cfg = _load(tmp_path, "", "--job.custom_config_module", EXTENSION, "--probe.layers", "2", "5",
                "--probe.enable", "--training.curriculum", "short_first")  # fmt: skip
    assert (cfg.probe.layers, cfg.probe.enable, cfg.training.curriculum) == ([2, 5], True, "short_first")
    assert cfg.job.custom_config_module == EXTENSION


def test_the_command_line_overrides_the_files_value_of_a_key_of_ones_own(tmp_path):
    toml = f'[job]\ncustom_config_module = "{EXTENSION}"\n[probe]\nenable = true\ntemperature = 2.0\n'
    cfg = _load(tmp_path, toml, "--probe.no_enable", "--probe.temperature", "0.25")
    assert (cfg.probe.enable, cfg.probe.temperature) == (False, 0.25)


def test_a_key_the_module_redeclares_takes_its_new_default_and_keeps_the_trainers_bounds(tmp_path):
    toml = f'[job]\ncustom_config_module = "{EXTENSION}"\n'
    assert _load(tmp_path, toml).training.steps == 7
    assert "'training.steps' = 0 is out of range: it must be >= 1" in _error(
        tmp_path, toml, "--training.steps", "0"
    )


def test_the_bounds_a_key_of_ones_own_declares_are_checked(tmp_path):
    message = _error(tmp_path, f'[job]\ncustom_config_module = "{EXTENSION}"\n[probe]\ntemperature = 0.0\n')
    assert message == "'probe.temperature' = 0.0 is out of range: it must be > 0."


def test_a_key_of_ones_own_with_a_value_of_the_wrong_type_is_refused_naming_it(tmp_path):
    message = _error(tmp_path, f'[job]\ncustom_config_module = "{EXTENSION}"\n[probe]\nlayers = "all"\n')
    assert "'probe.layers' = 'all'" in message and "a list of int" in message


def test_a_stray_word_after_a_single_valued_key_of_ones_own_is_named(tmp_path):
    message = _error(tmp_path, "", "--job.custom_config_module", EXTENSION, "--probe.temperature", "2", "3")
    assert message.startswith("unexpected argument '3' after --probe.temperature 2, which takes one value")


def test_a_misspelt_key_of_ones_own_gets_a_did_you_mean(tmp_path):
    message = _error(tmp_path, "", "--job.custom_config_module", EXTENSION, "--probe.temprature", "2")
    assert "unknown key 'probe.temprature'" in message and "Did you mean 'temperature'?" in message


def test_without_the_module_its_section_is_an_unknown_section(tmp_path):
    assert "unknown section [probe]" in _error(tmp_path, "[probe]\nenable = true\n")


def test_parsing_with_the_module_leaves_the_trainers_own_schema_as_it_was(tmp_path):
    _load(tmp_path, "", "--job.custom_config_module", EXTENSION)
    assert not _is_own_key("probe", "enable")
    assert not hasattr(parse_args([], env={}), "probe")
    assert "unknown section [probe]" in _error(tmp_path, "", "--probe.enable")


def test_upstreams_experimental_custom_args_module_names_the_module_with_a_warning(tmp_path, caplog):
    cfg = _load(tmp_path, f'[experimental]\ncustom_args_module = "{EXTENSION}"\n[probe]\nenable = true\n')
    assert cfg.probe.enable and cfg.job.custom_config_module == EXTENSION
    assert "Reading 'experimental.custom_args_module'" in caplog.text


def test_a_job_config_that_subclasses_the_trainers_extends_it_the_same_way(
    tmp_path, module_of_one_s_own, caplog
):
    name = module_of_one_s_own(
        "subclassing_extension",
        """
        import torchtitan.config.job_config as own
        from torchtitan.config import opt

        @dataclass
        class Training(own.Training):
            warm_start: bool = opt(False, "start from a warm model")

        @dataclass
        class JobConfig(own.JobConfig):
            training: Training = field(default_factory=Training)
        """,
    )
    cfg = _load(tmp_path, "", "--job.custom_config_module", name, "--training.warm_start")
    assert cfg.training.warm_start and cfg.training.steps == JobConfig().training.steps
    assert "[float8] is set" not in caplog.text


def test_the_resolved_config_written_as_toml_reads_back_equal(tmp_path):
    cfg = _load(
        tmp_path, "", "--job.custom_config_module", EXTENSION, "--probe.layers", "4", "--probe.note", "x"
    )
    (tmp_path / "resolved.toml").write_text(to_toml(cfg))
    back = parse_args(["--config", str(tmp_path / "resolved.toml")], env={})
    back.job.config_file = cfg.job.config_file
    assert back == cfg


def test_a_module_that_cannot_be_found_is_refused_naming_the_key(tmp_path):
    message = _error(tmp_path, '[job]\ncustom_config_module = "my_project.config"\n')
    assert message.startswith(
        "'job.custom_config_module' = 'my_project.config' cannot be imported: no module "
    )
    assert "PYTHONPATH" in message


def test_the_pre_torchrun_check_exits_2_without_a_traceback_for_a_module_not_found(capsys):
    assert check_main(["--errors-only", "--job.custom_config_module", "my_project.config"]) == 2
    err = capsys.readouterr().err
    assert "error: --job.custom_config_module my_project.config cannot be imported" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "source, expected",
    [
        ("X = 1\n", "'job.custom_config_module' = '{name}' defines no JobConfig dataclass"),
        ("@dataclass\nclass JobConfig:\n    steps: int = 3\n",
         "{name}.JobConfig.steps is int, but every field of JobConfig is a [section]"),
        ("@dataclass\nclass Training:\n    steps: str = '3'\n"
         "@dataclass\nclass JobConfig:\n    training: Training = field(default_factory=Training)\n",
         "'training.steps' in {name} is declared str, but it is this trainer's key of type int"),
        ("@dataclass\nclass Probe:\n    layers: int\n"
         "@dataclass\nclass JobConfig:\n    probe: Probe = field(default_factory=Probe)\n",
         "'probe.layers' in {name} has no default"),
        ("@dataclass\nclass Probe:\n    weights: dict = field(default_factory=dict)\n"
         "@dataclass\nclass JobConfig:\n    probe: Probe = field(default_factory=Probe)\n",
         "'probe.weights' in {name} is declared dict, which a TOML file cannot give"),
    ],
    ids=["no_job_config", "key_outside_a_section", "key_of_another_type", "key_without_default", "dict_key"],
)  # fmt: skip
def test_a_module_whose_job_config_cannot_extend_the_schema_is_refused_saying_why(
    tmp_path, module_of_one_s_own, source, expected
):
    name = module_of_one_s_own(f"extension_{abs(hash(source))}", source)
    assert expected.format(name=name) in _error(tmp_path, f'[job]\ncustom_config_module = "{name}"\n')


def test_help_lists_the_keys_of_the_module_its_config_file_names(tmp_path, capsys):
    (tmp_path / "run.toml").write_text(f'[job]\ncustom_config_module = "{EXTENSION}"\n')
    main(["--config", str(tmp_path / "run.toml"), "--help"])
    assert "--probe.layers (a list of int, default [0])" in capsys.readouterr().out


def test_help_lists_the_modules_keys(capsys):
    main(["--help", "--job.custom_config_module", EXTENSION])
    out = capsys.readouterr().out
    assert "--probe.temperature (float, default 1.0)\n      probe softmax temperature" in out
    assert "--training.curriculum (one of 'none', 'short_first', default 'none')" in out
    assert "--training.steps (int, default 7)" in out


def test_a_run_with_keys_of_its_own_trains_and_writes_them_to_its_resolved_config(tmp_path):
    main(["--job.custom_config_module", EXTENSION, "--probe.layers", "1", "--training.steps", "2",
          "--training.seq_len", "64", "--training.local_batch_size", "2",
          "--job.dump_folder", str(tmp_path)])  # fmt: skip
    resolved = parse_args(["--config", str(tmp_path / "config.toml")], env={})
    assert (resolved.probe.layers, resolved.training.steps) == ([1], 2)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2


MODEL_WITH_A_KEY_OF_ITS_OWN = """
from dataclasses import replace

from torchtitan.config import opt
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models import get_train_spec
from torchtitan.protocols import register_train_spec


@dataclass
class Depth:
    n_layers: int = opt(2, "transformer blocks", min=1)


@dataclass
class JobConfig:
    depth: Depth = field(default_factory=Depth)


@dataclass
class DepthArgs(TransformerModelArgs):
    def update_from_config(self, job_config):
        return replace(super().update_from_config(job_config), n_layers=job_config.depth.n_layers)


llama3 = get_train_spec("llama3")
tiny = DepthArgs(**vars(llama3.flavors["debugmodel"]))
register_train_spec(replace(llama3, name="deep_llama", flavors={"tiny": tiny}))
"""


def test_a_model_of_ones_own_reads_its_own_key_through_both_module_keys(
    tmp_path, module_of_one_s_own, caplog
):
    name = module_of_one_s_own("deep_llama_module", MODEL_WITH_A_KEY_OF_ITS_OWN)
    try:
        main(["--job.custom_import", name, "--job.custom_config_module", name, "--model.name", "deep_llama",
              "--model.flavor", "tiny", "--depth.n_layers", "1", "--training.steps", "1",
              "--training.seq_len", "64", "--training.local_batch_size", "2",
              "--job.dump_folder", str(tmp_path)])  # fmt: skip
    finally:
        train_spec._REGISTRY.pop("deep_llama", None)
    llama3 = get_train_spec("llama3")
    with torch.device("meta"):
        one_layer = llama3.model_cls(replace(llama3.flavors["debugmodel"], n_layers=1))
    parameters = sum(p.numel() for p in one_layer.parameters())
    assert f"Model deep_llama tiny: {parameters:,} parameters" in caplog.text
