"""Train the bundled byte-level BPE tokenizer on the smoke corpus.

The tokenizer uses the Hugging Face `tokenizers` library: a byte-level pre-tokenizer and
decoder without a leading space, a BPE model over the 256 byte symbols, and three special
tokens at ids 0, 1 and 2. No post-processor is set, so encoding never inserts BOS or EOS;
the data pipeline adds them itself.

Usage:
    python scripts/train_smoke_tokenizer.py [--corpus PATH] [--out-dir DIR] [--vocab-size N]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS_DIR = Path(__file__).resolve().parents[1] / "torchtitan" / "assets"
DEFAULT_CORPUS = ASSETS_DIR / "smoke_corpus" / "train.jsonl"
DEFAULT_OUT_DIR = ASSETS_DIR / "tokenizer"
DEFAULT_VOCAB_SIZE = 2048
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]
MODEL_MAX_LENGTH = 131072


def iter_texts(corpus: Path) -> Iterator[str]:
    """The "text" field of every line of a JSON Lines file, in file order."""
    with corpus.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)["text"]


def build_untrained_tokenizer() -> Tokenizer:
    """An empty byte-level BPE tokenizer with no normalizer and no post-processor."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(corpus: Path, vocab_size: int) -> Tokenizer:
    """Train on `corpus` until the vocabulary, special tokens included, has `vocab_size` entries.

    The full byte alphabet is seeded so that any text encodes without an unknown token, even
    bytes that never occur in the corpus.
    """
    tokenizer = build_untrained_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_texts(corpus), trainer=trainer)
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    """The `tokenizer_config.json` contents that loaders read the special tokens from."""
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": MODEL_MAX_LENGTH,
    }


def save(tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    config_text = json.dumps(tokenizer_config(), indent=2) + "\n"
    (out_dir / "tokenizer_config.json").write_text(config_text, encoding="utf-8")


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--corpus", type=Path, default=DEFAULT_CORPUS, help='JSON Lines file of {"text": ...}'
    )
    parser.add_argument(
        "--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="folder for the tokenizer files"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help="total vocabulary size, special tokens included",
    )
    args = parser.parse_args()
    if not args.corpus.is_file():
        parser.error(f"--corpus {args.corpus} is not a file; make it with scripts/make_smoke_corpus.py")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"--out-dir {args.out_dir} is a file; give a folder")
    smallest = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if args.vocab_size < smallest:
        parser.error(
            f"--vocab-size {args.vocab_size} is below {smallest}, the byte alphabet plus the special "
            "tokens; give a larger one"
        )
    return args


def main() -> None:
    """Train the tokenizer and write it; fail if the corpus could not fill the vocabulary."""
    args = parse_args()
    tokenizer = train_tokenizer(args.corpus, args.vocab_size)
    actual_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if actual_size != args.vocab_size:
        print(
            f"error: trained vocabulary has {actual_size} entries, not {args.vocab_size}: the corpus "
            "has too few distinct words; use a larger corpus or a smaller --vocab-size",
            file=sys.stderr,
        )
        sys.exit(2)
    save(tokenizer, args.out_dir)
    print(f"wrote {args.out_dir} (vocabulary of {actual_size} entries)")


if __name__ == "__main__":
    main()
