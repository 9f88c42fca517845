"""Loader worker processes (`training.dataloader_num_workers`) for hub-streamed data.

A folder of jsonl files named as `training.dataset` takes the streaming path that a hub dataset
does, each file one shard, with no network.
"""

import gc
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import PROJECT_ROOT, python_path
from torchtitan.components.dataloader import build_text_dataloader, unwrap_worker_error
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import parse_args
from torchtitan.config.errors import ConfigError

SEQ_LEN, BATCH = 16, 2


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer("torchtitan/assets/tokenizer")


@pytest.fixture(autouse=True)
def _shut_down_loader_workers():
    """Collect each test's loaders, so that their worker processes exit now: one left to a
    later collection may be collected in the next test's forked workers, which then stall."""
    yield
    gc.collect()


def _stream(tmp_path, shards: int, bad_record: bool = False) -> str:
    """A folder of `shards` jsonl files of documents of uneven lengths, so passes end mid-batch
    and each worker's pass ends at another batch."""
    folder = tmp_path / "stream"
    folder.mkdir()
    for s in range(shards):
        docs = [f"shard {s} document {i} " * (3 + i) for i in range(3 + s)]
        records = [{"text": d} for d in docs] + ([{"text": None}] if bad_record else [])
        (folder / f"part{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(folder)


def _loader(tokenizer, dataset: str, *argv: str, dp_rank: int = 0, dp_degree: int = 1):
    cfg = parse_args(["--training.dataset", dataset, "--training.seq_len", str(SEQ_LEN),
                      "--training.local_batch_size", str(BATCH), *argv], env={})  # fmt: skip
    return build_text_dataloader(cfg, tokenizer, dp_rank, dp_degree)


def _first_words(tokenizer, batch) -> str:
    return tokenizer.decode(batch[0][0].tolist()).removeprefix("<|begin_of_text|>").split(" document")[0]


def test_loader_workers_resume_a_hub_stream_exactly_at_any_batch(tmp_path, tokenizer):
    """Also across the end of a worker's pass (about 12 batches each here), where each worker
    starts its next pass on its own."""
    stream = _stream(tmp_path, shards=4)
    workers = ("--training.dataloader_num_workers", "2")
    straight = iter(_loader(tokenizer, stream, *workers))
    want = [next(straight)[0] for _ in range(36)]
    for stop in (1, 9, 17, 25):
        saving = _loader(tokenizer, stream, *workers)
        batches = iter(saving)
        for _ in range(stop):
            next(batches)
        state = saving.state_dict()
        del batches
        resuming = _loader(tokenizer, stream, *workers)
        resuming.load_state_dict(state)
        resumed = iter(resuming)
        got = [next(resumed)[0] for _ in range(len(want) - stop)]
        assert all(torch.equal(a, b) for a, b in zip(got, want[stop:], strict=True)), f"resumed after {stop}"


def test_each_loader_worker_streams_shards_of_its_own(tmp_path, tokenizer):
    loader = _loader(tokenizer, _stream(tmp_path, shards=2), "--training.dataloader_num_workers", "2")
    batches = iter(loader)
    assert loader.num_workers == 2
    assert [_first_words(tokenizer, next(batches)) for _ in range(2)] == ["shard 0", "shard 1"]


def test_a_worker_count_above_a_ranks_shards_is_refused_naming_the_limit(tmp_path, tokenizer):
    stream = _stream(tmp_path, shards=4)
    with pytest.raises(ConfigError, match=r"'training.dataloader_num_workers' = 3.*set it to at most 2"):
        _loader(tokenizer, stream, "--training.dataloader_num_workers", "3", dp_rank=1, dp_degree=2)


def test_local_data_loads_in_the_training_process_whatever_the_worker_count(tokenizer, caplog):
    with caplog.at_level(logging.INFO):
        loader = _loader(tokenizer, "smoke", "--training.dataloader_num_workers", "2")
    assert loader.num_workers == 0
    assert "'training.dataloader_num_workers' = 2 applies to hub-streamed datasets" in caplog.text


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pins on an accelerator")
def test_pinned_memory_without_an_accelerator_is_left_off_and_said_so(tokenizer, caplog):
    with caplog.at_level(logging.INFO):
        loader = _loader(tokenizer, "smoke", "--training.dataloader_pin_memory")
    assert loader.pin_memory is False
    assert "'training.dataloader_pin_memory' has no effect without an accelerator" in caplog.text


def test_a_bad_record_a_worker_reads_is_reported_with_its_own_message(tmp_path, tokenizer):
    stream = _stream(tmp_path, shards=1, bad_record=True)
    batches = iter(_loader(tokenizer, stream, "--training.dataloader_num_workers", "1"))
    with pytest.raises(ConfigError) as raised:
        while True:
            next(batches)
    assert "Traceback" in str(raised.value)  # as the DataLoader re-raises it

    message = str(unwrap_worker_error(raised.value))

    assert message.startswith(f"'training.dataset' = '{stream}': a record has 'text' = None")
    assert "Traceback" not in message and "\n" not in message


def test_an_error_raised_in_the_training_process_is_left_as_it_is():
    error = ConfigError("'training.dataset' = 'x': a record has 'text' = None")
    assert unwrap_worker_error(error) is error


def test_a_process_whose_loader_has_workers_exits_without_waiting_on_them(tmp_path):
    """Left to interpreter exit, the workers would get multiprocessing's SIGTERM, which they
    ignore once (for the trainer's stop checkpoint), and the exit would wait on them forever."""
    script = (
        "import sys\n"
        "from torchtitan.components.tokenizer import HuggingFaceTokenizer\n"
        "from tests.unit.test_dataloader_workers import _loader\n"
        "loader = _loader(HuggingFaceTokenizer('torchtitan/assets/tokenizer'), sys.argv[1],\n"
        "                 '--training.dataloader_num_workers', '2')\n"
        "batches = iter(loader)\n"
        "next(batches)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, _stream(tmp_path, shards=2)], cwd=PROJECT_ROOT,
                          env={**os.environ, "PYTHONPATH": python_path()}, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
