"""Which data the validation loader reads, and what it says when that is the bundled corpus."""

import pytest

from torchtitan.components.dataloader import build_validation_dataloader
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config.manager import parse_args

VALIDATION = ["--validation.enable", "--validation.seq_len", "64", "--validation.local_batch_size", "2"]


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer("torchtitan/assets/tokenizer")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize(
    "training, named",
    [
        (["--training.dataset", "c4"], "'c4'"),
        (["--training.dataset_path", "/data/corpus"], "'training.dataset_path' = '/data/corpus'"),
    ],
    ids=["hub", "local"],
)
def test_default_validation_set_with_other_training_data_is_warned_about(training, named, tokenizer, caplog):
    build_validation_dataloader(parse_args([*VALIDATION, *training], env={}), tokenizer, 0, 1)
    (warning,) = _warnings(caplog)
    assert "bundled smoke corpus" in warning and named in warning
    assert "validation.dataset" in warning and "validation.dataset_path" in warning


def test_bundled_training_corpus_validates_on_its_split_without_a_warning(tokenizer, caplog):
    build_validation_dataloader(parse_args(VALIDATION, env={}), tokenizer, 0, 1)
    assert _warnings(caplog) == []


@pytest.mark.parametrize("dp_degree", [1, 4])
def test_validation_logs_how_many_windows_its_whole_global_batches_leave_out(dp_degree, tokenizer, caplog):
    caplog.set_level("INFO")
    cfg = parse_args([*VALIDATION, "--validation.steps", "-1"], env={})
    loader = build_validation_dataloader(cfg, tokenizer, 0, dp_degree)
    windows = loader.dataset.num_windows
    used = windows // (2 * dp_degree) * (2 * dp_degree)
    assert used < windows, "the split must not divide evenly for this test"
    assert sum(len(inputs) for inputs, _ in loader) * dp_degree == used
    assert f"Each validation pass reads {used} of the split's {windows} windows" in caplog.text


def test_validation_with_a_step_count_logs_the_windows_those_steps_read(tokenizer, caplog):
    caplog.set_level("INFO")
    cfg = parse_args([*VALIDATION, "--validation.steps", "3"], env={})
    windows = build_validation_dataloader(cfg, tokenizer, 0, 4).dataset.num_windows
    assert f"Each validation pass reads 24 of the split's {windows} windows" in caplog.text
    assert "'validation.steps' = 3 batches of 2 x 4 ranks" in caplog.text


def test_validating_on_the_training_files_is_warned_about(tokenizer, caplog, tmp_path):
    from tests.unit.test_data import _write_corpus

    _write_corpus(tmp_path / "data", "jsonl", ["one two three four five six seven eight"] * 40)
    same = [
        "--training.dataset_path",
        str(tmp_path / "data"),
        "--validation.dataset_path",
        str(tmp_path / "data"),
    ]
    build_validation_dataloader(parse_args([*VALIDATION, *same], env={}), tokenizer, 0, 1)
    (warning,) = _warnings(caplog)
    assert "'validation.dataset_path'" in warning and "is the training data" in warning
