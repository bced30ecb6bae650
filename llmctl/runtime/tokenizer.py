"""The text side of a model: its tokenizer, chat template and end-of-sequence ids.

Owns: `load_tokenizer`, `read_generation_eos`, and `TextCodec` (text <-> token ids and chat
messages -> prompt ids, with a one-line RequestError where the model cannot serve the request).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmctl.engine.requests import validate_messages
from llmctl.errors import ModelLoadError, RequestError
from llmctl.models.config import ModelConfig


def read_generation_eos(path: Path, config: ModelConfig) -> tuple[int, ...]:
    """EOS ids from generation_config.json, falling back to config.json."""
    ids = list(config.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            eos = [eos]
        if eos:
            ids = list(eos)
    return tuple(dict.fromkeys(ids))


def load_tokenizer(path: Path):
    """The model's tokenizer, or None when the folder has none (token-id prompts only)."""
    if not any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    ):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(
            f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})"
        ) from None


class TextCodec:
    """Token ids <-> text through the model's tokenizer (None: token-id prompts only)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._chat_template: Any = None  # compiled on first use

    def _need(self, what: str):
        if self.tokenizer is None:
            raise RequestError(
                "no_tokenizer",
                f"this model has no tokenizer; {what} needs one (use prompt_token_ids)",
            )
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._need("a text prompt").encode(text))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def tool_call_format(self) -> str | None:
        """How the model writes tool calls, where we can read them: "hermes" (Hermes, Qwen:
        `<tool_call>{"name": ..., "arguments": ...}</tool_call>`) when its chat template says so."""
        template = getattr(self.tokenizer, "chat_template", None)
        return "hermes" if isinstance(template, str) and "<tool_call>" in template else None

    def apply_chat_template(self, messages: Any, tools: list | None = None) -> list[int]:
        """Token ids of `messages` in the model's chat template, ending with the assistant's turn,
        with the `tools` the model may call where given.

        The template is user-supplied code: it is rendered by `ChatTemplate` under a time limit and
        size caps (a template that fails or runs past them is a RequestError for this request
        only), then tokenized as transformers' `apply_chat_template` does (no special tokens added:
        the template writes them)."""
        tok = self._need("a chat prompt")
        messages = validate_messages(messages)
        if not getattr(tok, "chat_template", None):
            raise RequestError(
                "no_chat_template",
                "this model has no chat template; send `prompt` instead of `messages`",
            )
        if self._chat_template is None:
            from llmctl.runtime.chat_template import ChatTemplate

            self._chat_template = ChatTemplate(tok)
        text = self._chat_template.render(messages, add_generation_prompt=True, tools=tools)
        return list(tok(text, add_special_tokens=False)["input_ids"])


class TextMethods:
    """encode/decode/apply_chat_template/model_name for a runtime holding `text` (a TextCodec) and
    `model_path`: the part of the runtime protocol every backend shares."""

    text: TextCodec
    model_path: Any

    @property
    def model_name(self) -> str:
        from llmctl.runtime.resolve import DEMO_MODEL_DIR

        return "llmctl-demo" if self.model_path == DEMO_MODEL_DIR else str(self.model_path)

    def encode(self, text: str) -> list[int]:
        return self.text.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.text.decode(ids)

    @property
    def tool_call_format(self) -> str | None:
        return self.text.tool_call_format

    def apply_chat_template(self, messages: Any, tools: list | None = None) -> list[int]:
        return self.text.apply_chat_template(messages, tools)
