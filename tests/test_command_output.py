"""Long commands report progress as plain lines when stderr is not a terminal (logs, CI), and
print nothing but warnings with --quiet."""

from __future__ import annotations

import re

from llmctl.cli import main
from llmctl.runtime.resolve import DEMO_MODEL_DIR

DEMO = str(DEMO_MODEL_DIR)


def _quantize(tmp_path, *extra):
    return main(
        [
            "quantize",
            DEMO,
            "-o",
            str(tmp_path / "q"),
            "--rtn",
            "--num-samples",
            "2",
            "--seq-len",
            "32",
            *extra,
        ]
    )


def test_quantize_progress_is_plain_lines_off_a_terminal(tmp_path, capsys):
    assert _quantize(tmp_path) == 0
    err = capsys.readouterr().err
    lines = re.findall(r"^rtn layers: (\d+)/(\d+)$", err, re.M)
    assert lines and lines[-1][0] == lines[-1][1]  # counts up to the number of layers
    assert "\x1b[" not in err  # no terminal control codes in a log


def test_sparsify_progress_is_plain_lines_and_quiet_is_quiet(tmp_path, capsys):
    assert (
        main(
            [
                "sparsify",
                DEMO,
                "-o",
                str(tmp_path / "s"),
                "--method",
                "magnitude",
                "--pattern",
                "2:4",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert re.search(r"^magnitude 2:4: (\d+)/\1$", err, re.M)
    assert (
        main(
            [
                "sparsify",
                DEMO,
                "-o",
                str(tmp_path / "s2"),
                "--method",
                "magnitude",
                "--pattern",
                "2:4",
                "--quiet",
            ]
        )
        == 0
    )
    assert not re.search(r": \d+/\d+$", capsys.readouterr().err, re.M)


def test_report_json_of_maps_an_old_spelling_with_one_warning(capsys):
    import pytest

    from llmctl.commands._output import json_to_stdout, report_json_of
    from llmctl.errors import UsageError

    assert report_json_of(None, None, "--json", "--report-json") is None
    assert report_json_of("r.json", None, "--json", "--report-json") == "r.json"
    assert capsys.readouterr().err == ""
    assert report_json_of(None, "old.json", "--json", "--report-json") == "old.json"
    assert capsys.readouterr().err.strip() == (
        "llmctl: warning: --json is deprecated; use --report-json"
    )
    with pytest.raises(UsageError, match="pass only one"):
        report_json_of("a.json", "b.json", "--json", "--report-json")
    assert json_to_stdout("-") and not json_to_stdout("a.json") and not json_to_stdout(None)


def test_emit_json_writes_stdout_for_dash_and_a_file_otherwise(tmp_path, capsys):
    import json

    from llmctl.commands._output import emit_json

    emit_json("-", {"a": 1})
    assert json.loads(capsys.readouterr().out) == {"a": 1}
    emit_json(tmp_path / "r.json", {"b": 2})
    emit_json(None, {"c": 3})
    assert json.loads((tmp_path / "r.json").read_text()) == {"b": 2}
    assert capsys.readouterr().out == ""


def test_tables_go_to_stderr_when_stdout_carries_json(capsys):
    from llmctl.commands._output import info, print_table

    print_table("T", [("k", "v")], stderr=True)
    info("quiet line", quiet=True)
    info("progress line")
    captured = capsys.readouterr()
    assert captured.out == "" and "k" in captured.err and "progress line" in captured.err
    assert "quiet line" not in captured.err
    print_table("Cols", [("1", "x")], ("n", "name"), left=("name",))
    out = capsys.readouterr().out
    assert "Cols" in out and "name" in out and "x" in out
