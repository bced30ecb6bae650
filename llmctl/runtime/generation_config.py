"""A model's sampling defaults from its `generation_config.json`, read as vLLM reads them.

Owns: `GENERATION_CONFIG_MODES` and `generation_defaults`, the SamplingParams fields that
`--generation-config` puts under a job's flags and rows: `none` (nothing: the caller's own
defaults), `vllm` (vLLM's neutral defaults, which sample at temperature 1), `auto` (those with
the model folder's file over them, as vLLM's default does) or a folder holding a
generation_config.json (read as with auto). The keys read are vLLM's:
temperature, top_p, top_k, min_p, the three penalties, and max_new_tokens (as max_tokens).
`do_sample` is not read (vLLM does not either). A file that does not exist gives nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from llmctl.errors import UsageError

GENERATION_CONFIG_MODES = ("none", "vllm", "auto")
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_new_tokens": "max_tokens",
}
VLLM_DEFAULTS: dict[str, Any] = {"temperature": 1.0}  # where vLLM's defaults differ from a job's


def _read(path: Path) -> dict[str, Any]:
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{file}: cannot read ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{file}: not a JSON object")
    out = {}
    for key, name in SAMPLING_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise UsageError(f"{file}: {key} must be a number, got {value!r}")
        out[name] = value
    return out


def generation_defaults(mode: str, model_path: Path | None) -> dict[str, Any]:
    """The SamplingParams fields `--generation-config mode` sets (`model_path`: the resolved
    model folder, read with `auto`)."""
    if mode == "none":
        return {}
    if mode == "vllm":
        return dict(VLLM_DEFAULTS)
    if mode == "auto":
        return {**VLLM_DEFAULTS, **(_read(model_path) if model_path is not None else {})}
    folder = Path(mode).expanduser()
    if not (folder / "generation_config.json").is_file():
        raise UsageError(
            f"--generation-config {mode}: use auto, vllm, none or a folder that holds "
            f"generation_config.json"
        )
    return {**VLLM_DEFAULTS, **_read(folder)}
