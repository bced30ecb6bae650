"""The native CPU kernels (paged decode attention, linear, RMSNorm, K/V writes, argmax) against
their plain-PyTorch references, and KernelConfig.native keeping them out."""

from __future__ import annotations

import ctypes
import platform
import shutil
import sys
import warnings

import pytest
import torch

from llmctl import LLM, SamplingParams
from llmctl.kernels import attention
from llmctl.kernels.attention import PagedAttentionMetadata, decode_attention, paged_attention
from llmctl.kernels.config import KernelConfig, from_env
from llmctl.kernels.cpu import attention as cpu_attention
from llmctl.kernels.cpu import elementwise, library
from llmctl.kernels.cpu.linear import c_kernels, dispatch, torch_kernels

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="needs a C compiler to build the native kernel",
)


def _case(heads, kvh, d, bs, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // bs) for n in lens)
    num_blocks = len(lens) * width + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), width, dtype=torch.long)  # padding: block 0, as the runner pads
    used = 0
    for i, n in enumerate(lens):
        need = -(-n // bs)
        tables[i, :need] = perm[used : used + need]
        used += need
    kc = torch.randn(kvh, num_blocks * bs, d, generator=g).to(dtype)
    vc = torch.randn(kvh, num_blocks * bs, d, generator=g).to(dtype)
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(lens)


@pytest.mark.parametrize("heads,kvh,d", [(9, 3, 64), (4, 4, 128), (8, 2, 32), (6, 1, 48)])
@pytest.mark.parametrize("bs", [16, 5])
def test_native_decode_equals_reference_float32(heads, kvh, d, bs):
    lens = [1, bs, bs + 1, 3 * bs, 37, 2]  # one token, exactly one block, a block boundary, ...
    q, kc, vc, tables, lt = _case(heads, kvh, d, bs, lens, torch.float32)
    assert cpu_attention.supports(q, kc)
    ref = decode_attention(q, kc, vc, tables, lt, d**-0.5, bs)
    out = cpu_attention.paged_decode_attention(q, kc, vc, tables, lt, d**-0.5, bs, max(lens))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_native_decode_bfloat16_cache_matches_float32_math():
    q, kc, vc, tables, lt = _case(8, 2, 64, 16, [40, 3, 17, 64], torch.bfloat16)
    ref = decode_attention(q.float(), kc.float(), vc.float(), tables, lt, 0.125, 16)
    out = cpu_attention.paged_decode_attention(q, kc, vc, tables, lt, 0.125, 16, 64)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), ref, rtol=1e-2, atol=1e-2
    )  # only the output's bf16 rounding


def test_native_decode_threads_agree():
    q, kc, vc, tables, lt = _case(9, 3, 64, 16, [300, 17, 129, 64, 1, 250], torch.float32, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.paged_decode_attention(q, kc, vc, tables, lt, 0.125, 16, 300)
        torch.set_num_threads(2)
        two = cpu_attention.paged_decode_attention(q, kc, vc, tables, lt, 0.125, 16, 300)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each (sequence, KV head) is computed whole by one thread


def test_unsupported_inputs_are_refused():
    q, kc, _, tables, lt = _case(4, 2, 24, 4, [5, 3], torch.float32)
    assert not cpu_attention.supports(q, kc)  # head size 24: not a multiple of 16
    assert not cpu_attention.supports(q.half(), kc.half())
    q, kc, vc, tables, lt = _case(4, 2, 32, 4, [5, 3], torch.float32)
    with pytest.raises(
        ValueError, match="max_len"
    ):  # longer than the block table: would read past it
        cpu_attention.paged_decode_attention(q, kc, vc, tables, lt, 0.1, 4, 9)


def test_build_is_cached_and_reports_compiler_errors(tmp_path):
    first = library.build(library.sources("core"), out_dir=tmp_path)
    assert library.build(library.sources("core"), out_dir=tmp_path) == first
    assert len(list(tmp_path.glob("*.so"))) == 1
    bad = tmp_path / "bad.c"
    bad.write_text("int broken( {\n")
    with pytest.raises(RuntimeError, match="failed"):
        library.build((bad,), out_dir=tmp_path)


def _count_c_kernel_use(monkeypatch) -> list[str]:
    """Every library load and every C kernel wrapper call from now on, recorded by name: each
    llmctl module's own reference to `library.load`, the linear kernels' libraries and the
    tensor-level wrappers of the C kernels is replaced by a counting one."""
    import llmctl.engine.llm_engine  # noqa: F401  (everything an engine imports, so patched too)
    import llmctl.models.prepare  # noqa: F401

    used: list[str] = []
    entries = [
        ("load", library.load),
        ("dpbf16_library", c_kernels.dpbf16_library),
        ("amx_library", c_kernels.amx_library),
        ("native", c_kernels.native),
        ("dpbf16", c_kernels.dpbf16),
        ("amx", c_kernels.amx),
        ("paged_decode_attention", cpu_attention.paged_decode_attention),
        ("write_kv", cpu_attention.write_kv),
        *((n, getattr(elementwise, n)) for n in ("rms_norm", "add_rms_norm", "silu_mul")),
        *((n, getattr(elementwise, n)) for n in ("silu_and_mul", "rope", "argmax")),
    ]
    for mod in [m for n, m in sys.modules.items() if n.startswith("llmctl.")]:
        for name, real in entries:
            if getattr(mod, name, None) is real:

                def counted(*a, name=name, real=real, **kw):
                    used.append(name)
                    return real(*a, **kw)

                monkeypatch.setattr(mod, name, counted)
    return used


def test_native_off_keeps_the_c_kernels_out(monkeypatch):
    """KernelConfig(native=False) (LLMCTL_KERNELS=native=0): the layers and attention take their
    PyTorch paths and never touch a C library, with the same results; with it on (the default)
    the same calls go through the C kernels."""
    from types import SimpleNamespace

    from llmctl.models.layers import MLP, Linear, RMSNorm

    assert from_env({"LLMCTL_KERNELS": "native=0"}) == KernelConfig(native=False)
    assert from_env({}).native
    off = KernelConfig(native=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    linear, norm = Linear(64, 24), RMSNorm(64, 1e-6)
    mlp = MLP(SimpleNamespace(hidden_size=64, intermediate_size=96, gemma=False))
    q, kc, vc, tables, lt = _case(4, 2, 32, 4, [5, 3], torch.float32)
    kv = torch.randn(16, 2, 32, generator=g)  # WRITE_KV_MIN_ROWS tokens: the C write applies
    slots = torch.arange(16) + 8

    def run(kernels: KernelConfig):
        for m in (linear, norm, *mlp.modules()):  # each layer its own, as prepare sets them
            m.kernels = kernels
        meta = PagedAttentionMetadata(slots, 0, None, None, [], 4)
        k2, v2 = kc.clone(), vc.clone()
        paged_attention(kv, kv, kv, k2, v2, meta, 0.1, kernels)  # writes K/V only (no queries)
        meta = PagedAttentionMetadata(
            torch.zeros(0, dtype=torch.long), 2, tables, lt, [], 4, decode_max_len=5
        )
        empty = torch.zeros(0, 2, 32)
        out = paged_attention(q, empty, empty, k2, v2, meta, 0.25, kernels)
        with torch.no_grad():
            return linear(x), norm(x), mlp(x), k2, v2, out

    used = _count_c_kernel_use(monkeypatch)
    native = run(KernelConfig())
    assert {"native", "rms_norm", "silu_mul", "write_kv", "paged_decode_attention"} <= set(used)
    used.clear()
    reference = run(off)
    assert used == [], f"native=False still used {sorted(set(used))}"
    for a, b in zip(native, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert library.load("core") is not None  # only the config said no: the kernels are built


def test_engine_greedy_output_same_with_native_and_reference(shakespeare_model, monkeypatch):
    prompts = [
        [int(t) for t in torch.randint(0, 60, (n,), generator=torch.Generator().manual_seed(n))]
        for n in (3, 40, 17, 90, 8, 25, 61, 5, 33)
    ]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    calls, linears = [], []
    native, native_linear = cpu_attention.paged_decode_attention, c_kernels.native
    monkeypatch.setattr(
        cpu_attention, "paged_decode_attention", lambda *a: calls.append(1) or native(*a)
    )
    monkeypatch.setattr(
        c_kernels, "native", lambda *a: linears.append(a[0].shape[0]) or native_linear(*a)
    )
    with_native = [  # the static rules (without autotune): few rows through the native kernel
        o.output_token_ids
        for o in LLM(str(shakespeare_model), dtype="float32", autotune=False).generate(
            prompts, params
        )
    ]
    assert calls, "the engine did not use the native attention kernel"
    assert linears and max(linears) <= len(prompts), (
        "decode steps' linears go through the native kernel"
    )
    monkeypatch.setattr(cpu_attention, "supports", lambda q, k: False)
    monkeypatch.setattr(dispatch, "use_native", lambda x, w: False)
    reference = [
        o.output_token_ids
        for o in LLM(str(shakespeare_model), dtype="float32").generate(prompts, params)
    ]
    assert with_native == reference
    # KernelConfig(native=False): no C kernel at all in the engine (no library even loaded)
    monkeypatch.undo()
    used = _count_c_kernel_use(monkeypatch)
    off = KernelConfig(native=False, autotune=False)  # the static rules, as the runs above
    llm = LLM(str(shakespeare_model), dtype="float32", kernels=off)
    without_native = [o.output_token_ids for o in llm.generate(prompts, params)]
    assert used == [], f"the engine with native=False used {sorted(set(used))}"
    assert without_native == reference


def test_packed_lm_head_gives_the_same_logits(tmp_path, monkeypatch):
    from tests.conftest import make_random_model

    llm = LLM(str(make_random_model(tmp_path, "llama", seed=5)), dtype="float32", device="cpu")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # builds the engine
    model = llm.runtime.model
    packed = model.lm_head.packed
    assert packed and packed.get("packed") is not None, (
        "the CPU float32 engine packs its vocabulary projection"
    )
    calls = []
    real = torch_kernels.packed
    monkeypatch.setattr(torch_kernels, "packed", lambda *a: calls.append(1) or real(*a))
    many = (
        dispatch.NATIVE_ROWS_PER_THREAD * torch.get_num_threads() + 3
    )  # beyond the native kernel's rows
    hidden = torch.randn(many, model.config.hidden_size)
    plain = hidden @ model.lm_head.weight.T
    with torch.no_grad():  # inference, as the engine calls it
        torch.testing.assert_close(model.compute_logits(hidden), plain, rtol=1e-4, atol=1e-4)
        assert calls == [1], "many rows of float32 logits go through the packed weight"
        torch.testing.assert_close(
            model.compute_logits(hidden[:1]), plain[:1], rtol=1e-4, atol=1e-4
        )
    assert torch_kernels.pack_weight(model.lm_head.weight.half()) is None  # float32 and bf16 only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 13, 8),
        (1, 64, 96),
        (2, 70, 24),
        (3, 4, 64),
        (5, 130, 40),
        (16, 96, 200),
        (4, 20, 16),
        (7, 9, 32),
        (49, 12, 24),
        (50, 33, 16),
        (100, 65, 72),
    ],
)
def test_linear_matches_f_linear(dtype, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    for bias in (None, b):
        out = c_kernels.native(x, w, bias)
        ref = torch.nn.functional.linear(
            x.float(), w.float(), None if bias is None else bias.float()
        )
        assert out.dtype == dtype and out.shape == (m, n)
        tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the output is rounded to bf16
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_threads_and_leading_dims(dtype):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 7, 48, generator=g).to(dtype), torch.randn(90, 48, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = c_kernels.native(x, w)
        torch.set_num_threads(2)
        two = c_kernels.native(x, w)  # bf16: each thread widens weight rows into its own buffer
    finally:
        torch.set_num_threads(threads)
    assert one.shape == (2, 7, 90)
    assert torch.equal(one, two)  # each output element is summed by one thread, in one order
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(one.float(), x.float() @ w.float().T, rtol=tol, atol=tol * 4)
    torch.testing.assert_close(c_kernels.native(x[:, :0], w), x[:, :0] @ w.T)  # no rows


def test_use_linear_refuses_what_it_cannot_serve(monkeypatch):
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    assert dispatch.use_native(x, w)
    assert not dispatch.use_native(x.double(), w.double())
    assert not dispatch.use_native(x, w.bfloat16())  # dtypes differ
    assert not dispatch.use_native(torch.randn(4, 60), torch.randn(32, 60))  # K % 8

    class Wrapped(torch.Tensor):  # a tensor subclass (2:4 sparse, quantized) has its own matmul
        pass

    assert not dispatch.use_native(x, w.as_subclass(Wrapped))
    assert dispatch.use_native(x, torch.nn.Parameter(w, requires_grad=False))
    wg = w.clone().requires_grad_()
    assert not dispatch.use_native(x, wg)  # training needs autograd
    with torch.no_grad():
        assert dispatch.use_native(x, wg)
    many = torch.randn(dispatch.NATIVE_ROWS_PER_THREAD * torch.get_num_threads() + 1, 64)
    assert not dispatch.use_native(many, w)  # many rows: the BLAS is faster
    assert not dispatch.use_native(many.bfloat16(), w.bfloat16())  # bf16 too (widened slabs)
    few = x.bfloat16(), w.bfloat16()
    monkeypatch.setattr(dispatch, "native_bf16", lambda: False)
    assert dispatch.use_native(*few)
    monkeypatch.setattr(dispatch, "native_bf16", lambda: True)  # oneDNN's bf16 matmul is fast there
    assert not dispatch.use_native(*few)


def test_model_linear_is_native_only_where_it_should_be(monkeypatch):
    from llmctl.models.layers import Linear

    layer = Linear(64, 24)
    x = torch.randn(3, 64)
    calls = []
    native = c_kernels.native
    monkeypatch.setattr(c_kernels, "native", lambda *a: calls.append(1) or native(*a))
    with torch.no_grad():
        torch.testing.assert_close(
            layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)
        )
    assert calls == [1]
    y = layer(x)  # with gradients: F.linear, and backward works
    y.sum().backward()
    assert calls == [1] and layer.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 896), (300, 64), (2, 3, 128)])
def test_rms_norm_matches_the_reference(dtype, shape):
    from llmctl.models.layers import RMSNorm

    g = torch.Generator().manual_seed(shape[-1])
    norm = RMSNorm(shape[-1], 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    ref = norm(x.clone().requires_grad_()).detach()  # with gradients: the PyTorch path
    with torch.no_grad():
        out = norm(x)
        assert elementwise.use_rms_norm(x, norm.weight)
    assert out.shape == x.shape and out.dtype == dtype
    if dtype == torch.bfloat16:  # normalise in float32, round, scale, round: bit for bit
        assert torch.equal(out, ref)
    else:  # float32: sums in another order
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_rms_norm_threads_and_refusals():
    x, w = torch.randn(100, 64), torch.randn(64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = elementwise.rms_norm(x, w, 1e-5)
        torch.set_num_threads(2)
        two = elementwise.rms_norm(x, w, 1e-5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert not elementwise.use_rms_norm(x.double(), w.double())
    assert not elementwise.use_rms_norm(x, w.bfloat16())  # dtypes differ
    assert not elementwise.use_rms_norm(torch.randn(4, 60), torch.randn(60))  # K % 8
    assert not elementwise.use_rms_norm(x, w.clone().requires_grad_())  # training needs autograd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [16, 300])  # one thread's loop; the tokens split over threads
def test_write_kv_in_c_equals_index_copy(dtype, tokens):
    g = torch.Generator().manual_seed(1)
    kvh, d, nslots = 3, 64, 1000
    # k contiguous (after RoPE), v a column slice of a merged q/k/v output: a token stride of 960
    qkv = torch.randn(tokens, 576 + 2 * kvh * d, generator=g).to(dtype)
    k = qkv[:, 576 : 576 + kvh * d].contiguous().view(tokens, kvh, d)
    v = qkv[:, 576 + kvh * d :].view(tokens, kvh, d)
    slots = torch.randperm(nslots, generator=g)[:tokens]
    kc = torch.randn(kvh, nslots, d, generator=g).to(dtype)
    vc = torch.zeros(kvh, nslots, d, dtype=dtype)
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k.index_copy_(1, slots, k.transpose(0, 1))
    ref_v.index_copy_(1, slots, v.transpose(0, 1))
    assert cpu_attention.use_write_kv(kc, vc, k, v, slots)
    attention.write_kv(kc, vc, k, v, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)  # untouched slots kept too
    # not served: too few tokens, or heads not contiguous within a token
    assert not cpu_attention.use_write_kv(kc, vc, k[:2], v[:2], slots[:2])
    head_strided = k.transpose(1, 2).contiguous().transpose(1, 2)  # [T, KVH, D], stride(1) == 1
    assert not cpu_attention.use_write_kv(kc, vc, head_strided, v, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152])
def test_argmax_kernel_equals_torch_max(dtype, vocab):
    """cpu_argmax.c against torch.max's indices: ties (first index), NaNs (the first NaN of any
    sign), +-inf, -0.0 == +0.0, rows of a strided view; only where it is built (AVX-512)."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab, generator=g).to(dtype)
    x[1] = torch.randint(0, 3, (vocab,), generator=g).to(dtype)  # many equal maxima
    x[2, vocab // 2] = float("nan")
    x[3, :] = 0.0
    x[3, vocab - 1] = -0.0
    x[4, :] = -float("inf")
    x[5, -1] = float("inf")
    x[6, 0] = -float("nan")
    x[6, -1] = float("nan")
    x[7, :] = -0.0
    if not elementwise.use_argmax(x):
        lib = library.load("core")
        assert lib is None or lib.argmax_rows_built() == 0
        pytest.skip("the argmax kernel is built with AVX-512 only")
    assert torch.equal(elementwise.argmax(x), x.max(dim=-1).indices)
    assert torch.equal(elementwise.argmax(x[1::3]), x[1::3].max(dim=-1).indices)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(elementwise.argmax(x), x.max(dim=-1).indices)
    finally:
        torch.set_num_threads(before)
    assert not elementwise.use_argmax(x.t()) or vocab == 1  # columns are not contiguous
    assert not elementwise.use_argmax(x[0])  # one-dimensional
    assert not elementwise.use_argmax(x.to(torch.float16))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction sets")
@pytest.mark.parametrize("march", ["haswell", "sapphirerapids"])
@pytest.mark.parametrize("name", sorted(library.LIBRARIES))
def test_every_library_builds_and_loads_for_other_cpu_kinds(name, march, tmp_path, monkeypatch):
    """Built as -march=native builds it on an AVX2-only CPU (no AVX-512 macro) or an AMX one,
    each library exports every function its signature table declares (stubs where the
    instructions are missing): one missing name fails the library's whole load, and every caller
    of it falls back to PyTorch. Nothing runs: the AMX build only has to link and load."""
    if library.load("core") is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(library, "COMPILE_FLAGS", [*library.COMPILE_FLAGS, f"-march={march}"])
    lib = ctypes.CDLL(str(library.build(library.sources(name), out_dir=tmp_path)))
    missing = [fn for fn in library._signatures()[name] if not hasattr(lib, fn)]
    assert missing == []
    if march != "haswell":
        return
    # the stubs are reported as such (linear_dpbf16 is built with target attributes instead, and
    # its caller checks the CPU's flags)
    probes = ("paged_decode_dpbf16_built", "paged_decode_amx_available", "linear_amx_available")
    for probe in (*probes, "prefill_amx_available", "prefill_dpbf16_available"):
        if probe in library._signatures()[name]:
            assert getattr(lib, probe)() == 0


def test_a_kernel_that_does_not_build_is_none_with_one_warning(monkeypatch, tmp_path):
    """Every kernel library (core, RoPE, dot-product, prefill, AMX) loads through library.load:
    a compiler failure names the library in a warning, once (load is cached), and the caller
    keeps its fallback."""
    library.load.cache_clear()
    try:
        with monkeypatch.context() as env:
            env.setenv("CC", "false")
            env.setenv("LLMCTL_CACHE_DIR", str(tmp_path))
            with pytest.warns(RuntimeWarning, match=r"native CPU kernels \(rope\) unavailable"):
                assert library.load("rope") is None
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # warned once: the cached None, silently
                assert library.load("rope") is None
                q, k = torch.zeros(2, 4, 64).bfloat16(), torch.zeros(2, 2, 64).bfloat16()
                cos = torch.zeros(16, 64)
                assert not elementwise.use_rope(q, k, cos, torch.arange(2))  # the PyTorch RoPE
    finally:
        library.load.cache_clear()
    assert library.load("rope") is not None  # the real compiler again
