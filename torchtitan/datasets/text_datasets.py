"""Where documents come from, and how they become (input, label) windows per rank.

Local files and the bundled corpus are tokenized once (see `token_cache`), cut into
`seq_len + 1` windows globally, and every rank takes its slice of each global batch, so the
tokens of a step do not depend on the data-parallel degree. Hub datasets stream and shard by
rank instead, since their full token stream is not known up front.
"""

import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import BUNDLED_DATASET_FILES
from torchtitan.datasets import token_cache
from torchtitan.tools.paths import BUNDLED_ASSETS, resolve_path

logger = logging.getLogger(__name__)

BUNDLED_DATASETS = {name: BUNDLED_ASSETS / file for name, file in BUNDLED_DATASET_FILES.items()}
# Short names for hub datasets: name -> (hub path, dataset config).
HUB_ALIASES = {"c4": ("allenai/c4", "en")}
_BUILDER_BY_SUFFIX = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
# Compressions `datasets` opens by themselves (fsspec infers them from the suffix), for the
# text formats: allenai/c4 ships as .json.gz.
_COMPRESSED = (".gz", ".bz2", ".xz")
# The text builder's default makes every line a document: hard-wrapped prose would become one
# BOS/EOS pair per line (and per blank line), and block_causal would mask across lines.
_BUILDER_OPTIONS = {"text": {"sample_by": "document"}}


def local_files(dataset_path: str, key: str) -> list[Path]:
    """The data files at `dataset_path` (a file, or a folder of files of one supported kind)."""
    path = resolve_path(dataset_path)
    if path.is_file():
        present = [path]
    elif path.is_dir():
        # Hidden folders and files (.ipynb_checkpoints, editors' copies) are not data.
        present = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p, path))
    else:
        raise ConfigError(f"'{key}' = '{dataset_path}' does not exist; give a file or folder.")
    files = [p for p in present if _builder(p)] if path.is_dir() else present
    kinds = {_builder(f) for f in files}
    if not files or None in kinds or len(kinds) > 1:
        readable = ", ".join(_BUILDER_BY_SUFFIX)
        raise ConfigError(
            f"'{key}' = '{dataset_path}' must hold files of one kind among {readable} (the text "
            f"ones also compressed as {', '.join(_COMPRESSED)}); found "
            f"{[f.name for f in (files or present)][:5] or 'none'}."
        )
    return files


def _builder(path: Path) -> str | None:
    """The `datasets` builder that reads `path`, judged by its suffixes; None for none."""
    suffix = path.suffix
    if suffix in _COMPRESSED:
        suffix = Path(path.stem).suffix
        return _BUILDER_BY_SUFFIX.get(suffix) if suffix != ".parquet" else None
    return _BUILDER_BY_SUFFIX.get(suffix)


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _require_text_column(columns: list[str], where: str, fix: str) -> None:
    if "text" not in columns:
        raise ConfigError(f"{where} has no 'text' column (columns: {columns}); {fix}.")


def read_local_documents(files: list[Path], key: str = "training.dataset_path"):
    """Yield the 'text' field of every record of `files`, in order, via HF `datasets`; a .txt
    file is one record.

    Raises:
        ConfigError: naming `key` and the files, for files `datasets` cannot read (not UTF-8,
            a malformed line, no records), no 'text' column, or a record whose 'text' is not a
            string (missing, null, a number or a list).
    """
    import datasets

    builder = _builder(files[0])
    options = _BUILDER_OPTIONS.get(builder, {})
    where = f"'{key}' ({_name_files(files)})"

    def unreadable(error: Exception) -> ConfigError:
        kind = "text" if builder == "text" else builder
        return ConfigError(
            f"{where} cannot be read ({_describe(error)}); each file must be UTF-8 {kind} with at least "
            "one record."
        )

    if empty := [f for f in files if _is_empty(f)]:
        blank = " or blank" if empty[0].stat().st_size else ""
        raise ConfigError(
            f"{where}: {empty[0]} has no records (it is empty{blank}); give files with at least one "
            "document, or leave the empty one out."
        )
    # Streaming reads the files themselves. A non-streaming load answers from datasets' own
    # Arrow copy, which it reuses while a file's modification time is unchanged, so a rewrite
    # that kept its time (cp -p, rsync -t) would be tokenized from the old text.
    try:
        ds = datasets.load_dataset(
            builder, data_files=[str(f) for f in files], split="train", streaming=True, **options
        )
        columns = _stream_columns(ds)
    except Exception as e:  # datasets and arrow raise many types; all mean an unreadable file
        raise unreadable(e) from None
    _require_text_column(columns, where, "store each document's text under the key 'text'")
    try:
        for index, record in enumerate(ds):
            yield _document_text(record, where, f"record {index} (counting from 0 over the files in order)")
    except ConfigError:
        raise
    except Exception as e:  # e.g. bytes that are not UTF-8, decoded only as records are read
        if isinstance(e, UnicodeDecodeError) and (found := _first_line_not_utf8(files)):
            raise ConfigError(f"{where}: {found}; save the file as UTF-8.") from None
        raise unreadable(e) from None


_BLANK_PREFIX_BYTES = 1 << 16


def _is_empty(path: Path) -> bool:
    """No byte, or (a small file) only whitespace: no record to read."""
    size = path.stat().st_size
    return size == 0 or (size <= _BLANK_PREFIX_BYTES and not path.read_bytes().strip())


def _first_line_not_utf8(files: list[Path]) -> str | None:
    """Where the first byte that is not UTF-8 is, as "<file> line N (byte 0x.. at column C)"."""
    for path in files:
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as e:
                    byte = f"byte {line[e.start]:#04x} at column {e.start + 1}"
                    return f"{path} line {number} is not UTF-8 ({byte})"
    return None


def _document_text(record: dict, where: str, which: str) -> str:
    """The record's 'text'; a ConfigError naming `where` and `which` record if it is not a string."""
    text = record.get("text")
    if not isinstance(text, str):
        raise ConfigError(
            f"{where}: {which} has 'text' = {text!r:.80}; every record needs its document as a "
            "string under 'text'."
        )
    return text


def _name_files(files: list[Path]) -> str:
    return str(files[0]) if len(files) == 1 else f"{len(files)} files in {files[0].parent}"


def _describe(error: Exception) -> str:
    """The error's type and the first line of its message."""
    line = (str(error).strip().splitlines() or [""])[0][:200]
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def resolve_local_source(dataset: str, dataset_path: str | None, key: str) -> list[Path] | None:
    """Files for a local/bundled dataset, or None when `dataset` is a hub name to stream."""
    if dataset_path:
        return local_files(dataset_path, f"{key}_path")
    if dataset in BUNDLED_DATASETS:
        return [BUNDLED_DATASETS[dataset]]
    return None


class PackedTokenDataset(IterableDataset):
    """Fixed windows of one token stream, dealt to data-parallel ranks batch by batch.

    The rank's k-th sample is global window `offset + (k // B) * B * D + rank * B + k % B`
    (B = local batch, D = dp degree), taken modulo the window count: micro-batch i of every
    rank together is global windows offset + [i*B*D, (i+1)*B*D). Windows overlap by one token
    so every token after the first is a label exactly once per epoch, except the last
    (len(tokens) - 1) % seq_len, too few for a window, which are never read. `offset` is the number
    of global windows a run resumed under another layout had already consumed (see
    `state_continuing`); it is 0 otherwise.

    Args:
        tokens: 1-D token ids (a memmap is fine; it is never copied whole).
        seq_len: tokens per input; each window holds seq_len + 1.
        infinite: loop over epochs (training) or stop after one pass of whole global
            batches (validation).
        section: the config section ("training" or "validation") whose keys errors name.
    """

    def __init__(
        self,
        tokens,
        seq_len: int,
        dp_rank: int,
        dp_degree: int,
        local_batch_size: int,
        infinite: bool = True,
        name: str = "dataset",
        section: str = "training",
    ):
        super().__init__()
        self.tokens, self.seq_len, self.name = tokens, seq_len, name
        self.dp_rank, self.dp_degree, self.local_batch_size = dp_rank, dp_degree, local_batch_size
        self.infinite = infinite
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < local_batch_size * dp_degree:
            raise ConfigError(
                f"dataset '{name}' has {len(tokens)} tokens: too few for one global batch of "
                f"{local_batch_size * dp_degree} x {seq_len + 1}; use a larger dataset or a "
                f"smaller {section}.seq_len / {section}.local_batch_size."
            )
        self.sample_index = 0
        self.window_offset = 0

    def global_window(self, sample_index: int) -> int:
        b, d = self.local_batch_size, self.dp_degree
        return self.window_offset + (sample_index // b) * b * d + self.dp_rank * b + sample_index % b

    def __iter__(self):
        per_pass = (self.num_windows // (self.local_batch_size * self.dp_degree)) * self.local_batch_size
        while self.infinite or self.sample_index < per_pass:
            self._log_new_epoch()
            window = self.global_window(self.sample_index) % self.num_windows
            start = window * self.seq_len
            chunk = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
            self.sample_index += 1
            yield chunk[:-1], chunk[1:]

    def _log_new_epoch(self) -> None:
        b, d, k = self.local_batch_size, self.dp_degree, self.sample_index
        if self.dp_rank != 0 or k % b:
            return
        first = self.window_offset + (k // b) * b * d  # of this global micro-batch
        epoch = (first + b * d - 1) // self.num_windows
        if epoch > 0 and epoch > (first - 1) // self.num_windows:
            logger.info(f"dataset '{self.name}' starts epoch {epoch + 1}")

    def state_dict(self) -> dict:
        return {
            "sample_index": self.sample_index,
            "window_offset": self.window_offset,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict) -> None:
        self.sample_index = state["sample_index"]
        self.window_offset = state.get("window_offset", 0)  # absent before resharding existed

    def state_continuing(self, saved: dict, saved_batch: int, saved_dp: int) -> dict:
        """The state that takes up where a run with another layout stopped.

        Args:
            saved: that run's dataset state (any rank's: all hold the same global position).
            saved_batch, saved_dp: its local batch size and data-parallel degree.

        Returns a state whose `window_offset` is the global windows that run consumed, so this
        layout reads the next one on. A changed `seq_len` cuts the stream into other windows;
        the position then moves to the first new window that starts at or after the first
        unread token, which skips less than one window.
        """
        b = saved_batch
        consumed = saved.get("window_offset", 0) + (saved["sample_index"] // b) * b * saved_dp
        saved_seq_len = saved.get("seq_len", self.seq_len)
        if saved_seq_len != self.seq_len:
            saved_windows = (len(self.tokens) - 1) // saved_seq_len
            epoch, window = divmod(consumed, saved_windows)
            first_unread_token = window * saved_seq_len
            new_window = min(-(-first_unread_token // self.seq_len), self.num_windows)  # ceil
            consumed = epoch * self.num_windows + new_window
        return {"sample_index": 0, "window_offset": consumed, "seq_len": self.seq_len}


def _stream_columns(ds) -> list[str]:
    # A stream without declared features has no column_names; its first record tells.
    return ds.column_names or list(next(iter(ds), {}))


class StreamingTokenDataset(IterableDataset):
    """A Hugging Face hub dataset, streamed, sharded by rank, tokenized and packed on the fly."""

    def __init__(self, name: str, tokenizer, seq_len: int, dp_rank: int, dp_degree: int):
        super().__init__()
        import datasets
        from datasets.distributed import split_dataset_by_node

        try:
            path, subset = HUB_ALIASES.get(name, (name, None))
            ds = datasets.load_dataset(path, subset, split="train", streaming=True)
        except Exception as e:  # the hub raises many types; all mean the same to the user
            raise ConfigError(
                f"cannot open 'training.dataset' = '{name}' from the Hugging Face hub ({e}). "
                "Use 'smoke', or set training.dataset_path to local files."
            ) from None
        _require_text_column(
            _stream_columns(ds),
            f"'training.dataset' = '{name}' (streamed from the hub)",
            "choose a dataset with one, or save this one locally with a 'text' field and set "
            "training.dataset_path",
        )
        self.data = split_dataset_by_node(ds, rank=dp_rank, world_size=dp_degree)
        _private_epoch_counter(self.data)
        self.name, self.tokenizer, self.seq_len = name, tokenizer, seq_len
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        # Here rather than at the first batch, where only that rank would see it: the trainer
        # shares errors raised while building, so that every rank exits with this one.
        if next(iter(self.data), None) is None:
            raise self._no_document_error()
        self.buffer: list[int] = []
        self.epoch = 0
        self.resumed = False  # a restored position may sit at the very end of its pass
        # The position to report until this process iterates: a loader worker is asked for its
        # state before its first batch, when `self.data` still holds the position of whatever
        # iterated it in the parent (the probe above, or a run before a restore).
        self.start_state: dict | None = {"data": None, "buffer": [], "epoch": 0}

    @property
    def num_shards(self) -> int:
        """The file shards this rank's part of the stream comes from: at most one loader
        worker each."""
        return self.data.num_shards

    def __iter__(self):
        whole_pass = not self.resumed
        self.resumed = False
        self.start_state = None
        while True:
            empty = True
            for record in self.data:
                empty = False
                text = _document_text(record, f"'training.dataset' = '{self.name}'", "a record")
                self.buffer.extend(self.tokenizer.encode(text, bos=True, eos=True))
                while len(self.buffer) >= self.seq_len + 1:
                    chunk = torch.tensor(self.buffer[: self.seq_len + 1])
                    self.buffer = self.buffer[self.seq_len + 1 :]
                    yield chunk[:-1], chunk[1:]
            if empty and whole_pass:  # the stream changed since it was built
                raise self._no_document_error()
            whole_pass = True
            self.epoch += 1
            self.data.set_epoch(self.epoch)
            worker = get_worker_info()
            shards = f" of loader worker {worker.id}'s shards" if worker is not None else ""
            logger.info(f"dataset '{self.name}' starts epoch {self.epoch + 1}{shards}")

    def _no_document_error(self) -> ConfigError:
        return ConfigError(
            f"'training.dataset' = '{self.name}' gives data-parallel rank {self.dp_rank} of "
            f"{self.dp_degree} no document: it has fewer documents (or file shards) than ranks. "
            "Use a larger dataset, or local files (training.dataset_path)."
        )

    def state_dict(self) -> dict:
        if self.start_state is not None:
            return dict(self.start_state, buffer=list(self.start_state["buffer"]))
        return {"data": self.data.state_dict(), "buffer": list(self.buffer), "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        # datasets applies a saved position only while its epoch equals the saved one; without
        # this a run resumed in a later pass would restart that pass from document 0.
        self.data.set_epoch(state["epoch"])
        if state["data"] is not None:  # None: the pass's start, saved before it was read from
            self.data.load_state_dict(state["data"])
        self.buffer, self.epoch = list(state["buffer"]), state["epoch"]
        self.resumed = state["data"] is not None
        self.start_state = dict(state, buffer=list(state["buffer"]))


def _private_epoch_counter(data) -> None:
    """Keep a hub stream's epoch in private memory, so each loader worker's copy counts alone.

    datasets keeps the epoch in shared memory, so that `set_epoch` in the parent reaches
    persistent workers. Here each worker loops over its own shards and counts its own passes;
    with a shared counter the first worker to finish a pass would move the others into the
    next epoch mid-pass, and the positions they save would no longer restore.
    """
    if isinstance(getattr(data, "_epoch", None), torch.Tensor):
        data._epoch = torch.tensor(int(data._epoch))


def build_text_dataset(
    dataset: str,
    dataset_path: str | None,
    tokenizer,
    seq_len: int,
    dp_rank: int,
    dp_degree: int,
    local_batch_size: int,
    infinite: bool,
    key: str = "training.dataset",
) -> IterableDataset:
    """The dataset for a `[training]`/`[validation]` section's dataset keys."""
    files = resolve_local_source(dataset, dataset_path, key)
    if files is None:
        if not infinite:
            raise ConfigError(
                f"'{key}' = '{dataset}' streams from the hub; validation needs a finite local "
                f"split: set '{key}_path' to local files."
            )
        return StreamingTokenDataset(dataset, tokenizer, seq_len, dp_rank, dp_degree)
    tokens = token_cache.load_or_build(files, tokenizer, lambda: read_local_documents(files, f"{key}_path"))
    name, section = dataset_path or dataset, key.removesuffix(".dataset")
    return PackedTokenDataset(tokens, seq_len, dp_rank, dp_degree, local_batch_size, infinite, name, section)
