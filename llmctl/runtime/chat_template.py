"""Rendering a model's chat template, which is user-supplied code, under limits.

Owns: `ChatTemplate` (a tokenizer's Jinja chat template compiled in a bounded sandbox) and
`TemplateLimits`. The sandbox is transformers' own (its filters, globals and extensions, so a
normal template renders the same text as `tokenizer.apply_chat_template`), made bounded:

- time: a deadline checked on entering every template block (each loop iteration, macro call
  and branch), at every intercepted operation and between output chunks;
- output: consumed chunk by chunk from `Template.generate`, up to a character cap;
- values: every value an operation builds (`+ - * / // % **`, `~`, calls, filters, the joins of
  `{% set %}`/macro buffers) is measured against the same cap, before the operation wherever its
  result can be much larger than its operands (repetition, powers, padding widths, `replace`,
  `join`, format widths, `indent`, `batch`...) and after it otherwise; integers are capped in
  bits; and the sum of everything the operations built is capped, so no loop accumulates more.

No single operation is then larger than the cap, and none runs long between two checks. A render
that fails raises RequestError("chat_template_error"); one past a limit raises
RequestError("chat_template_limit").
"""

from __future__ import annotations

import functools
import re
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable

from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmctl.errors import RequestError

_CONTAINERS = (list, tuple, set, frozenset)
_MESSAGE_CHARS = 300  # longest template error message kept in an error row


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


class _Budget:
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


def _format_estimate(fmt: str, values: list, budget: _Budget, marker: str) -> int:
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


def _binop_estimate(op: str, left: Any, right: Any, budget: _Budget) -> int:
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
        return _format_estimate(left, _values_of(right), budget, "%")
    return 0


def _replace_estimate(s: str, old: Any, new: Any, count: Any) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * len(new)


def _join_estimate(sep: Any, items: list, budget: _Budget) -> int:
    return units(items, budget.max_chars) + len(items) * len(str(sep))


def _method_estimate(obj: Any, args: tuple, kwargs: dict, budget: _Budget) -> int:
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


def _filter_estimate(name: str, value: Any, bound: dict, budget: _Budget) -> tuple[int, int]:
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
        return _format_estimate(str(value), _values_of(args), budget, "%"), 0
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


_MATERIALISED = ("join", "sum")  # filters given an iterator: materialised first, to be measured


# ---------------------------------------------------------------------------------------------
# The sandbox


class CheckedCodeGenerator(CodeGenerator):
    """Compiles templates with a deadline check in every block and `~` results measured."""

    def blockvisit(self, nodes, frame) -> None:
        self.writeline("environment.tick()")
        super().blockvisit(nodes, frame)

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.account(")
        super().visit_Concat(node, frame)
        self.write(")")


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox, with every operation measured (module doc)."""

    code_generator_class = CheckedCodeGenerator
    intercepted_binops = frozenset(("+", "-", "*", "/", "//", "%", "**"))

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._local = threading.local()

    def budget(self) -> _Budget:
        budget = getattr(self._local, "budget", None)
        if budget is None:
            raise TemplateLimitError("rendered outside ChatTemplate.render")
        return budget

    def tick(self) -> None:
        self.budget().tick()

    def account(self, value: Any) -> Any:
        budget = self.budget()
        budget.tick()
        return budget.account(value)

    def concat(self, parts: list) -> str:  # joins the buffers of {% set %} blocks and macros
        budget = self.budget()
        budget.allow(sum(len(p) for p in parts))
        return budget.account("".join(parts))

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = self.budget()
        budget.tick()
        budget.allow(_binop_estimate(operator, left, right, budget))
        return budget.account(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = __self.budget()
        budget.tick()
        if isinstance(__obj, types.BuiltinMethodType):  # 'x'.center(n), (1).to_bytes(n)...
            _check_int_args(args, kwargs, budget)
        if (
            getattr(__obj, "__name__", "") == "join"
            and args
            and not isinstance(args[0], (list, tuple, str))
        ):
            args = (list(args[0]), *args[1:])
        budget.allow(
            _method_estimate(__obj, args, kwargs, budget) + _lipsum_estimate(__obj, args, kwargs)
        )
        return budget.account(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any):
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt = value.__self__

        def checked_format(*args: Any, **kwargs: Any) -> str:
            budget = self.budget()
            values = list(args) + list(kwargs.values())
            if len(args) == 1 and isinstance(args[0], dict) and value.__name__ == "format_map":
                values = list(args[0].values())
            budget.allow(_format_estimate(fmt, values, budget, "{"))
            return wrapper(*args, **kwargs)

        return checked_format


def _check_int_args(args: tuple, kwargs: dict, budget: _Budget) -> None:
    """A width, count or length argument larger than the cap is refused whatever it sizes (for
    filters and Python's built-in methods, whose integer arguments are such sizes)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > budget.max_chars:
            shown = f"{v:,}" if v.bit_length() < 64 else f"about 2**{v.bit_length() - 1}"
            raise TemplateLimitError(
                f"an argument of {shown} is larger than the limit ({budget.max_chars:,})"
            )


def _lipsum_estimate(obj: Any, args: tuple, kwargs: dict) -> int:
    if getattr(obj, "__name__", "") != "generate_lorem_ipsum":
        return 0
    n = args[0] if args else kwargs.get("n", 5)
    most = args[3] if len(args) > 3 else kwargs.get("max", 100)
    return (n if isinstance(n, int) else 0) * (most if isinstance(most, int) else 0) * 16


def _checked_filter(env: Any, name: str, func: Callable) -> Callable:
    """`func` with its result measured and, for the filters that amplify, its size estimated."""
    import inspect

    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        signature = None
    passes_context = getattr(func, "jinja_pass_arg", None) is not None

    @functools.wraps(func)
    def checked(*args: Any, **kwargs: Any) -> Any:
        budget = env.budget()
        budget.tick()
        _check_int_args(args, kwargs, budget)
        skip = 1 if passes_context else 0
        if (
            name in _MATERIALISED
            and len(args) > skip
            and not isinstance(args[skip], (list, tuple, str, dict))
        ):
            args = (*args[:skip], list(args[skip]), *args[skip + 1 :])
        if signature is not None and len(args) > skip:
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError:
                bound = None  # the call itself raises the TypeError, with jinja's message
            if bound is not None:
                budget.allow(*_filter_estimate(name, args[skip], bound, budget))
        return budget.account(func(*args, **kwargs))

    return checked


def _transformers_environment():
    """transformers' chat-template sandbox: its options, filters, globals and extensions. Taken
    from an empty template: compiling the model's own there would fold its constant expressions
    (`'x' * 10**9`, `10 ** 10**8`) at compile time, outside every limit."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template("").environment


def _build_environment():
    base = _transformers_environment()
    env = LimitedSandbox(
        trim_blocks=base.trim_blocks,
        lstrip_blocks=base.lstrip_blocks,
        keep_trailing_newline=base.keep_trailing_newline,
        autoescape=base.autoescape,
        extensions=[type(e) for e in base.extensions.values()],
    )
    env.globals.update(base.globals)
    env.tests.update(base.tests)
    env.filters.update({name: _checked_filter(env, name, f) for name, f in base.filters.items()})
    return env


def _request_error(e: Exception) -> RequestError:
    """What a failed render tells the user (the template's own raise_exception: its message)."""
    if isinstance(e, TemplateLimitError):
        return RequestError("chat_template_limit", f"the chat template was stopped: {e}")
    if isinstance(e, MemoryError):
        return RequestError("chat_template_limit", "the chat template ran out of memory")
    if isinstance(e, RecursionError):
        return RequestError("chat_template_error", "the chat template nests too deeply")
    text = str(e) if type(e).__name__ == "TemplateError" else f"{type(e).__name__}: {e}"
    return RequestError("chat_template_error", f"the chat template failed: {_short(text)}")


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


class ChatTemplate:
    """A tokenizer's chat template, compiled once, rendered per request under `limits`."""

    def __init__(self, tokenizer: Any, limits: TemplateLimits = TemplateLimits()):
        self.limits = limits
        self._variables = {
            k: v if isinstance(v, (str, list)) else str(v)
            for k, v in dict(tokenizer.special_tokens_map).items()
        }
        self._template: Any = None
        self._error: RequestError | None = None
        try:
            source = tokenizer.get_chat_template()
            self._env = _build_environment()
            self._template = self._env.from_string(source)
        except Exception as e:  # a template that does not compile fails every chat row alike
            self._error = RequestError(
                "chat_template_error",
                f"the model's chat template cannot be used: {_short(f'{type(e).__name__}: {e}')}",
            )

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ({role, content} dicts of strings)."""
        if self._error is not None:
            raise self._error
        budget = _Budget(self.limits, sum(len(m["role"]) + len(m["content"]) for m in messages))
        self._env._local.budget = budget
        try:
            return self._generate(messages, add_generation_prompt, budget)
        except Exception as e:
            raise _request_error(e) from None
        finally:
            self._env._local.budget = None

    def _generate(self, messages: list[dict], add_generation_prompt: bool, budget: _Budget) -> str:
        parts, size = [], 0
        stream = self._template.generate(
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._variables,
        )
        for chunk in stream:
            size += len(chunk)
            if size > budget.max_chars:
                raise TemplateLimitError(f"its output passed {budget.max_chars:,} characters")
            budget.tick()
            parts.append(chunk)
        return "".join(parts)


__all__ = ["ChatTemplate", "TemplateLimits", "TemplateLimitError", "units"]
