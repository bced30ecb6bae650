"""quantize/sparsify output folders: never the source, --overwrite only over our own output,
written aside and moved into place at the end (disk full and Ctrl-C leave no complete-looking
folder and resume), file modes from the umask, no auto_map in the output config."""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest
import torch

from llmctl.cli import main
from llmctl.errors import LlmctlError, UsageError
from llmctl.runtime.output_dir import OutputFolder, check_disjoint, writing
from tests.conftest import make_random_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama (with an auto_map in its config) and token-id calibration rows."""
    root = tmp_path_factory.mktemp("compress-out")
    model = make_random_model(root / "model", "llama", seed=5)
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.LlamaCustom"}
    (model / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    rows = [
        {"prompt_token_ids": torch.randint(3, 160, (40,), generator=g).tolist()} for _ in range(20)
    ]
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, calib


def _digest(folder):
    files = [p for p in sorted(folder.iterdir()) if p.is_file()]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _quantize(model, calib, out, *extra):
    return main(
        [
            "quantize",
            str(model),
            "-o",
            str(out),
            "--rtn",
            "--group-size",
            "32",
            "--calib",
            str(calib),
            "--num-samples",
            "4",
            "--seq-len",
            "32",
            "--quiet",
            *extra,
        ]
    )


def _sparsify(model, calib, out, *extra):
    return main(
        [
            "sparsify",
            str(model),
            "-o",
            str(out),
            "--method",
            "wanda",
            "--calib",
            str(calib),
            "--num-samples",
            "4",
            "--seq-len",
            "32",
            "--no-eval",
            "--quiet",
            *extra,
        ]
    )


@pytest.mark.parametrize("run", [_quantize, _sparsify])
def test_output_that_is_the_source_is_refused_before_any_work(tiny, tmp_path, capsys, run):
    model, calib = tiny
    before = _digest(model)
    link = tmp_path / "link"
    link.symlink_to(model)  # the same folder by another path
    for out in (model, link, link / "sub", model.parent):
        assert run(model, calib, out, "--overwrite") == 2
        err = capsys.readouterr().err.strip()
        assert ("source model folder" in err) and len(err.splitlines()) == 1, err
    assert _digest(model) == before
    assert not (model / ".llmctl-work").exists() and not (model / "sub").exists()


def test_check_disjoint_compares_inodes_not_names(tmp_path):
    src = tmp_path / "src"
    (src / "deep").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(src)
    with pytest.raises(UsageError, match="lies inside"):
        check_disjoint(src, tmp_path / "alias" / "deep" / "new")
    with pytest.raises(UsageError, match="contains"):
        check_disjoint(tmp_path / "alias" / "deep", tmp_path)
    check_disjoint(src, tmp_path / "elsewhere")  # a sibling is fine


def test_overwrite_never_empties_a_folder_llmctl_did_not_write(tiny, tmp_path, capsys):
    model, calib = tiny
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert _quantize(model, calib, out, "--overwrite") == 2
    assert "llmctl did not write" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_overwrite_replaces_an_earlier_llmctl_output_and_its_stale_files(tiny, tmp_path):
    model, calib = tiny
    out, report = tmp_path / "q", tmp_path / "q" / "report.json"
    assert _quantize(model, calib, out, "--report-json", str(report)) == 0
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale shard of an older run")
    assert (
        _quantize(model, calib, out, "--overwrite", "--report-json", str(report), "--bits", "8")
        == 0
    )
    names = sorted(p.name for p in out.iterdir())
    assert "model-00001-of-00002.safetensors" not in names and ".llmctl-work" not in names
    assert json.loads(report.read_text())["bits"] == 8
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["config_groups"]["group_0"]["weights"]["num_bits"] == 8


def test_auto_map_is_dropped_and_files_follow_the_umask(tiny, tmp_path):
    model, calib = tiny
    old = os.umask(0o027)
    try:
        assert _quantize(model, calib, tmp_path / "q") == 0
        assert _sparsify(model, calib, tmp_path / "s") == 0
    finally:
        os.umask(old)
    for out in (tmp_path / "q", tmp_path / "s"):
        assert "auto_map" not in json.loads((out / "config.json").read_text())
        assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o640  # 0666 & ~0027, not 0600


def _fail_weights(monkeypatch, exc):
    """Make the writer of the output's weights (huggingface_hub's) fail; the resume checkpoints
    still write."""
    import huggingface_hub

    def save(*args, **kwargs):
        raise exc

    monkeypatch.setattr(huggingface_hub, "save_torch_state_dict", save)


@pytest.mark.parametrize(
    "exc,rc,needle",
    [
        (OSError(28, "No space left on device"), 1, "disk full"),
        (KeyboardInterrupt(), 130, None),  # Ctrl-C: exit 130 (typer prints nothing)
    ],
)
def test_disk_full_or_ctrl_c_while_writing_keeps_the_old_output_and_resumes(
    tiny, tmp_path, capsys, monkeypatch, exc, rc, needle
):
    model, calib = tiny
    out = tmp_path / "q"
    assert _quantize(model, calib, out) == 0
    before = _digest(out)
    with monkeypatch.context() as m:
        _fail_weights(m, exc)
        assert _quantize(model, calib, out, "--overwrite", "--bits", "8") == rc
    err = capsys.readouterr().err.strip()
    assert needle is None or (needle in err and len(err.splitlines()) == 1), err
    assert _digest(out) == before  # the earlier output is untouched, the new one not half in place
    assert (out / ".llmctl-work" / "resume" / "progress.json").is_file()
    assert (
        _quantize(
            model,
            calib,
            out,
            "--overwrite",
            "--bits",
            "8",
            "--report-json",
            str(tmp_path / "r.json"),
        )
        == 0
    )
    assert json.loads((tmp_path / "r.json").read_text())["resumed_layers"] == 2
    assert not (out / ".llmctl-work").exists()


def test_commit_moves_config_last(tmp_path):
    out = OutputFolder.plan(tmp_path / "o", overwrite=False)
    result = out.fresh_result()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (result / name).write_text(name)
    order = []
    real = os.replace

    def spy(a, b):
        order.append(os.path.basename(b))
        real(a, b)

    import llmctl.runtime.output_dir as od

    od.os.replace = spy
    try:
        out.commit()
    finally:
        od.os.replace = real
    assert order[-1] == "config.json" and sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]


def test_unwritable_output_folder_is_refused_up_front(tmp_path, monkeypatch):
    # as on a read-only mount (a chmod would not do: tests may run as root, who bypasses it)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(UsageError, match="not writable"):
        OutputFolder.plan(tmp_path / "new" / "out", overwrite=False)


def test_os_errors_while_writing_are_one_line():
    for code, needle in (
        (28, "disk full while writing -o x; finished layers are kept"),
        (30, "cannot write -o x: Read-only file system (x/model.safetensors)"),
    ):
        with pytest.raises(LlmctlError, match=re.escape(needle)):
            with writing("-o x"):
                raise OSError(code, os.strerror(code), "x/model.safetensors")


def test_an_interrupted_move_into_place_is_finished_by_the_next_commit(tmp_path):
    out = OutputFolder.plan(tmp_path / "o", overwrite=False)
    (out.work / "replaced" / "old").mkdir(parents=True)  # what a crash during commit() leaves
    (out.work / "replaced" / "old" / "f").write_text("x")
    (out.fresh_result() / "config.json").write_text("{}")
    out.commit()
    assert sorted(p.name for p in out.final.iterdir()) == ["config.json"]


def test_output_that_is_a_file_or_device_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    for target in (tmp_path / "f", "/dev/null"):
        with pytest.raises(UsageError, match="is a file, not a folder"):
            OutputFolder.plan(target, overwrite=True)
    assert (tmp_path / "f").read_text() == "x"
