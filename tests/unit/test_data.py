"""Data: tokenizer, token cache, packing, rank slicing, resumable state, local formats."""

import errno
import gzip
import itertools
import json
import multiprocessing
import os
import re
import stat
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config.errors import ConfigError
from torchtitan.datasets import token_cache
from torchtitan.datasets.text_datasets import (
    PackedTokenDataset,
    build_text_dataset,
    local_files,
    read_local_documents,
)

BUNDLED_TOKENIZER = "torchtitan/assets/tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer(BUNDLED_TOKENIZER)


def test_bundled_tokenizer_adds_bos_and_eos_and_round_trips(tokenizer):
    ids = tokenizer.encode("seven plus two is nine.")
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids[1:-1]) == "seven plus two is nine."
    assert tokenizer.vocab_size == 2048


def test_special_token_text_inside_a_document_is_encoded_as_text(tokenizer):
    ids = tokenizer.encode("a <|end_of_text|> b <|begin_of_text|> c")
    assert ids.count(tokenizer.eos_id) == ids.count(tokenizer.bos_id) == 1  # only the wrapping pair
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids[1:-1]) == "a <|end_of_text|> b <|begin_of_text|> c"


def test_missing_tokenizer_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="model.hf_assets_path"):
        HuggingFaceTokenizer(str(tmp_path))


@pytest.mark.parametrize(
    "name, content",
    [("tokenizer.json", '{"version": "1.0", "model": {'),  # truncated download
     ("tokenizer.json", "version https://git-lfs.github.com/spec/v1\noid sha256:0\n"),  # lfs pointer
     ("tokenizer_config.json", '{"eos_token": "<|end_of_text|>",}')],  # trailing comma
    ids=["truncated", "git-lfs pointer", "malformed config"],
)  # fmt: skip
def test_an_unparsable_tokenizer_file_is_a_config_error_naming_it(tmp_path, name, content):
    for bundled in Path(BUNDLED_TOKENIZER).iterdir():
        (tmp_path / bundled.name).write_bytes(bundled.read_bytes())
    (tmp_path / name).write_text(content)
    with pytest.raises(
        ConfigError, match=rf"{re.escape(str(tmp_path / name))} \(in 'model.hf_assets_path'\)"
    ):
        HuggingFaceTokenizer(str(tmp_path))


def _word_tokenizer(folder, config: dict | None) -> HuggingFaceTokenizer:
    """A two-word tokenizer whose special tokens include every BOS/EOS candidate kind,
    with `config` as its tokenizer_config.json (none when None)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return HuggingFaceTokenizer(str(folder))


def _name(tokenizer, token_id):
    return None if token_id is None else tokenizer.decode([token_id])


def test_null_bos_token_in_tokenizer_config_means_no_bos(tmp_path):
    tok = _word_tokenizer(tmp_path, {"bos_token": None, "eos_token": "<|im_end|>"})
    assert tok.bos_id is None
    assert tok.encode("hello world") == [1, 2, tok.eos_id]


def test_add_bos_token_false_means_no_bos_even_when_a_bos_token_is_named(tmp_path):
    tok = _word_tokenizer(tmp_path, {"add_bos_token": False, "bos_token": "<s>", "eos_token": "</s>"})
    assert tok.bos_id is None


def test_a_tokenizer_without_eos_is_warned_about_naming_the_config_file(tmp_path, caplog):
    tok = _word_tokenizer(tmp_path, {"bos_token": "<s>", "eos_token": None})
    assert tok.eos_id is None
    assert "has no EOS token" in caplog.text and "tokenizer_config.json" in caplog.text


def test_a_tokenizer_with_eos_gives_no_eos_warning(tmp_path, caplog):
    _word_tokenizer(tmp_path, {"bos_token": "<s>", "eos_token": "</s>"})
    assert "EOS" not in caplog.text


def test_tokens_named_in_tokenizer_config_win_over_candidate_names(tmp_path):
    tok = _word_tokenizer(tmp_path, {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"})
    assert (_name(tok, tok.bos_id), _name(tok, tok.eos_id)) == ("<|im_start|>", "<|im_end|>")


def test_candidate_names_are_used_only_for_keys_tokenizer_config_lacks(tmp_path):
    tok = _word_tokenizer(tmp_path, {"eos_token": "<|im_end|>"})
    assert (_name(tok, tok.bos_id), _name(tok, tok.eos_id)) == ("<s>", "<|im_end|>")


def test_candidate_names_are_used_without_tokenizer_config(tmp_path):
    tok = _word_tokenizer(tmp_path, None)
    assert (_name(tok, tok.bos_id), _name(tok, tok.eos_id)) == ("<s>", "</s>")


def test_a_special_token_the_vocab_lacks_is_added_after_it_as_transformers_does(tmp_path, caplog):
    with caplog.at_level("INFO"):
        tok = _word_tokenizer(tmp_path, {"bos_token": "<s>", "eos_token": "<|eot_id|>"})
    assert tok.vocab_size == 9 and tok.eos_id == 8  # 3 words and 5 special tokens before it
    assert _name(tok, tok.eos_id) == "<|eot_id|>"
    assert tok.encode("hello world") == [3, 1, 2, 8]
    assert "Added 1 tokens" in caplog.text and "<|eot_id|>" in caplog.text


def test_added_tokens_change_the_fingerprint_that_keys_token_caches(tmp_path):
    plain = _word_tokenizer(tmp_path / "a", {"bos_token": "<s>", "eos_token": "</s>"})
    added = _word_tokenizer(tmp_path / "b", {"bos_token": "<s>", "eos_token": "<|eot_id|>"})
    assert plain.fingerprint != added.fingerprint


# Declared in every way tokenizer_config.json can declare a token; some are in the vocabulary.
DECLARED = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": {"content": "<|my_eos|>", "__type": "AddedToken"},
    "unk_token": "<|my_unk|>",
    "pad_token": "<|my_pad|>",
    "mask_token": "<|my_mask|>",
    "additional_special_tokens": ["<|extra_a|>", "<|begin_of_text|>"],
    "extra_special_tokens": ["<|extra_b|>"],
    "added_tokens_decoder": {
        "5000": {"content": "<|decoder_entry|>", "special": True, "lstrip": False, "rstrip": False,
                 "normalized": False, "single_word": False},
    },
}  # fmt: skip


def test_tokens_the_vocab_lacks_get_the_ids_transformers_autotokenizer_gives(tmp_path):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    vocab = HuggingFaceTokenizer(BUNDLED_TOKENIZER)._tok
    vocab.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(DECLARED))
    ours = HuggingFaceTokenizer(str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    names = ["<|begin_of_text|>", "<|my_eos|>", "<|my_unk|>", "<|my_pad|>", "<|my_mask|>", "<|extra_b|>",
             "<|decoder_entry|>", "<|end_of_text|>"]  # fmt: skip
    assert {n: ours._tok.token_to_id(n) for n in names} == {n: theirs.convert_tokens_to_ids(n) for n in names}
    assert ours.vocab_size == len(theirs) > vocab.get_vocab_size(with_added_tokens=True)
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    # transformers 5 reads the older "additional_special_tokens" only without "extra_special_tokens".
    assert ours._tok.token_to_id("<|extra_a|>") is None
    assert (
        ours.encode("hello world", bos=False, eos=False)
        == theirs("hello world", add_special_tokens=False)["input_ids"]
    )


def _take(dataset, n):
    it = iter(dataset)
    return [next(it) for _ in range(n)]


def test_windows_are_consecutive_with_labels_shifted_by_one():
    tokens = np.arange(101, dtype=np.uint32)
    (x0, y0), (x1, _) = _take(PackedTokenDataset(tokens, 10, 0, 1, 2), 2)
    assert x0.tolist() == list(range(10)) and y0.tolist() == list(range(1, 11))
    assert x1[0].item() == 10


def test_ranks_split_each_global_batch_so_dp_degree_does_not_change_the_tokens():
    tokens = np.arange(1001, dtype=np.uint32)
    single = [x for x, _ in _take(PackedTokenDataset(tokens, 10, 0, 1, 4), 8)]
    rank0 = [x for x, _ in _take(PackedTokenDataset(tokens, 10, 0, 2, 2), 4)]
    rank1 = [x for x, _ in _take(PackedTokenDataset(tokens, 10, 1, 2, 2), 4)]
    for step in range(2):
        global_batch = single[4 * step : 4 * step + 4]
        dp_batch = rank0[2 * step : 2 * step + 2] + rank1[2 * step : 2 * step + 2]
        assert all(torch.equal(a, b) for a, b in zip(global_batch, dp_batch))


def test_training_loops_over_epochs():
    tokens = np.arange(41, dtype=np.uint32)  # four windows of 10
    xs = [x for x, _ in _take(PackedTokenDataset(tokens, 10, 0, 1, 2), 6)]
    assert torch.equal(xs[4], xs[0]) and torch.equal(xs[5], xs[1])


def test_state_dict_resumes_at_the_next_unseen_sample():
    tokens = np.arange(1001, dtype=np.uint32)
    first = PackedTokenDataset(tokens, 10, 1, 2, 2)
    seen = _take(first, 3)
    resumed = PackedTokenDataset(tokens, 10, 1, 2, 2)
    resumed.load_state_dict(first.state_dict())
    reference = _take(PackedTokenDataset(tokens, 10, 1, 2, 2), 5)
    assert len(seen) == 3
    assert all(torch.equal(a[0], b[0]) for a, b in zip(_take(resumed, 2), reference[3:]))


def test_validation_pass_is_finite_and_uses_whole_global_batches():
    tokens = np.arange(71, dtype=np.uint32)  # seven windows; global batch 2 x 2 -> one batch
    samples = list(PackedTokenDataset(tokens, 10, 0, 2, 2, infinite=False))
    assert len(samples) == 2


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(ConfigError, match="too few .* smaller training.seq_len / training.local_batch_size"):
        PackedTokenDataset(np.arange(15, dtype=np.uint32), 10, 0, 2, 2)


def test_too_small_validation_dataset_names_the_validation_keys(tmp_path, tokenizer):
    (tmp_path / "v.jsonl").write_text(json.dumps({"text": "one two"}) + "\n")
    with pytest.raises(ConfigError) as info:
        build_text_dataset(
            "unused", str(tmp_path / "v.jsonl"), tokenizer, 64, 0, 1, 2, False, key="validation.dataset"
        )
    assert "smaller validation.seq_len / validation.local_batch_size" in str(info.value)
    assert "training." not in str(info.value)


def _write_corpus(folder, kind: str, docs: list[str]):
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        (folder / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    elif kind == "txt":  # a .txt file is one document
        for i, d in enumerate(docs):
            (folder / f"doc{i}.txt").write_text(d)
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs}), folder / "a.parquet")


@pytest.mark.parametrize("kind", ["jsonl", "txt", "parquet"])
def test_local_files_are_tokenized_with_bos_and_eos_per_document(kind, tmp_path, tokenizer):
    docs = ["one two three", "four five six"]
    _write_corpus(tmp_path / "data", kind, docs)
    ds = build_text_dataset("unused", str(tmp_path / "data"), tokenizer, 4, 0, 1, 1, infinite=True)
    expected = [t for d in docs for t in tokenizer.encode(d)]
    assert np.asarray(ds.tokens).tolist() == expected


def test_a_txt_file_is_one_document_line_breaks_and_blank_lines_included(tmp_path, tokenizer):
    article = "First paragraph,\nwrapped.\n\nSecond paragraph.\n"
    (tmp_path / "article.txt").write_text(article)
    ds = build_text_dataset("unused", str(tmp_path / "article.txt"), tokenizer, 4, 0, 1, 1, infinite=True)
    assert np.asarray(ds.tokens).tolist() == tokenizer.encode(article)


def test_token_cache_is_built_once_and_rebuilt_when_the_file_changes(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "one two"}) + "\n")
    calls = []

    def read():
        calls.append(1)
        yield "one two"

    token_cache.load_or_build([data], tokenizer, read)
    token_cache.load_or_build([data], tokenizer, read)
    assert len(calls) == 1
    data.write_text(json.dumps({"text": "one two three"}) + "\n")
    token_cache.load_or_build([data], tokenizer, read)
    assert len(calls) == 2 and len(list((tmp_path / "cache").glob("*.tmp"))) == 0


def test_token_cache_is_rebuilt_for_a_same_size_rewrite_that_kept_the_modification_time(tmp_path, tokenizer):
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "apple pie"}) + "\n")
    before = token_cache.cache_key([data], tokenizer)
    stat = data.stat()
    data.write_text(json.dumps({"text": "lemon pie"}) + "\n")  # same size
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as cp -p or rsync -t leave it
    assert data.stat().st_size == stat.st_size and data.stat().st_mtime_ns == stat.st_mtime_ns
    assert token_cache.cache_key([data], tokenizer) != before


def test_a_same_size_rewrite_that_kept_the_modification_time_is_tokenized_from_the_new_text(
    tmp_path, tokenizer, monkeypatch
):
    # datasets' own Arrow cache trusts the modification time; reading it would give the old text.
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "apple pie"}) + "\n")
    build_text_dataset("unused", str(data), tokenizer, 4, 0, 1, 1, infinite=True)
    stat = data.stat()
    data.write_text(json.dumps({"text": "lemon pie"}) + "\n")
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    ds = build_text_dataset("unused", str(data), tokenizer, 4, 0, 1, 1, infinite=True)
    assert np.asarray(ds.tokens).tolist() == tokenizer.encode("lemon pie")


def test_token_cache_is_rebuilt_when_tokenizer_config_changes_the_eos(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    first = _word_tokenizer(tmp_path / "tok", {"bos_token": None, "eos_token": "<|im_end|>"})
    token_cache.load_or_build([data], first, lambda: iter(["hello world"]))
    second = _word_tokenizer(tmp_path / "tok", {"bos_token": None, "eos_token": "<|endoftext|>"})
    tokens = token_cache.load_or_build([data], second, lambda: iter(["hello world"]))
    assert np.asarray(tokens).tolist() == [1, 2, second.eos_id]


def test_an_unusable_cache_folder_is_a_config_error_naming_the_variable(tmp_path, tokenizer, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "a_file" / "tokens"))
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "one"}) + "\n")
    with pytest.raises(
        ConfigError, match=r"cannot be written or read \(Not a directory\).*\$TORCHTITAN_CACHE_DIR"
    ):
        build_text_dataset("unused", str(data), tokenizer, 4, 0, 1, 1, infinite=True)


def test_token_cache_key_changes_with_the_cache_format(tmp_path, tokenizer, monkeypatch):
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "one"}) + "\n")
    before = token_cache.cache_key([data], tokenizer)
    monkeypatch.setattr(token_cache, "CACHE_FORMAT", token_cache.CACHE_FORMAT + 1)
    assert token_cache.cache_key([data], tokenizer) != before


def _tokenize_concurrently(cache: str, data: str, marks: str, start, result) -> None:
    os.environ["TORCHTITAN_CACHE_DIR"] = cache

    def read():
        with open(marks, "a") as f:
            f.write("x")
        time.sleep(0.5)  # hold the build long enough for the others to arrive
        yield "one two three"

    start.wait()
    tokens = token_cache.load_or_build([Path(data)], HuggingFaceTokenizer(BUNDLED_TOKENIZER), read)
    result.put(np.asarray(tokens).tolist())


def test_processes_sharing_a_cache_folder_tokenize_once_and_read_the_same_tokens(tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "one two three"}) + "\n")
    ctx = multiprocessing.get_context("fork")
    start, result = ctx.Barrier(3), ctx.Queue()
    args = (str(tmp_path / "cache"), str(data), str(tmp_path / "marks"), start, result)
    procs = [ctx.Process(target=_tokenize_concurrently, args=args) for _ in range(3)]
    for proc in procs:
        proc.start()
    tokens = [result.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    assert [proc.exitcode for proc in procs] == [0, 0, 0]
    assert (tmp_path / "marks").read_text() == "x"
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) >= 5


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask-022", "umask-027"])
def test_token_cache_file_gets_the_mode_the_umask_allows(umask, mode, tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "one"}) + "\n")
    old_mask = os.umask(umask)
    try:
        token_cache.load_or_build([data], tokenizer, lambda: iter(["one"]))
    finally:
        os.umask(old_mask)
    (cached,) = (tmp_path / "cache").glob("*.bin")
    assert stat.S_IMODE(cached.stat().st_mode) == mode


def test_records_without_text_field_name_the_columns(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ConfigError, match="no 'text' column"):
        build_text_dataset("unused", str(tmp_path / "d.jsonl"), tokenizer, 4, 0, 1, 1, infinite=True)


@pytest.mark.parametrize(
    "content, named",
    [
        ('{"text": "a document"}\n{"body": "no text here"}\n', r"record 1 .* has 'text' = None"),
        ('{"text": null}\n', r"record 0 .* has 'text' = None"),
        ('{"text": ["two", "parts"]}\n', r"record 0 .* has 'text' = \['two', 'parts'\]"),
        ('{"text": 7}\n', r"record 0 .* has 'text' = 7"),
        (b'{"text": "caf\xe9"}\n', r"line 1 is not UTF-8 \(byte 0xe9 at column 14\); save the file as UTF-8"),
        (
            b'{"text": "a"}\n{"text": "b"}\n{"text": "\xff"}\n',
            r"line 3 is not UTF-8 \(byte 0xff at column 11\)",
        ),
        ('{"text": "a"}\n{not json\n', r"cannot be read .*UTF-8 json"),
        ("", r"has no records \(it is empty\)"),
        ("\n  \n", r"has no records \(it is empty or blank\)"),
    ],
    ids=[
        "missing",
        "null",
        "list",
        "number",
        "latin-1",
        "a bad byte in record 3",
        "malformed",
        "empty",
        "blank",
    ],
)
def test_an_unreadable_local_record_is_a_config_error_naming_the_file(tmp_path, tokenizer, content, named):
    data = tmp_path / "d.jsonl"
    data.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=rf"'training.dataset_path' \({re.escape(str(data))}\).*{named}"):
        build_text_dataset("unused", str(data), tokenizer, 4, 0, 1, 1, infinite=True)


def test_files_in_hidden_folders_are_not_read(tmp_path, tokenizer):
    _write_corpus(tmp_path / "data", "jsonl", ["one two three"])
    _write_corpus(tmp_path / "data" / ".ipynb_checkpoints", "jsonl", ["four five six"])
    ds = build_text_dataset("unused", str(tmp_path / "data"), tokenizer, 4, 0, 1, 1, infinite=True)
    assert np.asarray(ds.tokens).tolist() == tokenizer.encode("one two three")


def test_missing_dataset_path_is_a_clear_error(tokenizer):
    with pytest.raises(ConfigError, match="training.dataset_path"):
        build_text_dataset("x", "/no/such/place", tokenizer, 4, 0, 1, 1, infinite=True)


def test_stateful_dataloader_round_trips_its_position(tokenizer):
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = build_text_dataset("smoke", None, tokenizer, 32, 0, 1, 2, infinite=True)
    loader = StatefulDataLoader(ds, batch_size=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    expected = next(it)[0]
    again = StatefulDataLoader(
        build_text_dataset("smoke", None, tokenizer, 32, 0, 1, 2, infinite=True), batch_size=2
    )
    again.load_state_dict(state)
    assert torch.equal(next(iter(again))[0], expected)


def _fake_hub(monkeypatch, tmp_path, docs, column="text"):
    """Serve `docs` (under `column`) as a streaming hub dataset, without network."""
    import datasets

    data = tmp_path / "hub.jsonl"
    data.write_text("".join(json.dumps({column: d}) + "\n" for d in docs))
    real = datasets.load_dataset
    seen = []

    def load_dataset(path, name=None, split=None, streaming=False):
        seen.append((path, name, streaming))
        return real("json", data_files=str(data), split=split, streaming=streaming)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return seen


def test_hub_dataset_streams_and_shards_documents_by_rank(monkeypatch, tmp_path, tokenizer):
    docs = [f"document number {i} " * 5 for i in range(8)]
    seen = _fake_hub(monkeypatch, tmp_path, docs)
    rank0 = build_text_dataset("c4", None, tokenizer, 8, 0, 2, 1, infinite=True)
    rank1 = build_text_dataset("c4", None, tokenizer, 8, 1, 2, 1, infinite=True)
    assert seen[0] == ("allenai/c4", "en", True)
    first0, first1 = next(iter(rank0))[0], next(iter(rank1))[0]
    assert first0.tolist() == tokenizer.encode(docs[0])[:8]
    assert first1.tolist() == tokenizer.encode(docs[1])[:8]


def test_hub_dataset_state_resumes_mid_stream(monkeypatch, tmp_path, tokenizer):
    _fake_hub(monkeypatch, tmp_path, [f"text {i} " * 7 for i in range(6)])
    first = build_text_dataset("some/hub-set", None, tokenizer, 8, 0, 1, 1, infinite=True)
    samples = _take(first, 6)
    restarted = build_text_dataset("some/hub-set", None, tokenizer, 8, 0, 1, 1, infinite=True)
    partial = build_text_dataset("some/hub-set", None, tokenizer, 8, 0, 1, 1, infinite=True)
    _take(partial, 3)
    restarted.load_state_dict(partial.state_dict())
    assert all(torch.equal(a[0], b[0]) for a, b in zip(_take(restarted, 3), samples[3:]))


def test_hub_dataset_resumed_after_a_full_pass_continues_the_second_pass(monkeypatch, tmp_path, tokenizer):
    _fake_hub(monkeypatch, tmp_path, [f"text {i} " * 7 for i in range(6)])  # about 16 samples a pass
    uninterrupted = _take(build_text_dataset("some/hub-set", None, tokenizer, 8, 0, 1, 1, infinite=True), 26)
    partial = build_text_dataset("some/hub-set", None, tokenizer, 8, 0, 1, 1, infinite=True)
    _take(partial, 20)
    state = partial.state_dict()
    assert state["epoch"] == 1
    resumed = build_text_dataset("some/hub-set", None, tokenizer, 8, 0, 1, 1, infinite=True)
    resumed.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(_take(resumed, 6), uninterrupted[20:]))


def test_a_hub_dataset_that_gives_a_rank_no_document_is_refused_when_built_not_looped_on(
    monkeypatch, tmp_path, tokenizer
):
    """At build time, where the trainer shares the error with the other ranks; at the first
    batch only this rank would have seen it."""
    _fake_hub(monkeypatch, tmp_path, ["the only document " * 5])
    build_text_dataset("some/hub-set", None, tokenizer, 8, 0, 2, 1, infinite=True)
    with pytest.raises(ConfigError, match="gives data-parallel rank 1 of 2 no document"):
        build_text_dataset("some/hub-set", None, tokenizer, 8, 1, 2, 1, infinite=True)


def test_a_hub_record_whose_text_is_not_a_string_is_a_config_error_naming_the_dataset(
    monkeypatch, tmp_path, tokenizer
):
    _fake_hub(monkeypatch, tmp_path, ["a document " * 5, None])
    ds = build_text_dataset("some/hub-set", None, tokenizer, 4, 0, 1, 1, infinite=True)
    with pytest.raises(ConfigError, match=r"'training.dataset' = 'some/hub-set': a record has 'text' = None"):
        list(itertools.islice(ds, 20))


def test_a_hub_dataset_resumed_at_the_end_of_a_pass_continues_into_the_next(monkeypatch, tmp_path, tokenizer):
    doc = "the only document of this stream"
    _fake_hub(monkeypatch, tmp_path, [doc])
    seq_len = len(tokenizer.encode(doc)) - 1  # one window per pass, ending exactly at the pass's end
    partial = build_text_dataset("some/hub-set", None, tokenizer, seq_len, 0, 1, 1, infinite=True)
    stream = iter(partial)
    next(stream)
    resumed = build_text_dataset("some/hub-set", None, tokenizer, seq_len, 0, 1, 1, infinite=True)
    resumed.load_state_dict(partial.state_dict())
    assert torch.equal(next(iter(resumed))[0], next(stream)[0])


def test_hub_dataset_without_text_column_is_a_config_error(monkeypatch, tmp_path, tokenizer):
    _fake_hub(monkeypatch, tmp_path, ["def f(): pass"], column="content")
    with pytest.raises(ConfigError) as info:
        build_text_dataset("org/code-set", None, tokenizer, 8, 0, 1, 1, infinite=True)
    message = str(info.value)
    assert "'training.dataset' = 'org/code-set'" in message and "no 'text' column" in message
    assert "['content']" in message and "training.dataset_path" in message


def test_hub_stream_without_declared_features_is_checked_on_its_first_record(monkeypatch, tokenizer):
    import datasets

    def records():
        yield {"content": "def f(): pass"}

    stream = datasets.IterableDataset.from_generator(records)
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: stream)
    with pytest.raises(ConfigError, match=r"no 'text' column \(columns: \['content'\]\)"):
        build_text_dataset("org/code-set", None, tokenizer, 8, 0, 1, 1, infinite=True)


def test_a_killed_tokenizations_temporary_file_is_removed_by_the_next_build(tmp_path, tokenizer, monkeypatch):
    """SIGKILL (or a job's time limit) leaves it; each build writes under a new name."""
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "one"}) + "\n")
    key = token_cache.cache_key([data], tokenizer)
    orphan = tmp_path / "cache" / f"{key}.bin.0123456789abcdef.tmp"
    orphan.parent.mkdir()
    orphan.write_bytes(b"\0" * 64)
    tokens = token_cache.load_or_build([data], tokenizer, lambda: iter(["one"]))
    assert not orphan.exists() and np.asarray(tokens).tolist() == tokenizer.encode("one")


def test_a_dataset_with_no_tokens_at_all_is_refused_naming_it(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer, "encode_batch", lambda texts, bos, eos: [[] for _ in texts])
    (tmp_path / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ConfigError, match="empty.jsonl.* has 0 tokens: too few for one global batch"):
        build_text_dataset("unused", str(tmp_path / "empty.jsonl"), tokenizer, 4, 0, 1, 1, infinite=True)


def test_a_folder_of_gzipped_json_lines_is_read_as_c4_ships_them(tmp_path, tokenizer):
    folder = tmp_path / "c4"
    folder.mkdir()
    for shard, texts in (("00000", ["first doc", "second doc"]), ("00001", ["third doc"])):
        with gzip.open(folder / f"c4-train.{shard}-of-01024.json.gz", "wt") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    files = local_files(str(folder), "training.dataset_path")
    assert list(read_local_documents(files)) == ["first doc", "second doc", "third doc"]


def test_a_folder_without_readable_files_names_the_files_it_holds(tmp_path):
    (tmp_path / "shard.json.lz4").write_text("x")
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(ConfigError, match=r"found \['notes.md', 'shard.json.lz4'\]"):
        local_files(str(tmp_path), "training.dataset_path")


def test_without_flock_a_build_leaves_other_builds_temporary_files_alone(tmp_path, tokenizer, monkeypatch):
    """There, another live build may be writing its file; only the lock makes it an orphan."""
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "no locks")

    monkeypatch.setattr(token_cache.fcntl, "flock", no_flock)
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "one"}) + "\n")
    other_build = tmp_path / "cache" / f"{token_cache.cache_key([data], tokenizer)}.bin.0123456789abcdef.tmp"
    other_build.parent.mkdir()
    other_build.write_bytes(b"\0" * 64)
    token_cache.load_or_build([data], tokenizer, lambda: iter(["one"]))
    assert other_build.exists()


def test_added_tokens_beyond_the_models_embedding_rows_are_refused_naming_the_counts(tmp_path, capsys):
    from torchtitan.train import main

    HuggingFaceTokenizer(BUNDLED_TOKENIZER)._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|new_bos|>"}))
    with pytest.raises(SystemExit) as info:  # the debug model embeds the bundled 2048 tokens
        main(["--config", "debug_model.toml", "--model.hf_assets_path", str(tmp_path),
              "--job.dump_folder", str(tmp_path / "dump")])  # fmt: skip
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "has 2049 tokens but flavor 'debugmodel' embeds only 2048" in err and "Traceback" not in err
