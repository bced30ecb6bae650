"""The bounded Jinja sandbox a chat template is compiled in.

Owns: `LimitedSandbox` (transformers' chat-template sandbox with every operation measured against
the render's `Budget`), its code generator (a deadline check in every block, `~` results
measured), the filter wrappers, and `build_environment` (transformers' options, filters, globals
and extensions on a `LimitedSandbox`). What is measured and how is in `runtime/chat_template.py`'s
module doc; the limits and estimates are in `runtime/template_limits.py`.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
from typing import Any, Callable

from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmctl.runtime.template_limits import (
    MATERIALISED,
    Budget,
    TemplateLimitError,
    binop_estimate,
    filter_estimate,
    format_estimate,
    method_estimate,
)


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

    def budget(self) -> Budget:
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
        budget.allow(binop_estimate(operator, left, right, budget))
        return budget.account(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = __self.budget()
        budget.tick()
        if isinstance(__obj, types.BuiltinMethodType):  # 'x'.center(n), (1).to_bytes(n)...
            check_int_args(args, kwargs, budget)
        if (
            getattr(__obj, "__name__", "") == "join"
            and args
            and not isinstance(args[0], (list, tuple, str))
        ):
            args = (list(args[0]), *args[1:])
        budget.allow(
            method_estimate(__obj, args, kwargs, budget) + _lipsum_estimate(__obj, args, kwargs)
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
            budget.allow(format_estimate(fmt, values, budget, "{"))
            return wrapper(*args, **kwargs)

        return checked_format


def check_int_args(args: tuple, kwargs: dict, budget: Budget) -> None:
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
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        signature = None
    passes_context = getattr(func, "jinja_pass_arg", None) is not None

    @functools.wraps(func)
    def checked(*args: Any, **kwargs: Any) -> Any:
        budget = env.budget()
        budget.tick()
        check_int_args(args, kwargs, budget)
        skip = 1 if passes_context else 0
        if (
            name in MATERIALISED
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
                budget.allow(*filter_estimate(name, args[skip], bound, budget))
        return budget.account(func(*args, **kwargs))

    return checked


def _transformers_environment():
    """transformers' chat-template sandbox: its options, filters, globals and extensions. Taken
    from an empty template: compiling the model's own there would fold its constant expressions
    (`'x' * 10**9`, `10 ** 10**8`) at compile time, outside every limit."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template("").environment


def build_environment():
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


__all__ = ["LimitedSandbox", "build_environment", "check_int_args"]
