"""Which model serves a run-batch row: the base model or one of the job's LoRA adapters.

Owns: `pick_adapter`, the rule a row's `model` / `lora` names follow (vLLM's OpenAI server and
Ray Data LLM's `model` column): a simple row's `lora` names an adapter; a `model` (OpenAI
body.model, a simple row's model) names an adapter or the base model; nothing is the base. In a
job without adapters `model` is ignored, as it always was (OpenAI batch files name e.g. gpt-4o).
An unknown name is the row's `unknown_model`.
"""

from __future__ import annotations

from llmctl.errors import RequestError


def pick_adapter(
    model: str | None, lora: str | None, adapters: tuple[str, ...], base_names: tuple[str, ...]
) -> str | None:
    """The adapter's name for a row naming `model` and `lora`, or None for the base model."""
    if lora is not None:
        name, field = lora, "lora"
    elif model is not None and adapters:
        name, field = model, "model"
    else:
        return None
    if name in adapters:
        return name
    if name in base_names:
        return None
    known = ", ".join(repr(a) for a in adapters) or "none"
    raise RequestError(
        "unknown_model",
        f"{field} {name!r} is neither the base model nor one of the LoRA adapters "
        f"(adapters: {known}; the base model: {' / '.join(map(repr, base_names)) or 'no name'})",
    )
