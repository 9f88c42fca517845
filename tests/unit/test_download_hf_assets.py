"""scripts/download_hf_assets.py against a fake Hub served from a temporary folder (no network)."""

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("huggingface_hub")

from huggingface_hub.errors import (  # noqa: E402
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)

from tests.conftest import load_script  # noqa: E402

REPO_ID = "example-org/Tiny-Model-1B"
REPO_FILES = {
    "tokenizer.json": '{"model": {}}',
    "tokenizer_config.json": '{"bos_token": "<s>"}',
    "special_tokens_map.json": "{}",
    "config.json": '{"hidden_size": 8}',
    "model-00001-of-00002.safetensors": "shard one",
    "model-00002-of-00002.safetensors": "shard two",
    "model.safetensors.index.json": '{"weight_map": {}}',
    "README.md": "# Tiny",
    "original/tokenizer.model": "sentencepiece",
    "original/consolidated.00.pth": "meta checkpoint",
}
TOKENIZER_FILES = ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
SAFETENSORS_FILES = [
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
]


@pytest.fixture(scope="module")
def script():
    return load_script("scripts/download_hf_assets.py")


class FakeHub:
    """Stands in for list_repo_files / hf_hub_download, serving files from a local folder."""

    def __init__(self, remote: Path):
        self.remote = remote
        self.list_calls: list[dict] = []
        self.download_calls: list[dict] = []

    def list_repo_files(self, repo_id, *, token=None, **kwargs):
        self.list_calls.append({"repo_id": repo_id, "token": token})
        return sorted(p.relative_to(self.remote).as_posix() for p in self.remote.rglob("*") if p.is_file())

    def hf_hub_download(self, repo_id, filename, *, local_dir, token=None, **kwargs):
        self.download_calls.append({"repo_id": repo_id, "filename": filename, "token": token})
        dest = Path(local_dir) / filename
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.remote / filename, dest)
        return str(dest)

    @property
    def downloaded(self) -> list[str]:
        return sorted(call["filename"] for call in self.download_calls)


def _make_remote(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def hub(script, tmp_path, monkeypatch):
    fake = FakeHub(_make_remote(tmp_path / "remote", REPO_FILES))
    monkeypatch.setattr(script, "list_repo_files", fake.list_repo_files)
    monkeypatch.setattr(script, "hf_hub_download", fake.hf_hub_download)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return fake


def _fake_http_response(status_code: int) -> SimpleNamespace:
    # Enough of a response for HfHubHTTPError.__init__, whichever HTTP client the hub version uses.
    return SimpleNamespace(status_code=status_code, headers={}, request=None)


def _raise(error: Exception):
    def fail(*args, **kwargs):
        raise error

    return fail


def _files_under(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_tokenizer_kind_fetches_exactly_the_present_tokenizer_files_into_repo_named_folder(
    script, hub, tmp_path
):
    local_dir = tmp_path / "assets"

    code = script.main(["--repo_id", REPO_ID, "--assets", "tokenizer", "--local_dir", str(local_dir)])

    assert code == 0
    assert hub.downloaded == TOKENIZER_FILES  # no tokenizer.model at the root, so none asked for
    target = local_dir / "Tiny-Model-1B"
    assert _files_under(local_dir) == [f"Tiny-Model-1B/{name}" for name in TOKENIZER_FILES]
    assert (target / "tokenizer_config.json").read_text() == REPO_FILES["tokenizer_config.json"]


def test_download_returns_the_folder_named_after_the_repo(script, hub, tmp_path):
    target = script.download(REPO_ID, ["config"], tmp_path / "assets", token=None)

    assert target == tmp_path / "assets" / "Tiny-Model-1B"
    assert _files_under(target) == ["config.json"]


def test_hf_token_flag_is_passed_to_every_hub_call(script, hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")

    script.main(
        ["--repo_id", REPO_ID, "--assets", "config", "--local_dir", str(tmp_path), "--hf_token", "hf_flag"]
    )

    tokens = [call["token"] for call in hub.list_calls + hub.download_calls]
    assert len(tokens) == 2  # one listing, one config.json
    assert tokens == ["hf_flag", "hf_flag"]


def test_hf_token_env_var_is_passed_to_every_hub_call_when_no_flag(script, hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")

    script.main(["--repo_id", REPO_ID, "--assets", "tokenizer", "--local_dir", str(tmp_path)])

    tokens = [call["token"] for call in hub.list_calls + hub.download_calls]
    assert len(tokens) == 1 + len(TOKENIZER_FILES)
    assert set(tokens) == {"hf_from_env"}


def test_safetensors_kind_fetches_all_shards_and_the_index(script, hub, tmp_path):
    code = script.main(["--repo_id", REPO_ID, "--assets", "safetensors", "--local_dir", str(tmp_path)])

    assert code == 0
    assert hub.downloaded == SAFETENSORS_FILES
    assert _files_under(tmp_path / "Tiny-Model-1B") == SAFETENSORS_FILES


def test_files_to_fetch_index_kind_selects_only_the_index(script):
    assert script.files_to_fetch(REPO_FILES, ["index"]) == ["model.safetensors.index.json"]


def test_files_to_fetch_unions_kinds_without_duplicates(script):
    selected = script.files_to_fetch(REPO_FILES, ["safetensors", "index", "config"])

    assert selected == ["config.json", *SAFETENSORS_FILES]


def test_files_to_fetch_ignores_files_in_subfolders_for_named_kinds(script):
    repo_files = ["original/tokenizer.model", "original/model.safetensors", "tokenizer.model"]

    assert script.files_to_fetch(repo_files, ["tokenizer", "safetensors"]) == ["tokenizer.model"]


def test_all_flag_fetches_every_file_in_the_repo(script, hub, tmp_path):
    code = script.main(["--repo_id", REPO_ID, "--all", "--local_dir", str(tmp_path)])

    assert code == 0
    assert hub.downloaded == sorted(REPO_FILES)


def test_kind_with_no_matching_file_warns_naming_the_kind(script, hub, tmp_path, capsys):
    (hub.remote / "config.json").unlink()

    code = script.main(
        ["--repo_id", REPO_ID, "--assets", "config", "tokenizer", "--local_dir", str(tmp_path)]
    )

    err = capsys.readouterr().err
    assert code == 0
    assert "warning: no config files" in err
    assert "tokenizer" not in err
    assert hub.downloaded == TOKENIZER_FILES


def test_nothing_to_fetch_exits_2_without_downloading(script, hub, tmp_path, capsys):
    (hub.remote / "config.json").unlink()

    code = script.main(["--repo_id", REPO_ID, "--assets", "config", "--local_dir", str(tmp_path)])

    assert code == 2
    assert "nothing to fetch" in capsys.readouterr().err
    assert hub.download_calls == []


def test_gated_repo_exits_2_with_hf_token_hint_and_no_traceback(script, hub, tmp_path, monkeypatch, capsys):
    error = GatedRepoError("403 Client Error. Cannot access gated repo.", response=_fake_http_response(403))
    monkeypatch.setattr(script, "hf_hub_download", _raise(error))

    code = script.main(["--repo_id", REPO_ID, "--assets", "tokenizer", "--local_dir", str(tmp_path)])

    err = capsys.readouterr().err
    assert code == 2
    assert "HF_TOKEN" in err and "--hf_token" in err
    assert f"https://huggingface.co/{REPO_ID}" in err
    assert "Traceback" not in err
    assert err.strip().count("\n") == 0  # one paragraph


def test_http_403_without_gated_error_class_gives_the_same_token_hint(
    script, hub, tmp_path, monkeypatch, capsys
):
    from huggingface_hub.errors import HfHubHTTPError

    monkeypatch.setattr(
        script, "list_repo_files", _raise(HfHubHTTPError("403 Forbidden", response=_fake_http_response(403)))
    )

    code = script.main(["--repo_id", REPO_ID, "--assets", "config", "--local_dir", str(tmp_path)])

    assert code == 2
    assert "HF_TOKEN" in capsys.readouterr().err


def test_missing_repo_exits_2_and_names_the_repo(script, hub, tmp_path, monkeypatch, capsys):
    error = RepositoryNotFoundError(
        "404 Client Error. Repository Not Found", response=_fake_http_response(404)
    )
    monkeypatch.setattr(script, "list_repo_files", _raise(error))

    code = script.main(
        ["--repo_id", "example-org/No-Such-Model", "--assets", "tokenizer", "--local_dir", str(tmp_path)]
    )

    err = capsys.readouterr().err
    assert code == 2
    assert "repo not found: example-org/No-Such-Model" in err
    assert "Traceback" not in err
    assert hub.download_calls == []


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("[Errno -2] Name or service not known"),
        LocalEntryNotFoundError("Please check your connection and try again."),
    ],
    ids=["connection-error", "local-entry-not-found"],
)
def test_no_network_exits_2_saying_the_hub_is_unreachable(script, hub, tmp_path, monkeypatch, capsys, error):
    monkeypatch.setattr(script, "list_repo_files", _raise(error))

    code = script.main(["--repo_id", REPO_ID, "--assets", "tokenizer", "--local_dir", str(tmp_path)])

    err = capsys.readouterr().err
    assert code == 2
    assert "cannot reach the Hugging Face Hub" in err and "no network" in err
    assert "Traceback" not in err


def test_http_client_connect_error_counts_as_no_network(script, hub, tmp_path, monkeypatch, capsys):
    httpx2 = pytest.importorskip("httpx2")  # the HTTP client of huggingface_hub 2.x
    monkeypatch.setattr(script, "list_repo_files", _raise(httpx2.ConnectError("Name or service not known")))

    code = script.main(["--repo_id", REPO_ID, "--assets", "tokenizer", "--local_dir", str(tmp_path)])

    assert code == 2
    assert "no network" in capsys.readouterr().err


def test_unexpected_error_is_not_swallowed(script, hub, tmp_path, monkeypatch):
    monkeypatch.setattr(script, "list_repo_files", _raise(RuntimeError("bug")))

    with pytest.raises(RuntimeError, match="bug"):
        script.main(["--repo_id", REPO_ID, "--assets", "tokenizer", "--local_dir", str(tmp_path)])


def test_assets_or_all_is_required(script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--repo_id", REPO_ID])

    assert exit_info.value.code == 2
    assert "--assets" in capsys.readouterr().err


def test_a_local_dir_that_is_a_file_is_refused_before_the_hub_is_asked(script, hub, tmp_path, capsys):
    not_a_folder = tmp_path / "assets"
    not_a_folder.touch()
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--repo_id", REPO_ID, "--assets", "tokenizer", "--local_dir", str(not_a_folder)])

    assert exit_info.value.code == 2
    assert "is a file; give a folder" in capsys.readouterr().err
    assert hub.downloaded == []
