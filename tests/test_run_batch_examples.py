"""The run-batch examples of `--help` and of the README run, in the order written, on the embedded
demo model, in a fresh folder holding only `examples/prompts.jsonl` (as a fresh checkout does)."""

from __future__ import annotations

import io
import json
import re
import shlex
import shutil
import types
from pathlib import Path

from llmctl.cli import main

ROOT = Path(__file__).resolve().parent.parent


def help_examples(capsys) -> list[str]:
    assert main(["run-batch", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if "Examples" in line) + 1
    examples = []
    for line in lines[start:]:
        line = line.strip(" │")  # rich draws the epilog in a box on some terminals
        if not line:
            break
        examples.append(line)
    return examples


def readme_examples() -> list[str]:
    """The first command of the set-up line, then the bash block of the run-batch section."""
    text = (ROOT / "README.md").read_text()
    setup = re.search(r"pip install -e \. && (llmctl run-batch [^\n]+)", text).group(1)
    section = text[text.index("## run-batch") :]
    block = section[section.index("```bash") + len("```bash") :]
    return [setup] + [line for line in block[: block.index("```")].strip().splitlines()]


def run_example(line: str, monkeypatch) -> int:
    """A shell line of the forms `llmctl ...`, `head -N FILE | llmctl ...` and `... > FILE`."""
    words = shlex.split(line)
    stdin, stdout_path = b"", None
    if "|" in words:
        pipe = words.index("|")
        head, words = words[:pipe], words[pipe + 1 :]
        assert head[0] == "head" and head[1].startswith("-"), line
        stdin = b"".join(Path(head[2]).read_bytes().splitlines(keepends=True)[: int(head[1][1:])])
    if ">" in words:
        stdout_path, words = Path(words[words.index(">") + 1]), words[: words.index(">")]
    assert words[0] == "llmctl", line
    sink = io.BytesIO()
    with monkeypatch.context() as m:
        m.setattr("sys.stdin", types.SimpleNamespace(buffer=io.BytesIO(stdin)))
        m.setattr(
            "sys.stdout",
            types.SimpleNamespace(buffer=sink, write=lambda s: None, flush=lambda: None),
        )
        rc = main(words[1:])
    if stdout_path is not None:
        stdout_path.write_bytes(sink.getvalue())
    return rc


def test_help_and_readme_examples_run_in_order_on_a_fresh_checkout(tmp_path, capsys, monkeypatch):
    examples = help_examples(capsys)
    readme = readme_examples()
    assert readme[1:] == examples  # the README shows the same run-batch examples
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "prompts.jsonl", tmp_path / "examples" / "prompts.jsonl")
    n_prompts = len((tmp_path / "examples" / "prompts.jsonl").read_bytes().splitlines())
    monkeypatch.chdir(tmp_path)
    for line in readme:
        assert run_example(line, monkeypatch) == 0, (line, capsys.readouterr().err)
    for out in (
        tmp_path / "out.jsonl",
        tmp_path / "examples" / "prompts.out.jsonl",
        tmp_path / "out-short.jsonl",
    ):
        rows = [json.loads(line) for line in out.read_bytes().splitlines()]
        assert len(rows) == n_prompts and all(r["error"] is None for r in rows)
    assert len((tmp_path / "out-head.jsonl").read_bytes().splitlines()) == 2
    assert json.loads((tmp_path / "s.json").read_text())["rows"] == n_prompts  # --report-json

    import pyarrow.parquet as pq

    for out in ("out.parquet", "out.out.parquet"):  # the last example reads the Parquet output
        assert pq.read_table(str(tmp_path / out)).num_rows == n_prompts
