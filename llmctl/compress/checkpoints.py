"""Resume state of a layer-by-layer calibration: safetensors for tensors, JSON for the rest.

Owns: `save_layer` (layer i's weights and method records, then the next layer's inputs, then the
progress marker, each replaced atomically) and `load_checkpoint` (all-or-nothing: every file is
checked before any layer is touched; anything unreadable, truncated, of another run or of the
wrong shape means "start over", with the reason). Never a pickle: a planted file can at worst be
refused. Records (dataclasses holding tensors, dtypes and tuples) are encoded as JSON with their
tensors stored beside them; only dataclasses defined in llmctl modules are rebuilt.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import torch

PROGRESS = "progress.json"
HIDDEN = "hidden.safetensors"


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().to("cpu").contiguous()
        return {"__tensor__": key}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).replace("torch.", "")}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        fields = {f.name: _encode(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj)}
        return {"__dataclass__": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _encode(v, tensors) for k, v in obj.items()}
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__dtype__" in obj:
        dtype = getattr(torch, obj["__dtype__"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a dtype: {obj['__dtype__']!r}")
        return dtype
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__dataclass__" in obj:
        return _dataclass(obj["__dataclass__"])(**{k: _decode(v, tensors) for k, v in obj["fields"].items()})
    return {k: _decode(v, tensors) for k, v in obj.items()}


def _dataclass(path: str) -> type:
    module, _, name = path.partition(":")
    if not module.startswith("llmctl.") or "." in name:
        raise ValueError(f"refusing to rebuild {path!r}")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"{path!r} is not a dataclass")
    return cls


def _replace_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _replace_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)


def save_layer(ckpt: Path, fingerprint: str, i: int, state: dict[str, torch.Tensor], records: dict,
               hidden: torch.Tensor) -> None:
    """Layer i's state dict and records, then the inputs of layer i+1 [N, S, H], then the marker
    (written last: a crash in between leaves the previous marker, whose files are all intact)."""
    ckpt.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    meta = {"records": _encode(records, tensors), "state": list(state)}
    tensors.update({f"state.{k}": v.detach().to("cpu").contiguous() for k, v in state.items()})
    _replace_tensors(ckpt / f"layer_{i}.safetensors", tensors)
    _replace_json(ckpt / f"layer_{i}.json", meta)
    _replace_tensors(ckpt / HIDDEN, {"hidden": hidden.contiguous()})
    _replace_json(ckpt / PROGRESS, {"done_layers": i + 1, "fingerprint": fingerprint})


@dataclasses.dataclass
class Checkpoint:
    done_layers: int
    states: list[dict[str, torch.Tensor]]  # per finished layer
    records: dict
    hidden: torch.Tensor  # inputs of layer done_layers [N, S, H]


def load_checkpoint(ckpt: Path, fingerprint: str,
                    expected: list[dict[str, tuple[int, ...]]]) -> tuple[Checkpoint | None, str | None]:
    """(checkpoint, None) to resume; (None, reason) when there is one but it cannot be used;
    (None, None) when there is none or it is another run's. `expected[i]` maps layer i's state
    names to shapes."""
    marker = ckpt / PROGRESS
    if not marker.is_file():
        return None, None
    try:
        info = json.loads(marker.read_text())
        if info.get("fingerprint") != fingerprint:
            return None, None  # another run's leftovers: overwritten as this run goes
        done = int(info["done_layers"])
        if not 0 < done <= len(expected):
            raise ValueError(f"{done} finished layers of {len(expected)}")
        states, records = [], {}
        for i in range(done):
            state, recs = _load_layer(ckpt, i, expected[i])
            states.append(state)
            records.update(recs)
        hidden = _read_tensors(ckpt / HIDDEN)["hidden"]
    except Exception as e:  # noqa: BLE001 - any damage means the same thing: redo
        return None, f"{type(e).__name__}: {e}"
    return Checkpoint(done, states, records, hidden), None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _load_layer(ckpt: Path, i: int, shapes: dict[str, tuple[int, ...]]):
    tensors = _read_tensors(ckpt / f"layer_{i}.safetensors")
    meta = json.loads((ckpt / f"layer_{i}.json").read_text())
    state = {k: tensors[f"state.{k}"] for k in meta["state"]}
    wrong = [k for k in shapes if k not in state or tuple(state[k].shape) != tuple(shapes[k])]
    extra = sorted(set(state) - set(shapes))
    if wrong or extra:
        raise ValueError(f"layer {i}: state does not match the model ({(wrong or extra)[0]})")
    return state, _decode(meta["records"], tensors)

