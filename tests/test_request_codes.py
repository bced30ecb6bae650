"""One set of request error codes: every code the package raises is in ERROR_CODES, and the
README's table lists exactly those codes."""

import re
from pathlib import Path

from llmctl.engine.requests import ERROR_CODES

ROOT = Path(__file__).resolve().parent.parent


def test_every_raised_code_is_known():
    raised = set()
    for path in (ROOT / "llmctl").rglob("*.py"):
        text = path.read_text()
        raised |= set(re.findall(r'(?:RequestError|_err)\(\s*"([a-z0-9_]+)"', text))
    assert raised and raised <= set(ERROR_CODES), sorted(raised - set(ERROR_CODES))


def test_readme_table_lists_exactly_the_codes():
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    listed = {code for line in rows for code in re.findall(r"`([a-z0-9_]+)`", line.split("|")[1])}
    assert listed == set(ERROR_CODES)
