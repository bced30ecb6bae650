"""The calibration driver's resume state: safetensors + JSON, never a pickle; a damaged checkpoint
is redone with a warning and the result equals a clean run."""

from __future__ import annotations

import json
import pickle
import re

import pytest
import torch

from llmctl.compress.driver import calibrate_layers
from llmctl.compress.quant.layer_methods import AwqMethod, gptq_method
from llmctl.compress.sparse.masks import parse_pattern
from llmctl.compress.sparse.model import SparsifySettings, WandaMethod
from llmctl.runtime.formats.spec import QuantSpec
from tests.conftest import REPO
from tests.test_quant_driver import ids, tiny_model


class _Planted:
    """Unpickling this creates the marker file: what a planted checkpoint would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _interrupted(ckpt, method_factory, after=1):
    def stop(done, total):
        if done == after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        calibrate_layers(
            tiny_model(),
            ids(),
            method_factory(),
            checkpoint_dir=ckpt,
            fingerprint="f",
            progress=stop,
        )


def _resume(ckpt, method_factory):
    warnings = []
    model = tiny_model()
    res = calibrate_layers(
        model, ids(), method_factory(), checkpoint_dir=ckpt, fingerprint="f", warn=warnings.append
    )
    return model, res, warnings


def _clean(method_factory):
    model = tiny_model()
    return model, calibrate_layers(model, ids(), method_factory())


def _same(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def _gptq():
    return gptq_method(QuantSpec(4, 32))


def _awq():
    return AwqMethod(QuantSpec(4, 32), n_grid=2)


def _wanda():
    return WandaMethod(SparsifySettings(parse_pattern("2:4", None), "wanda"))


@pytest.mark.parametrize("factory", [_gptq, _awq, _wanda])
def test_resume_state_is_safetensors_and_json_and_resumes_exactly(tmp_path, factory):
    _interrupted(tmp_path, factory)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hidden.safetensors",
        "layer_0.json",
        "layer_0.safetensors",
        "progress.json",
    ]
    model, res, warnings = _resume(tmp_path, factory)
    clean, ref = _clean(factory)
    assert res.resumed_layers == 1 and not warnings
    _same(model, clean)
    assert set(res.records) == set(ref.records)
    for name, rec in ref.records.items():  # rebuilt from JSON + tensors: equal to the computed
        assert rec.to_dict() == res.records[name].to_dict()


def test_a_planted_pickle_is_never_loaded(tmp_path):
    """An older llmctl's layout (progress.json + torch pickles): the old resume ran these files."""
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in ("layer_0.pt", "hidden.pt"):
        (ckpt / name).write_bytes(pickle.dumps(_Planted(marker)))
    (ckpt / "progress.json").write_text(json.dumps({"done_layers": 1, "fingerprint": "f"}))
    model, res, warnings = _resume(ckpt, _gptq)
    assert not marker.exists()
    assert res.resumed_layers == 0 and any("older llmctl" in w for w in warnings)
    _same(model, _clean(_gptq)[0])
    # the current layout with a pickle in place of the safetensors file: not unpickled either
    ckpt = tmp_path / "ckpt2"
    _interrupted(ckpt, _gptq)
    (ckpt / "layer_0.safetensors").write_bytes(pickle.dumps(_Planted(marker)))
    model, res, warnings = _resume(ckpt, _gptq)
    assert not marker.exists() and res.resumed_layers == 0 and warnings
    _same(model, _clean(_gptq)[0])


def _truncate(ckpt):
    data = (ckpt / "layer_0.safetensors").read_bytes()
    (ckpt / "layer_0.safetensors").write_bytes(data[: len(data) // 2])


def _bad_json(ckpt):
    (ckpt / "layer_0.json").write_text('{"records": {')


def _bad_progress(ckpt):
    (ckpt / "progress.json").write_text('{"format": 1, "fingerprint": "f", "done_layers": 7}')


def _wrong_shapes(ckpt):
    from safetensors.torch import load_file, save_file

    t = load_file(str(ckpt / "layer_0.safetensors"))
    t["state/mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(t, str(ckpt / "layer_0.safetensors"))


def _missing_tensor(ckpt):
    from safetensors.torch import load_file, save_file

    t = load_file(str(ckpt / "layer_0.safetensors"))
    del t[next(k for k in t if k.startswith("rec/"))]
    save_file(t, str(ckpt / "layer_0.safetensors"))


def _foreign_type(ckpt):
    doc = json.loads((ckpt / "layer_0.json").read_text())
    first = next(iter(doc["records"]))
    doc["records"][first]["type"] = "Popen"
    (ckpt / "layer_0.json").write_text(json.dumps(doc))


def _hidden_gone(ckpt):
    (ckpt / "hidden.safetensors").unlink()


@pytest.mark.parametrize(
    "damage",
    [
        _truncate,
        _bad_json,
        _bad_progress,
        _wrong_shapes,
        _missing_tensor,
        _foreign_type,
        _hidden_gone,
    ],
)
def test_a_damaged_checkpoint_is_redone_and_equals_a_clean_run(tmp_path, damage):
    _interrupted(tmp_path, _gptq)
    damage(tmp_path)
    model, res, warnings = _resume(tmp_path, _gptq)
    assert res.resumed_layers == 0 and len(warnings) == 1 and "damaged" in warnings[0]
    clean, ref = _clean(_gptq)
    _same(model, clean)
    lines = {n: r.to_dict() for n, r in res.records.items()}
    assert {n: r.to_dict() for n, r in ref.records.items()} == lines
    again = calibrate_layers(tiny_model(), ids(), _gptq(), checkpoint_dir=tmp_path, fingerprint="f")
    assert again.resumed_layers == 2  # the redone run left a sound checkpoint: no crash loop


LOADS_PICKLE = (
    r"torch\.load\(|^\s*(import|from)\s+(pickle|cPickle|dill|joblib|shelve)\b|"
    r"pickle\.loads?\(|weights_only\s*=\s*False|\.load_pickle\("
)


def test_no_pickle_loading_anywhere_in_the_package():
    hits = []
    for path in (REPO / "llmctl").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(LOADS_PICKLE, line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert hits == [], hits
