"""Resume state of the layer-by-layer calibration driver: safetensors plus JSON, never pickle.

Owns the files in a job's resume folder and their checks, for quantize and sparsify alike:
  layer_<i>.safetensors  layer i's weights after processing (`state/...`) and the tensors of its
                         records (`rec/...`)
  layer_<i>.json         the records' structure (dataclass fields, numbers, strings)
  hidden.safetensors     the next layer's inputs
  progress.json          {"format", "fingerprint", "done_layers"}, written last
Every file is written to a temporary name and renamed. Records are rebuilt only as the dataclasses
in `_record_types` (an allow-list: a file cannot name any other type). `load` checks everything
(headers, shapes, keys, JSON) before it changes a layer; anything wrong makes it start over with a
warning (`CorruptCheckpoint`), so a damaged folder never causes a crash loop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from llmctl.runtime.tensors import save_safetensors

FORMAT = 1  # progress.json "format"; folders without it come from older (pickle) versions


class CorruptCheckpoint(Exception):
    """A resume file that is missing, unreadable or does not fit the model."""


def _record_types() -> dict[str, type]:
    from llmctl.compress.records import LayerSparsity, LinearRecord
    from llmctl.runtime.formats.spec import QuantResult, QuantSpec

    return {c.__name__: c for c in (LinearRecord, QuantResult, QuantSpec, LayerSparsity)}


def _encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().to("cpu").contiguous().clone()
        return {"tensor": key}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "type": type(value).__name__,
            "fields": {
                f.name: _encode(getattr(value, f.name), f"{key}.{f.name}", tensors)
                for f in dataclasses.fields(value)
            },
        }
    if isinstance(value, (tuple, list)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {kind: [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(f"cannot checkpoint a {type(value).__name__}")


def _decode(node: Any, tensors: dict[str, torch.Tensor], types: dict[str, type]) -> Any:
    if not isinstance(node, dict) or len(node) not in (1, 2):
        raise CorruptCheckpoint("malformed record")
    if "tensor" in node:
        if node["tensor"] not in tensors:
            raise CorruptCheckpoint(f"record tensor {node['tensor']!r} missing")
        return tensors[node["tensor"]]
    if "dtype" in node:
        dtype = getattr(torch, str(node["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpoint(f"unknown dtype {node['dtype']!r}")
        return dtype
    if "type" in node:
        cls = types.get(node["type"])
        if cls is None or not isinstance(node.get("fields"), dict):
            raise CorruptCheckpoint(f"record type {node['type']!r} is not one llmctl writes")
        try:
            return cls(**{k: _decode(v, tensors, types) for k, v in node["fields"].items()})
        except (TypeError, ValueError) as e:
            raise CorruptCheckpoint(f"record {node['type']}: {e}") from None
    for kind, make in (("tuple", tuple), ("list", list)):
        if kind in node and isinstance(node[kind], list):
            return make(_decode(v, tensors, types) for v in node[kind])
    value = node.get("value")
    if "value" in node and (value is None or isinstance(value, (bool, int, float, str))):
        return value
    raise CorruptCheckpoint("malformed record")


def _replace_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _replace_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_safetensors(tensors, tmp)
    os.replace(tmp, path)


def save(
    ckpt: Path,
    fingerprint: str,
    i: int,
    layer: nn.Module,
    records: dict[str, Any],
    hidden: torch.Tensor,
    prefix: str | None = None,
) -> None:
    """Layer i's weights and records (those named under `prefix`, default "model.layers.<i>."),
    then the next inputs, then progress.json (written last)."""
    ckpt.mkdir(parents=True, exist_ok=True)
    prefix = prefix or f"model.layers.{i}."
    tensors = {
        f"state/{k}": v.detach().to("cpu").contiguous().clone()
        for k, v in layer.state_dict().items()
    }
    encoded = {
        name: _encode(rec, f"rec/{name}", tensors)
        for name, rec in records.items()
        if name.startswith(prefix)
    }
    _replace_tensors(ckpt / f"layer_{i}.safetensors", tensors)
    _replace_json(ckpt / f"layer_{i}.json", {"records": encoded})
    _replace_tensors(ckpt / "hidden.safetensors", {"hidden": hidden.contiguous()})
    progress = {"format": FORMAT, "fingerprint": fingerprint, "done_layers": i + 1}
    _replace_json(ckpt / "progress.json", progress)


def _header(path: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) from a safetensors header; the file's length is checked too."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {
                k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()
            }
    except (SafetensorError, OSError) as e:
        raise CorruptCheckpoint(f"{path.name}: {e}") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CorruptCheckpoint(f"{path.name}: {e}") from None


def _tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of a (header-checked) safetensors file whose names start with `prefix`."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


def _check_layer(ckpt: Path, i: int, layer: nn.Module, types: dict[str, type]) -> dict[str, Any]:
    """Check layer i's files against the layer; return its decoded records (weights not applied)."""
    path = ckpt / f"layer_{i}.safetensors"
    header = _header(path)
    want = {f"state/{k}": list(v.shape) for k, v in layer.state_dict().items()}
    got = {k: shape for k, (shape, _) in header.items() if k.startswith("state/")}
    if got != want:
        bad = sorted(set(want) ^ set(got)) or [k for k in want if want[k] != got[k]]
        raise CorruptCheckpoint(f"{path.name}: weights do not fit the model (first: {bad[0]})")
    doc = _read_json(ckpt / f"layer_{i}.json")
    if not isinstance(doc, dict) or not isinstance(doc.get("records"), dict):
        raise CorruptCheckpoint(f"layer_{i}.json: no records")
    rec_tensors = _tensors(path, "rec/")
    return {name: _decode(node, rec_tensors, types) for name, node in doc["records"].items()}


def _apply_layer(ckpt: Path, i: int, layer: nn.Module) -> None:
    state = _tensors(ckpt / f"layer_{i}.safetensors", "state/")
    layer.load_state_dict({k[len("state/") :]: v for k, v in state.items()})


def _load_checked(ckpt: Path, done: int, layers: nn.ModuleList, hidden_shape: tuple[int, ...]):
    if not 0 < done <= len(layers):
        raise CorruptCheckpoint(f"progress.json: {done} finished layers of {len(layers)}")
    header = _header(ckpt / "hidden.safetensors")
    if list(header) != ["hidden"] or tuple(header["hidden"][0]) != hidden_shape:
        raise CorruptCheckpoint(
            f"hidden.safetensors: expected hidden states of shape {list(hidden_shape)}"
        )
    types = _record_types()
    records: dict[str, Any] = {}
    for i in range(done):
        records.update(_check_layer(ckpt, i, layers[i], types))
    for i in range(done):
        _apply_layer(ckpt, i, layers[i])
    return records, _tensors(ckpt / "hidden.safetensors", "hidden")["hidden"]


def load(
    ckpt: Path,
    fingerprint: str,
    layers: nn.ModuleList,
    hidden_shape: tuple[int, ...],
    warn: Callable[[str], None],
) -> tuple[int, torch.Tensor | None, dict[str, Any]]:
    """(finished layers, next inputs, their records) of a previous run with this fingerprint, the
    layers' weights loaded; (0, None, {}) when there is none, or (with a warning) when it is
    damaged."""
    if not (ckpt / "progress.json").exists():
        return 0, None, {}
    try:
        info = _read_json(ckpt / "progress.json")
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise CorruptCheckpoint("written by an older llmctl (pickle files are never loaded)")
        if info.get("fingerprint") != fingerprint:
            _clear(ckpt)  # another run's leftovers (other settings): start over quietly
            return 0, None, {}
        done = info.get("done_layers")
        if not isinstance(done, int) or isinstance(done, bool):
            raise CorruptCheckpoint("progress.json: no layer count")
        records, hidden = _load_checked(ckpt, done, layers, hidden_shape)
    except CorruptCheckpoint as e:
        warn(f"resume state in {ckpt} is damaged ({e}); redoing every layer")
        _clear(ckpt)
        return 0, None, {}
    return done, hidden, records


def _clear(ckpt: Path) -> None:
    shutil.rmtree(ckpt, ignore_errors=True)
