"""job.custom_import: a module of one's own, imported before the model is looked up."""

import json

import pytest

from torchtitan.config import ConfigError
from torchtitan.protocols.train_spec import import_custom_module
from torchtitan.train import main


def test_a_model_registered_by_the_imported_module_trains(custom_model_module, tmp_path, capsys):
    main(["--job.custom_import", custom_model_module, "--model.name", "my_llama", "--model.flavor", "tiny",
          "--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
          "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path)])  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert "Model my_llama tiny" in capsys.readouterr().err


def test_a_run_whose_module_cannot_be_found_exits_2_before_building_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--job.custom_import", "my_project.models", "--job.dump_folder", str(tmp_path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "error: 'job.custom_import' = 'my_project.models' cannot be imported" in err
    assert not (tmp_path / "config.toml").exists()


@pytest.mark.parametrize(
    "name, missing",
    [("no_such_package.models", "no_such_package"),
     ("tests.unit.no_such_module", "tests.unit.no_such_module")],
)  # fmt: skip
def test_a_module_that_cannot_be_found_is_refused_naming_the_key_and_the_fix(name, missing):
    with pytest.raises(ConfigError) as info:
        import_custom_module(name)
    message = str(info.value)
    assert f"'job.custom_import' = '{name}' cannot be imported: no module named '{missing}'" in message
    assert "PYTHONPATH" in message


def test_a_missing_import_inside_the_module_is_its_own_bug_and_keeps_its_traceback(tmp_path, monkeypatch):
    (tmp_path / "broken_models.py").write_text("import not_installed_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="not_installed_dependency"):
        import_custom_module("broken_models")
