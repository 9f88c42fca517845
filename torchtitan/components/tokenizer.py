"""Any Hugging Face `tokenizer.json`, through the `tokenizers` library."""

import hashlib
import json
import logging
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.paths import resolve_path

logger = logging.getLogger(__name__)

# Tried in order when tokenizer_config.json is missing or lacks the bos_token/eos_token key.
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<|im_start|>", "<｜begin▁of▁sentence｜>")
_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<|im_end|>", "<｜end▁of▁sentence｜>")
# tokenizer_config.json's special-token keys, in the order transformers adds missing ones.
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_name(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _read_config(config_file: Path) -> dict:
    """tokenizer_config.json's object; empty when the file is missing."""
    if not config_file.is_file():
        return {}
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _unreadable(config_file, error) from None
    if not isinstance(data, dict):
        raise _unreadable(config_file, ValueError("it holds no JSON object"))
    return data


def _tokens_to_add(data: dict, tokenizer: Tokenizer) -> list[AddedToken]:
    """The tokens tokenizer_config.json declares that `tokenizer`'s vocabulary lacks, in the
    order transformers' fast tokenizer adds them (ids after the vocabulary): its
    `added_tokens_decoder` by index, then the special-token keys, then the extra special
    tokens.

    Raises:
        ConfigError: for an `added_tokens_decoder` entry without a "content".
    """
    declared = []
    decoder = data.get("added_tokens_decoder") or {}
    for _, entry in sorted(decoder.items(), key=lambda item: int(item[0])):
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ConfigError(
                f'tokenizer_config.json\'s added_tokens_decoder entry {entry!r} has no "content" '
                "string; fetch the file again, or fix the entry."
            )
        flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
        declared.append(AddedToken(entry["content"], **{k: entry[k] for k in flags if k in entry}))
    names = [_token_name(data.get(key)) for key in _SPECIAL_KEYS]
    # transformers 5 reads "extra_special_tokens" (a list, or a dict of named tokens), and the
    # older "additional_special_tokens" only when the file lacks the newer key.
    extra = (
        data["extra_special_tokens"]
        if "extra_special_tokens" in data
        else data.get("additional_special_tokens")
    )
    names += [_token_name(t) for t in (extra.values() if isinstance(extra, dict) else extra or ())]
    declared += [AddedToken(name, special=True, normalized=False) for name in names if name]
    to_add, seen = [], set()
    for token in declared:
        if tokenizer.token_to_id(token.content) is None and token.content not in seen:
            seen.add(token.content)
            to_add.append(token)
    return to_add


def _read_special_tokens(data: dict) -> dict[str, str | None]:
    """The BOS/EOS token names tokenizer_config.json (`data`) sets, None meaning "no such token".

    A key the file lacks is left out, so only then are candidate names tried: Qwen-style files
    say `"bos_token": null` precisely because none of their special tokens is a BOS.
    """
    special = {k: _token_name(data[k]) for k in ("bos_token", "eos_token") if k in data}
    # add_bos_token: false is how a model family says it trains without BOS. add_eos_token is
    # false even for families that end every document with EOS (HF leaves that to the data
    # pipeline), and packing needs EOS between documents, so it is not read.
    if data.get("add_bos_token") is False:
        special["bos_token"] = None
    return special


def _unreadable(file: Path, error: Exception) -> ConfigError:
    """A tokenizer file of 'model.hf_assets_path' that cannot be parsed: often truncated by an
    interrupted download, or a git-lfs pointer left by a clone without LFS."""
    line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return ConfigError(
        f"{file} (in 'model.hf_assets_path') cannot be read: {line}. Fetch the file again, e.g. "
        "with scripts/download_hf_assets.py --assets tokenizer."
    )


class HuggingFaceTokenizer:
    """Encodes text to ids with optional BOS/EOS, and decodes back.

    Attributes:
        vocab_size: ids run from 0 to vocab_size - 1 (added tokens included).
        bos_id, eos_id: None when the tokenizer has no such token, or tokenizer_config.json
            sets it to null (or add_bos_token to false).
        fingerprint: sha256 of tokenizer.json; keys caches of tokenized data.
    """

    def __init__(self, assets_path: str):
        folder = resolve_path(assets_path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(
                f"no tokenizer.json in 'model.hf_assets_path' = '{assets_path}' (looked at {file}). "
                "Point it at a folder with a Hugging Face tokenizer.json, or fetch one with "
                "scripts/download_hf_assets.py."
            )
        self.path = file
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as error:  # tokenizers raises a bare Exception for every parse error
            raise _unreadable(file, error) from None
        # A special token's text inside a document ("<|end_of_text|>" quoted in a web page or
        # code) is text: ids of special tokens come from bos/eos only, or fake document
        # boundaries would appear (which block_causal masks at).
        self._tok.encode_special_tokens = True
        config_file = folder / "tokenizer_config.json"
        config = _read_config(config_file)
        # As transformers does: tokens the config names but the vocabulary lacks get new ids.
        added = _tokens_to_add(config, self._tok)
        self._tok.add_tokens(added)
        fingerprint = hashlib.sha256(file.read_bytes())
        if added:  # the ids depend on the config too; without additions they do not
            fingerprint.update(json.dumps([t.content for t in added]).encode())
        self.fingerprint = fingerprint.hexdigest()[:16]
        if added:
            logger.info(
                f"Added {len(added)} tokens that {config_file} names but the vocabulary lacks, as "
                f"transformers does: {', '.join(t.content for t in added)}"
            )
        special = _read_special_tokens(config)
        self.bos_id = self._special_id("bos_token", special, _BOS_CANDIDATES, config_file)
        self.eos_id = self._special_id("eos_token", special, _EOS_CANDIDATES, config_file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        if self.eos_id is None:
            logger.warning(
                f"the tokenizer in 'model.hf_assets_path' = '{assets_path}' has no EOS token, so packed "
                "documents run into each other with no separator; name its end-of-document token as "
                f"'eos_token' in {config_file}."
            )

    def _special_id(self, key: str, special: dict, candidates, config_file: Path) -> int | None:
        """The id of the token tokenizer_config.json names under `key` (None for null), or of
        the first candidate in the vocabulary when the file is missing or lacks the key."""
        if key not in special:
            return next((i for i in map(self._tok.token_to_id, candidates) if i is not None), None)
        if special[key] is None:
            return None
        token_id = self._tok.token_to_id(special[key])
        if token_id is None:
            raise ConfigError(
                f"{config_file} sets '{key}' = '{special[key]}', which is not in the vocabulary of "
                f"{self.path}. Name a token of that vocabulary there, or set '{key}' to null for none."
            )
        return token_id

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos and self.eos_id is not None else []
        return head + ids + tail

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        return self._wrap(self._tok.encode(text, add_special_tokens=False).ids, bos, eos)

    def encode_batch(self, texts: list[str], bos: bool = True, eos: bool = True) -> list[list[int]]:
        """Encode many documents at once (the library parallelizes across cores)."""
        encoded = self._tok.encode_batch(texts, add_special_tokens=False)
        return [self._wrap(e.ids, bos, eos) for e in encoded]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def build_hf_tokenizer(job_config: JobConfig) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(job_config.model.hf_assets_path)
