"""One vLLM-style script (tests/vllm_style_script.py) run unchanged against llmctl and, where
vLLM imports (its CPU build: LLMCTL_VLLM_PYTHON, default /work/venvs/vllm/bin/python), against
vLLM: the same prompt tokens, greedy tokens and logprobs on the embedded demo model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "vllm_style_script.py"
DEMO = REPO / "llmctl" / "data" / "demo-model"
VLLM_PYTHON = Path(os.environ.get("LLMCTL_VLLM_PYTHON", "/work/venvs/vllm/bin/python"))
TOL = 1e-3  # two engines' float32 kernels (vLLM's CPU attention and GEMMs, ours)


def run_script(python: str, backend: str, out: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if backend == "vllm":  # one process, a small KV cache: what a 2-core CI machine affords
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [python, str(SCRIPT), backend, str(DEMO), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    return run_script(sys.executable, "llmctl", tmp_path_factory.mktemp("ours") / "out.json")


def test_the_script_runs_on_llmctl(ours):
    assert len(ours) == 5
    for r in ours[:3]:  # greedy, logprobs=2, prompt_logprobs=1
        (c,) = r["outputs"]
        assert len(c["token_ids"]) == 8 and c["finish_reason"] == "length"
        assert all(2 <= len(p) <= 3 and str(t) in p for t, p in zip(c["token_ids"], c["logprobs"]))
        assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) == len(
            r["prompt_token_ids"]
        )
    assert ours[1]["prompt_token_ids"] == [61, 62, 63, 64, 27]
    several = ours[3]["outputs"]
    assert [c["index"] for c in several] == [0, 1, 2] and several[0]["logprobs"] is None
    assert ours[4]["outputs"][0]["text"] and ours[4]["prompt_logprobs"] is None


def _vllm_imports() -> bool:
    if not VLLM_PYTHON.exists():
        return False
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm"], capture_output=True)
    return probe.returncode == 0


def _close(a: dict | None, b: dict | None) -> None:
    """Two {token id: logprob} positions: the same tokens, values within TOL."""
    assert (a is None) == (b is None)
    if a is not None:
        assert a.keys() == b.keys()
        assert max(abs(a[t] - b[t]) for t in a) < TOL


def test_the_script_gives_vllms_results(ours, tmp_path):
    if not _vllm_imports():
        pytest.skip(f"vLLM does not import with {VLLM_PYTHON} (set LLMCTL_VLLM_PYTHON)")
    theirs = run_script(str(VLLM_PYTHON), "vllm", tmp_path / "vllm.json")
    assert [r["prompt_token_ids"] for r in ours] == [r["prompt_token_ids"] for r in theirs]
    for a, b in zip(ours[:3], theirs[:3]):
        (ca,), (cb,) = a["outputs"], b["outputs"]
        assert ca["token_ids"] == cb["token_ids"] and ca["text"] == cb["text"]
        for pa, pb in zip(ca["logprobs"], cb["logprobs"]):
            _close(pa, pb)
        for pa, pb in zip(a["prompt_logprobs"], b["prompt_logprobs"]):
            _close(pa, pb)
    assert len(ours[3]["outputs"]) == len(theirs[3]["outputs"]) == 3  # sampled: own RNGs
    assert ours[4]["outputs"][0]["token_ids"] == theirs[4]["outputs"][0]["token_ids"]
