"""Any Hugging Face `tokenizer.json`, through the `tokenizers` library."""

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer

from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ConfigError
from torchtitan.tools.paths import resolve_path

# Tried in order when tokenizer_config.json does not name the BOS/EOS tokens.
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<|im_start|>", "<｜begin▁of▁sentence｜>")
_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<|im_end|>", "<｜end▁of▁sentence｜>")


def _token_name(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class HuggingFaceTokenizer:
    """Encodes text to ids with optional BOS/EOS, and decodes back.

    Attributes:
        vocab_size: ids run from 0 to vocab_size - 1 (added tokens included).
        bos_id, eos_id: None when the tokenizer has no such token.
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
        self._tok = Tokenizer.from_file(str(file))
        self.fingerprint = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
        special = self._read_special_tokens(folder / "tokenizer_config.json")
        self.bos_id = self._find_id(special.get("bos_token"), _BOS_CANDIDATES)
        self.eos_id = self._find_id(special.get("eos_token"), _EOS_CANDIDATES)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def _read_special_tokens(config_file: Path) -> dict:
        if not config_file.is_file():
            return {}
        data = json.loads(config_file.read_text())
        return {k: _token_name(data.get(k)) for k in ("bos_token", "eos_token")}

    def _find_id(self, named: str | None, candidates) -> int | None:
        for token in ([named] if named else []) + list(candidates):
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

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
