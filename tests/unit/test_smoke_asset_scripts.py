"""The scripts that rebuild the bundled smoke corpus and tokenizer: bad arguments exit 2 with a
message naming the option, not a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.parametrize(
    "script, argv, named",
    [
        ("train_smoke_tokenizer.py", ["--corpus", "no_such.jsonl"], "--corpus no_such.jsonl is not a file"),
        ("train_smoke_tokenizer.py", ["--vocab-size", "100"], "--vocab-size 100 is below 259"),
        ("train_smoke_tokenizer.py", ["--out-dir", "{file}"], "is a file; give a folder"),
        ("make_smoke_corpus.py", ["--out-dir", "{file}"], "is a file; give a folder"),
    ],
)
def test_bad_arguments_exit_2_naming_the_option(tmp_path, script, argv, named):
    a_file = tmp_path / "a_file"
    a_file.touch()
    argv = [arg.replace("{file}", str(a_file)) for arg in argv]
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *argv], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and named in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written
