"""Reading a recipe file: safe YAML, which syntax it is, its relative paths, command-line values.

Owns: `read_yaml` (yaml.safe_load, one line when the file is missing or not YAML; both recipe
forms are read with it), `syntax_of` (ours when it has `llmctl_recipe: 1`, llm-compressor's when
its top-level keys are `*_stage` mappings, "legacy" for `llmctl sparsify --recipe`'s older
single-run form, `calibration`/`sparsify`/`quantize`), `from_legacy` (that form as two stages),
`resolve_paths` (a relative path in a recipe is read beside the recipe file, so a recipe keeps
working from any folder; a model or student that is not a folder there stays a hub id) and
`set_value` / `parse_set` (`--set stages.quantize.bits=8` and the dedicated flags, applied to
the document before it is validated, so their errors name the key too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmctl.errors import UsageError
from llmctl.recipes.schema import FORMAT_KEY, FORMAT_VERSION, MODEL_KEYS, PATH_KEYS

LEGACY_SECTIONS = ("calibration", "sparsify", "quantize")


def read_yaml(path: Path) -> Any:
    import yaml

    if not path.is_file():
        raise UsageError(f"recipe {path} not found")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise UsageError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text") from None


def syntax_of(doc: Any, path: Path) -> str:
    """ "llmctl", "llm-compressor" or "legacy" (llmctl sparsify --recipe's)."""
    if not isinstance(doc, dict) or not doc:
        raise UsageError(f"{path}: expected a mapping with `{FORMAT_KEY}: {FORMAT_VERSION}`")
    if FORMAT_KEY in doc:
        return "llmctl"
    keys = [str(k) for k in doc]
    if any(k.endswith("_stage") for k in keys):
        return "llm-compressor"
    if set(keys) <= set(LEGACY_SECTIONS) and "sparsify" in keys:
        return "legacy"
    raise UsageError(
        f"{path}: not a recipe llmctl reads: ours starts with `{FORMAT_KEY}: {FORMAT_VERSION}`, "
        "llm-compressor's has `*_stage:` sections (top-level keys here: "
        f"{', '.join(keys[:6])})"
    )


def from_legacy(doc: dict) -> dict:
    """`llmctl sparsify --recipe`'s form as stages: sparsify, then quantize when given."""
    stages = {k: doc[k] for k in ("sparsify", "quantize") if k in doc}
    out = {FORMAT_KEY: FORMAT_VERSION, "stages": stages}
    if "calibration" in doc:
        out["calibration"] = doc["calibration"]
    return out


def _get(doc: dict, key: tuple[str, ...]) -> Any:
    node: Any = doc
    for part in key:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def resolve_paths(doc: dict, base: Path) -> None:
    """Relative file paths of the recipe made absolute against `base` (its folder), in place."""
    for key in PATH_KEYS + MODEL_KEYS:
        value = _get(doc, key)
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
            continue
        beside = (base / value).resolve()
        if key in MODEL_KEYS and not beside.exists():
            continue  # not a folder beside the recipe: a hub id (or a path from here)
        set_value(doc, ".".join(key), str(beside))


def set_value(doc: dict, dotted: str, value: Any) -> None:
    """doc[a][b][c] = value for `a.b.c`, creating the mappings on the way."""
    parts = dotted.split(".")
    if not all(parts):
        raise UsageError(f"--set {dotted}: empty key in the path")
    node = doc
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            where = ".".join(parts[: i + 1])
            raise UsageError(f"--set {dotted}: recipe {where} is not a mapping")
        node = nxt
    node[parts[-1]] = value


def parse_set(item: str) -> tuple[str, Any]:
    """`KEY.PATH=VALUE` -> (key path, the value read as YAML: 8 an integer, true a boolean)."""
    import yaml

    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. stages.quantize.bits=8")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    if isinstance(value, int) and ":" in text:  # YAML 1.1 reads 2:4 as 124 (base 60)
        value = text.strip()
    return key.strip(), value
