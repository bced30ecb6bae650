"""Rendering a model's chat template, which is user-supplied code, under limits.

Owns: `ChatTemplate` (a tokenizer's Jinja chat template compiled in a bounded sandbox), the
errors a render raises. The sandbox (`runtime/template_sandbox.py`) is transformers' own (its
filters, globals and extensions, so a normal template renders the same text as
`tokenizer.apply_chat_template`), made bounded (limits and estimates: `runtime/template_limits.py`):

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

import json
from typing import Any

from llmctl.errors import RequestError
from llmctl.runtime.template_limits import Budget, TemplateLimitError, TemplateLimits, units
from llmctl.runtime.template_sandbox import build_environment

_MESSAGE_CHARS = 300  # longest template error message kept in an error row


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
            self._env = build_environment()
            self._template = self._env.from_string(source)
        except Exception as e:  # a template that does not compile fails every chat row alike
            self._error = RequestError(
                "chat_template_error",
                f"the model's chat template cannot be used: {_short(f'{type(e).__name__}: {e}')}",
            )

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        """The prompt text for `messages` ({role, content} dicts of strings) and, where given,
        the `tools` the model may call (OpenAI's function objects, as transformers passes them)."""
        if self._error is not None:
            raise self._error
        size = sum(len(m["role"]) + len(m["content"]) for m in messages)
        budget = Budget(self.limits, size + (len(json.dumps(tools)) if tools else 0))
        self._env._local.budget = budget
        try:
            return self._generate(messages, add_generation_prompt, budget, tools)
        except Exception as e:
            raise _request_error(e) from None
        finally:
            self._env._local.budget = None

    def _generate(
        self, messages: list[dict], add_generation_prompt: bool, budget: Budget, tools=None
    ) -> str:
        parts, size = [], 0
        stream = self._template.generate(
            messages=[dict(m) for m in messages],
            tools=tools,
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
