"""run-batch's LoRA options, in vLLM's spellings (`--enable-lora`, `--lora-modules`,
`--max-lora-rank`, `--max-loras`): the option record `LoraFlags`.

Owns: the flags' names and help, and `lora_fields`, the `BatchOptions` fields they set (the
adapters by name, and the EngineConfig fields in `engine`); the adapter folders themselves are
read by runtime/lora.py when the job starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from llmctl.errors import UsageError


def _opt(*names: str, help: str, **kw: Any) -> Any:
    return typer.Option(*names, help=help, show_default=False, **kw)


@dataclass(frozen=True)
class LoraFlags:
    """LoRA adapters served beside the base model."""

    enable_lora: Annotated[
        bool,
        _opt(
            "--enable-lora",
            help="Accepted for vLLM command lines: --lora-modules turns adapters on.",
        ),
    ] = False
    lora_modules: Annotated[
        Optional[list[str]],
        _opt(
            "--lora-modules",
            help="NAME=PATH (repeatable; or vLLM's JSON {\"name\": ..., \"path\": ...}): a PEFT "
            "adapter folder (adapter_config.json, adapter_model.safetensors) served as NAME. A row "
            "picks it by its OpenAI body's model, or a simple row's model or lora field; the base "
            "model's name or none: the base; another name: the row's error unknown_model.",
        ),
    ] = None
    max_lora_rank: Annotated[
        Optional[int],
        _opt("--max-lora-rank", min=1, help="The largest adapter rank served (default 16)."),
    ] = None
    max_loras: Annotated[
        Optional[int],
        _opt(
            "--max-loras",
            min=1,
            help="Adapters resident at once (default: as many as --lora-modules; with fewer, rows "
            "of an adapter without a slot wait until one frees).",
        ),
    ] = None


def _module(text: str) -> tuple[str, str]:
    """NAME=PATH or {"name": NAME, "path": PATH} -> (NAME, PATH)."""
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
            return str(obj["name"]), str(obj["path"])
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"--lora-modules {text!r}: JSON needs name and path") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise UsageError(f"--lora-modules {text!r}: give NAME=PATH")
    return name, path


def lora_fields(flags: LoraFlags) -> dict[str, Any]:
    """{'lora_modules': {name: path}, 'engine': EngineConfig fields} where adapters are given."""
    modules: dict[str, str] = {}
    for text in flags.lora_modules or ():
        name, path = _module(text)
        if name in modules:
            raise UsageError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    engine: dict[str, Any] = {}
    if flags.max_lora_rank is not None:
        engine["max_lora_rank"] = flags.max_lora_rank
    if flags.max_loras is not None:
        engine["max_loras"] = flags.max_loras
    if engine and not modules:
        raise UsageError("--max-lora-rank and --max-loras are for --lora-modules")
    return {"lora_modules": modules, "engine": engine} if modules else {}
