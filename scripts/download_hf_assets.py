"""Fetch a model's tokenizer, config and/or weights from the Hugging Face Hub.

Files land in `<local_dir>/<repo name>/`, e.g. `./assets/hf/Llama-3.1-8B` for
`meta-llama/Llama-3.1-8B`: the folder that `model.hf_assets_path` in a train config points at.
Only files that exist in the repo are fetched; a requested kind with no file in the repo is
reported as a warning. Per kind, only files at the repo root are considered (so Meta's
`original/` checkpoint folder is skipped); `--all` fetches every file in the repo, subfolders
included.

Asset kinds:
    tokenizer    tokenizer.json, tokenizer_config.json, tokenizer.model, special_tokens_map.json
    config       config.json, generation_config.json
    safetensors  *.safetensors and model.safetensors.index.json
    index        model.safetensors.index.json

Gated models (e.g. Llama) need a token from an account that accepted the license on the model
page: pass `--hf_token`, or set `HF_TOKEN`. Hub errors (gated or missing repo, no network) are
reported in one paragraph on stderr with exit code 2, as is a request that matches no file.

Needs `huggingface_hub` (`pip install -e .[hub]`).

Usage:
    python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B --assets tokenizer
    python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B \\
        --assets tokenizer config safetensors [--local_dir ./assets/hf] [--hf_token TOKEN]
    python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B --all
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from huggingface_hub import hf_hub_download, list_repo_files
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)

ASSET_PATTERNS: dict[str, tuple[str, ...]] = {
    "tokenizer": ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json"),
    "config": ("config.json", "generation_config.json"),
    "safetensors": ("*.safetensors", "model.safetensors.index.json"),
    "index": ("model.safetensors.index.json",),
}
ALL = "all"
DEFAULT_LOCAL_DIR = "./assets/hf"
EXIT_BAD_INPUT = 2


def _connection_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions meaning "the Hub could not be reached", whichever HTTP client huggingface_hub uses.

    huggingface_hub 2.x raises httpx2 transport errors, 1.x httpx ones and 0.x requests ones;
    `hf_hub_download` turns them into `LocalEntryNotFoundError` when nothing is cached.
    """
    types: list[type[BaseException]] = [
        OfflineModeIsEnabled,
        LocalEntryNotFoundError,
        ConnectionError,
        TimeoutError,
    ]
    for module_name, names in (
        ("httpx2", ("TransportError",)),
        ("httpx", ("TransportError",)),
        ("requests", ("ConnectionError", "Timeout")),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        types.extend(getattr(module, name) for name in names if hasattr(module, name))
    return tuple(types)


CONNECTION_ERRORS = _connection_error_types()


class NothingToFetchError(Exception):
    """None of the requested asset kinds has a file in the repo."""


def repo_folder(local_dir: str | Path, repo_id: str) -> Path:
    """The folder assets of `repo_id` are written to: `<local_dir>/<repo name after the slash>`."""
    return Path(local_dir) / repo_id.rstrip("/").rsplit("/", 1)[-1]


def files_for_kind(repo_files: Iterable[str], kind: str) -> list[str]:
    """The files of `repo_files` that belong to asset `kind` (see ASSET_PATTERNS, or ALL), sorted.

    For a named kind only root-level files match; ALL matches every file.
    """
    if kind == ALL:
        return sorted(set(repo_files))
    patterns = ASSET_PATTERNS[kind]
    return sorted(
        {
            name
            for name in repo_files
            if "/" not in name and any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
        }
    )


def files_to_fetch(repo_files: Iterable[str], kinds: Iterable[str]) -> list[str]:
    """The sorted, de-duplicated files of `repo_files` that belong to any of the asset `kinds`."""
    repo_files = list(repo_files)
    selected: set[str] = set()
    for kind in kinds:
        selected.update(files_for_kind(repo_files, kind))
    return sorted(selected)


def download(repo_id: str, kinds: Sequence[str], local_dir: str | Path, token: str | None) -> Path:
    """Fetch the files of asset `kinds` in `repo_id` into `<local_dir>/<repo name>/` and return that folder.

    Prints a warning to stderr for each kind with no file in the repo. Raises NothingToFetchError
    when no requested kind has any file, and huggingface_hub's errors (gated or missing repo,
    HTTP or connection failures) as they come.
    """
    repo_files = list_repo_files(repo_id, token=token)
    for kind in kinds:
        if not files_for_kind(repo_files, kind):
            patterns = ", ".join(ASSET_PATTERNS.get(kind, ("*",)))
            print(f"warning: no {kind} files in {repo_id} (looked for {patterns})", file=sys.stderr)
    names = files_to_fetch(repo_files, kinds)
    if not names:
        raise NothingToFetchError(
            f"nothing to fetch: {repo_id} has no files for asset kinds {', '.join(kinds)}. "
            "Check --repo_id, or ask for other --assets (--all fetches every file)."
        )
    target = repo_folder(local_dir, repo_id)
    target.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {repo_id}/{name}", flush=True)
        hf_hub_download(repo_id=repo_id, filename=name, local_dir=target, token=token)
    print(f"{len(names)} file(s) from {repo_id} in {target}")
    return target


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def hub_error_message(error: BaseException, repo_id: str) -> str | None:
    """A one-paragraph explanation of a Hub error for the user, or None if `error` is not one."""
    token_hint = (
        "Pass --hf_token TOKEN or set the HF_TOKEN environment variable to a token of an account "
        f"that has accepted the license on the model page, https://huggingface.co/{repo_id}."
    )
    detail = _first_line(error)
    if isinstance(error, GatedRepoError):
        return (
            f"error: {repo_id} is a gated repo and this request is not authorized to access it. {token_hint}"
        )
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"error: repo not found: {repo_id}. Check the spelling of --repo_id (owner/name); "
            "if the repo is private or gated, pass --hf_token TOKEN or set HF_TOKEN. "
            f"(Hub said: {detail})"
        )
    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, HfHubHTTPError) and status in (401, 403):
        return f"error: the Hub refused access to {repo_id} (HTTP {status}). {token_hint}"
    if isinstance(error, OfflineModeIsEnabled):
        return (
            f"error: cannot fetch {repo_id}: huggingface_hub offline mode is on (HF_HUB_OFFLINE is set). "
            "Unset HF_HUB_OFFLINE, or copy the files into the assets folder by hand."
        )
    if isinstance(error, CONNECTION_ERRORS):
        return (
            f"error: cannot reach the Hugging Face Hub to fetch {repo_id}: no network connection "
            "(or the Hub, or HF_ENDPOINT if set, is unreachable). Run this on a machine with internet "
            f"access and copy the assets folder over. ({type(error).__name__}: {detail})"
        )
    if isinstance(error, HfHubHTTPError):
        return f"error: the Hub request for {repo_id} failed (HTTP {status}): {detail}"
    if isinstance(error, HFValidationError):
        return f"error: invalid --repo_id {repo_id!r}: {detail}"
    return None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description="Fetch a model's tokenizer, config and/or weights from the Hugging Face Hub.",
        epilog="Asset kinds: "
        + "; ".join(f"{kind}: {', '.join(patterns)}" for kind, patterns in ASSET_PATTERNS.items()),
    )
    parser.add_argument("--repo_id", required=True, help="Hub repo, e.g. meta-llama/Llama-3.1-8B")
    parser.add_argument(
        "--assets", nargs="+", choices=list(ASSET_PATTERNS), default=[], help="asset kinds to fetch"
    )
    parser.add_argument("--all", action="store_true", help="fetch every file in the repo")
    parser.add_argument(
        "--local_dir",
        default=DEFAULT_LOCAL_DIR,
        help=f"files go to LOCAL_DIR/<repo name>/ (default {DEFAULT_LOCAL_DIR})",
    )
    parser.add_argument("--hf_token", default=None, help="Hub access token (default: $HF_TOKEN)")
    args = parser.parse_args(argv)
    if not args.assets and not args.all:
        parser.error("give --assets KIND [KIND ...] or --all")
    if Path(args.local_dir).exists() and not Path(args.local_dir).is_dir():
        parser.error(f"--local_dir {args.local_dir} is a file; give a folder (files go to LOCAL_DIR/<repo>/)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 nothing to fetch or a Hub error)."""
    args = parse_args(argv)
    token = args.hf_token or os.environ.get("HF_TOKEN") or None
    kinds = [ALL] if args.all else list(dict.fromkeys(args.assets))
    try:
        download(args.repo_id, kinds, args.local_dir, token)
    except NothingToFetchError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as error:
        message = hub_error_message(error, args.repo_id)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
