"""The limits of one chat-template render and the size estimates checked against them.

Owns: `TemplateLimits` (what one render may cost), `Budget` (those limits and what a render has
used so far: deadline, per-value cap, total cap, integer bits), `units` (the size of a value) and
the estimates: an upper bound on what an operation (a binary operator, a string method, a jinja
filter, a format) returns, computed before it runs. The sandbox that calls them is
`runtime/template_sandbox.py`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

_CONTAINERS = (list, tuple, set, frozenset)


@dataclass(frozen=True)
class TemplateLimits:
    """What one render may cost. The caps grow with the input, so any prompt fits."""

    time_s: float = 1.0  # wall time of one render
    min_chars: int = 1 << 20  # output and value cap for a small input, in characters
    chars_per_input_char: int = 4  # ...plus this many per character of the messages
    total_factor: int = 16  # all values the operations build: this many caps
    work_factor: int = 10  # steps of a quadratic filter (sum, striptags): this many totals
    int_bits: int = 1 << 14  # largest integer a template may compute
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)


class TemplateLimitError(Exception):
    """A render went past one of its limits (raised inside the sandbox, caught by `render`)."""


class Budget:
    """The limits of one render and what it has used so far."""

    def __init__(self, limits: TemplateLimits, input_chars: int):
        self.max_chars = limits.min_chars + limits.chars_per_input_char * input_chars
        self.max_total = limits.total_factor * self.max_chars
        self.max_work = limits.work_factor * self.max_total
        self.int_bits = limits.int_bits
        self.used = 0
        self._limits = limits
        self._deadline = limits.clock() + limits.time_s

    def tick(self) -> None:
        if self._limits.clock() > self._deadline:
            raise TemplateLimitError(f"it ran longer than {self._limits.time_s:g} s")

    def allow(self, estimate: int, work: int = 0) -> None:
        """Refuse an operation whose result (or work) would exceed the caps, before it runs."""
        if estimate > self.max_chars:
            raise TemplateLimitError(
                f"an operation would build about {estimate:,} characters "
                f"(the limit is {self.max_chars:,})"
            )
        if work > self.max_work:
            raise TemplateLimitError(
                f"an operation would take about {work:,} steps (the limit is {self.max_work:,})"
            )

    def account(self, value: Any) -> Any:
        """Measure a value an operation built; returns it unchanged."""
        if isinstance(value, int) and value.bit_length() > self.int_bits:
            raise TemplateLimitError(f"an integer has more than {self.int_bits:,} bits")
        size = units(value, self.max_chars)
        if size > self.max_chars:
            raise TemplateLimitError(f"a value is larger than {self.max_chars:,} characters")
        self.used += len(value) if isinstance(value, (str, bytes, dict, *_CONTAINERS)) else 1
        if self.used > self.max_total:
            raise TemplateLimitError(
                f"the template built more than {self.max_total:,} characters in all"
            )
        return value


def units(value: Any, limit: int) -> int:
    """Size of a value: characters of a string, 1 per other object, containers counted through
    (an element shared n times counts n times, as it would once printed); stops past `limit`."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
            continue
        total += 1
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, _CONTAINERS):
            stack.extend(v)
    return total


def _depth(value: Any, limit: int = 64) -> int:
    """Nesting depth of containers (at most `limit`), for the indentation json/pprint add."""
    if limit <= 0 or not isinstance(value, (dict, *_CONTAINERS)):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in items), default=0)


# ---------------------------------------------------------------------------------------------
# Estimates: an upper bound on the size of what an operation returns, before it runs


_WIDTH = re.compile(r"\d+")


def format_estimate(fmt: str, values: list, budget: Budget, marker: str) -> int:
    """`fmt % values` or `fmt.format(*values)`: every field may be padded to the widest width
    written in the format or passed as an argument, and may print the largest argument."""
    fields = fmt.count(marker)
    if not fields:
        return len(fmt)
    digits = _WIDTH.findall(fmt)
    if any(len(w) > 18 for w in digits):
        return budget.max_chars + 1  # a width of 10**18 or more: no need to read it
    widths = [int(w) for w in digits] + [v for v in values if isinstance(v, int)]
    largest = max((units(v, budget.max_chars) for v in values), default=0)
    return len(fmt) + fields * (max(widths, default=0) + largest)


def _values_of(args: Any) -> list:
    if isinstance(args, dict):
        return list(args.values())
    return list(args) if isinstance(args, tuple) else [args]


def binop_estimate(op: str, left: Any, right: Any, budget: Budget) -> int:
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "*" and ints:
        if left.bit_length() + right.bit_length() > budget.int_bits:
            raise TemplateLimitError(f"an integer would have more than {budget.int_bits:,} bits")
    elif op == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(n, int) and isinstance(seq, (str, bytes, list, tuple)):
            return units(seq, budget.max_chars) * max(n, 0)
    elif op == "**" and ints and right > 0 and abs(left) > 1:
        if (left.bit_length() - 1) * right > budget.int_bits:
            raise TemplateLimitError(f"an integer would have more than {budget.int_bits:,} bits")
    elif op == "%" and isinstance(left, str):
        return format_estimate(left, _values_of(right), budget, "%")
    return 0


def _replace_estimate(s: str, old: Any, new: Any, count: Any) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * len(new)


def _join_estimate(sep: Any, items: list, budget: Budget) -> int:
    return units(items, budget.max_chars) + len(items) * len(str(sep))


def method_estimate(obj: Any, args: tuple, kwargs: dict, budget: Budget) -> int:
    """Python string methods that can return much more than they are given."""
    target, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(target, (str, bytes)):
        return 0
    a = list(args) + list(kwargs.values())
    if name in ("center", "ljust", "rjust", "zfill") and a and isinstance(a[0], int):
        return max(len(target), a[0])
    if name == "expandtabs":
        return len(target) * max(1, a[0] if a and isinstance(a[0], int) else 8)
    if name == "replace" and len(a) >= 2:
        return _replace_estimate(target, a[0], a[1], a[2] if len(a) > 2 else None)
    if name == "join" and len(args) == 1 and isinstance(args[0], (list, tuple)):
        return _join_estimate(target, list(args[0]), budget)
    if name == "translate" and a and isinstance(a[0], dict):
        longest = max((len(v) for v in a[0].values() if isinstance(v, str)), default=1)
        return len(target) * max(1, longest)
    return 0


def _arg(bound: dict, name: str, default: Any = None) -> Any:
    return bound.get(name, default)


def _text_len(v: Any) -> int:
    return len(v) if isinstance(v, str) else 0


def filter_estimate(name: str, value: Any, bound: dict, budget: Budget) -> tuple[int, int]:
    """(result size, work) of the jinja filters that can return much more than they are given."""
    size = units(value, budget.max_chars)
    if name == "center":
        return max(size, _arg(bound, "width", 80)), 0
    if name == "indent":
        width = _arg(bound, "width", 4)
        per_line = width if isinstance(width, int) else _text_len(width)
        return size + (str(value).count("\n") + 1) * per_line, 0
    if name == "wordwrap":
        return size * (1 + max(1, _text_len(_arg(bound, "wrapstring")))), 0
    if name == "truncate":
        return size + _text_len(_arg(bound, "end")), 0
    if name == "urlize":
        extra = _text_len(_arg(bound, "target")) + _text_len(_arg(bound, "rel"))
        return size * (4 + extra), 0
    if name == "format":
        args = _arg(bound, "kwargs") or _arg(bound, "args") or ()
        return format_estimate(str(value), _values_of(args), budget, "%"), 0
    if name == "replace":
        return _replace_estimate(
            str(value), _arg(bound, "old"), _arg(bound, "new"), _arg(bound, "count")
        ), 0
    if name == "join":
        return _join_estimate(_arg(bound, "d", ""), value, budget), 0
    if name in ("batch", "slice"):
        n = _arg(bound, "linecount", _arg(bound, "slices", 0))
        return 2 * size + n * (1 + units(_arg(bound, "fill_with"), budget.max_chars)), 0
    if name in ("tojson", "pprint"):
        indent = _arg(bound, "indent") or 1
        per_level = indent if isinstance(indent, int) else _text_len(indent)
        seps = sum(_text_len(s) for s in _arg(bound, "separators") or ())
        return size * (10 + seps + per_level * _depth(value)), 0
    if name == "sum" and not isinstance(_arg(bound, "start", 0), (int, float)):
        return 0, len(value) * size  # adding lists or strings one by one: quadratic
    if name == "striptags":
        return 0, size * min(str(value).count("<"), str(value).count(">"))
    return 0, 0


MATERIALISED = ("join", "sum")  # filters given an iterator: materialised first, to be measured


__all__ = [
    "Budget",
    "MATERIALISED",
    "TemplateLimitError",
    "TemplateLimits",
    "binop_estimate",
    "filter_estimate",
    "format_estimate",
    "method_estimate",
    "units",
]
