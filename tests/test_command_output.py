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
