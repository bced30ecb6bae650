"""The engine-level batch-invariance check of test_batch_invariance.py with the Triton kernels
forced onto CPU tensors (LLMCTL_KERNELS=triton_on_cpu=1 under TRITON_INTERPRET=1): the CUDA path's
linears, RMSNorm and attention, run by the interpreter. A few fixed mixes (the interpreter is
slow): other block sizes, token budgets (chunked prompts), a warm prefix cache and speculation;
every row's tokens and logits against the row run alone, in float32 and bfloat16.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is a Linux x86_64 dependency of llmctl")

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from unittest import mock

    from llmctl.kernels.cuda import invariant as triton_invariant
    from tests import test_batch_invariance as bi
    from tests.conftest import make_random_model

    calls = {"linear": 0, "rms_norm": 0, "paged_attention": 0}

    def counted(name):
        fn = getattr(triton_invariant, name)
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    for name in calls:
        setattr(triton_invariant, name, counted(name))
    path = make_random_model(Path(sys.argv[1]), "qwen3", seed=7, intermediate_size=88)
    mixes = [
        dict(order=[3, 0, 6], budget=8, block_size=4, prefix_cache=True, warm=True,
             speculate=False),
        dict(order=[7, 3, 1], budget=13, block_size=1, prefix_cache=False, warm=False,
             speculate=True),
    ]
    # 4 new tokens a row, and only the rows the mixes use run alone: the interpreter is slow
    used, cache = sorted({i for m in mixes for i in m["order"]}), {}

    def alone(path, dtype, invariant=True):
        if dtype not in cache:
            rows, tokens, logits = bi._rows(160), {}, {}
            for i in used:
                llm = bi._llm(path, dtype, batch_invariant=True, enable_prefix_caching=False)
                t, g = bi._generate(llm, rows, [i])
                tokens.update(t)
                logits.update(g)
            cache[dtype] = tokens, logits
        return cache[dtype]

    with mock.patch.object(bi, "MAX_NEW", 4), mock.patch.object(bi, "alone", alone):
        for dtype in ("float32", "bfloat16"):
            for mix in mixes:
                assert bi._check(path, dtype, mix) == [], (dtype, mix)
    assert all(calls.values()), calls
    print("OK", calls)
    """
)


def test_rows_equal_the_row_run_alone_through_the_triton_kernels(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "LLMCTL_KERNELS": "autotune=0,triton_on_cpu=1"}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
