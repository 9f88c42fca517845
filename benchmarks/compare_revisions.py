"""A benchmark script at two git revisions, side by side: the same tables, each cell as
"base | head".

The base revision is checked out in a temporary git worktree; the script then runs, in turns,
in the base tree and in this one (base, head, base, head, ... `--repeats` times each), so that
machine noise falls on both alike. A cell that differs between repeats of one revision shows
the median of the repeats. The tables are the markdown tables the script prints; a row is
matched by its first cell.

    python benchmarks/compare_revisions.py --base REV [--repeats 2] -- \
        benchmarks/activation_checkpoint.py --tables 1,2

Pitfall: each tree runs its own copy of the script, so the comparison holds only while both
copies print the same tables.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HEAD_TREE = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def run_script(tree: Path, argv: list[str]) -> str:
    """The script's standard output when run with `argv` inside `tree`, importing `tree`'s
    torchtitan."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed in {tree}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def tables_of(output: str) -> list[tuple[str, list[list[str]]]]:
    """(title, rows) of each markdown table in `output`; the title is the last non-table line
    before it, the rows include the header and leave out the |---| line."""
    tables, title, rows = [], "", None
    for line in output.splitlines():
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if rows is None:
                rows = []
                tables.append((title, rows))
            if not all(set(cell) <= {"-"} for cell in cells):
                rows.append(cells)
        else:
            rows = None
            title = line or title
    return tables


def _median_cell(cells: list[str]) -> str:
    if all(NUMBER.match(cell) for cell in cells):
        decimals = max(len(cell.partition(".")[2]) for cell in cells)
        return f"{statistics.median(float(cell) for cell in cells):.{decimals}f}"
    return cells[0]


def merged(runs: list[list[tuple[str, list[list[str]]]]]) -> list[tuple[str, list[list[str]]]]:
    """The tables of several runs of one revision, each cell the median of the runs'."""
    out = []
    for index, (title, rows) in enumerate(runs[0]):
        merged_rows = []
        for row_index in range(len(rows)):
            columns = zip(*(run[index][1][row_index] for run in runs))
            merged_rows.append([_median_cell(list(cells)) for cells in columns])
        out.append((title, merged_rows))
    return out


def side_by_side(base, head) -> list[str]:
    """Markdown tables whose cells read "base | head" where the two differ."""
    lines = []
    for (title, base_rows), (_, head_rows) in zip(base, head):
        by_name = {row[0]: row for row in base_rows[1:]}
        header = head_rows[0]
        lines += ["", title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in head_rows[1:]:
            old = by_name.get(row[0], ["?"] * len(row))
            cells = [row[0]] + [b if b == h else f"{b} \\| {h}" for b, h in zip(old[1:], row[1:])]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the git revision to compare this tree with")
    parser.add_argument("--repeats", type=int, default=2, help="runs of the script per revision")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = parser.parse_args()
    script = [a for a in args.script if a != "--"] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("name the benchmark script after --")
    base_sha = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=HEAD_TREE, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    head_sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HEAD_TREE, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        base_tree = Path(folder) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), base_sha], cwd=HEAD_TREE,
                       check=True)  # fmt: skip
        try:
            _check_imports_its_own_tree(base_tree)
            outputs = {"base": [], "head": []}
            for _ in range(args.repeats):
                outputs["base"].append(tables_of(run_script(base_tree, script)))
                outputs["head"].append(tables_of(run_script(HEAD_TREE, script)))
        finally:
            remove = ["git", "worktree", "remove", "--force", str(base_tree)]
            subprocess.run(remove, cwd=HEAD_TREE, check=True)
    dirty = " (with uncommitted changes)" if _dirty() else ""
    runs = f"{args.repeats} runs each, alternating"
    print(f"{' '.join(script)}: base {base_sha} | head {head_sha}{dirty}, {runs}")
    print("\n".join(side_by_side(merged(outputs["base"]), merged(outputs["head"]))))


def _check_imports_its_own_tree(tree: Path) -> None:
    """An editable install of this tree must not shadow the base tree's package."""
    code = "import torchtitan, pathlib; print(pathlib.Path(torchtitan.__file__).resolve().parents[1])"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    found = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
    if Path(found.stdout.strip()) != tree.resolve():
        raise SystemExit(f"the base tree imports torchtitan from {found.stdout.strip()!r}, not {tree}")


def _dirty() -> bool:
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HEAD_TREE,
                            capture_output=True, text=True)  # fmt: skip
    return bool(status.stdout.strip())


if __name__ == "__main__":
    main()
