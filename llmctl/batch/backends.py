"""Which engine serves a run-batch job: llmctl's own, or vLLM's offline engine.

Owns: the backend names, `load_engine` (the one place a job's runtime and engine are loaded,
the job's LoRA adapters read and registered with the engine:
by `runner.run_batch` in a single-process job, inside each replica under `--ray`), the refusal of
llmctl-only engine options under `vllm`, and the mapping of the `EngineConfig` fields a user set to
vLLM's `EngineArgs`. vLLM itself is imported only in `vllm_backend`, when that backend is chosen.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from llmctl.batch.options import lora_engine_fields
from llmctl.engine.config import EngineConfig, format_bytes
from llmctl.errors import UsageError

BACKENDS = ("llmctl", "vllm")
DEFAULT_BACKEND = "llmctl"

# EngineConfig fields with the same meaning in vLLM's EngineArgs, under the same name.
_SAME_NAME = (
    "block_size",
    "enable_prefix_caching",
    "max_num_batched_tokens",
    "max_num_seqs",
    "kv_cache_dtype",
)

# EngineConfig fields only llmctl's engine has, by the flag a user typed to set them.
_OWN_ENGINE_ONLY = {
    "batch_invariant": "--batch-invariant",
    "speculative_max_batch": "--speculative-max-batch (and --speculative auto)",
}

# Engine arguments the vLLM backend sets itself: pickle checkpoints are never loaded.
_FIXED_ARGS = {"load_format": "safetensors"}


def check_backend(backend: str, engine: dict[str, Any], engine_args: dict[str, Any]) -> None:
    """Refuse an unknown backend, llmctl-only options under vllm, engine args under llmctl."""
    if backend not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "llmctl":
        if engine_args:
            names = ", ".join(sorted(engine_args))
            raise UsageError(f"{names}: vLLM engine arguments need --backend vllm")
        return
    for field, flag in _OWN_ENGINE_ONLY.items():
        if engine.get(field) is not None:
            raise UsageError(f"{flag} is llmctl's engine only; vLLM has no equivalent")
    for key, value in _FIXED_ARGS.items():
        if key in engine_args and engine_args[key] != value:
            raise UsageError(f"{key} is always {value!r} with --backend vllm (no pickle files)")


def vllm_engine_args(engine: dict[str, Any], engine_args: dict[str, Any]) -> dict[str, Any]:
    """vLLM `EngineArgs` keywords for the EngineConfig fields a user set (`engine`, as in
    `BatchOptions.engine`) and the engine arguments passed through (which win)."""
    out: dict[str, Any] = {k: engine[k] for k in _SAME_NAME if engine.get(k) is not None}
    if engine.get("kv_cache_memory") is not None:
        out["kv_cache_memory_bytes"] = engine["kv_cache_memory"]
    if engine.get("cuda_graphs") is False:
        out["enforce_eager"] = True
    if engine.get("max_model_len") is not None:
        out["max_model_len"] = engine["max_model_len"]
    if engine.get("seed") is not None:
        out["seed"] = engine["seed"]
    if engine.get("enable_lora"):  # vLLM's own names: it loads the adapter folders itself
        out["enable_lora"] = True
        out.update({k: engine[k] for k in ("max_loras", "max_lora_rank") if k in engine})
    method = engine.get("speculative")
    if method is not None:
        spec: dict[str, Any] = {"method": "ngram" if method == "ngram" else "draft_model"}
        if method == "draft":
            spec["model"] = engine["draft_model"]
        spec["num_speculative_tokens"] = engine.get(
            "num_speculative_tokens", EngineConfig.num_speculative_tokens
        )
        out["speculative_config"] = spec
    return {**out, **engine_args, **_FIXED_ARGS}


def load_engine(
    opts: Any, engine_config: EngineConfig, load_runtime: Callable[..., Any], ui: Any
) -> tuple[Any, Any]:
    """(runtime, engine) of `opts.backend` for `opts` (a `BatchOptions`), the engine started with
    `engine_config` and warmed up; what the settings came to is said through `ui.info`."""
    from llmctl.runtime.lora import load_adapter  # torch: not for `llmctl --help`

    runtime = _backend_runtime(opts, load_runtime)
    modules = getattr(opts, "lora_modules", {})
    on_vllm = getattr(opts, "backend", DEFAULT_BACKEND) == "vllm"  # it reads the folders itself
    adapters = [] if on_vllm else [load_adapter(n, p) for n, p in modules.items()]
    if adapters:  # wrap only the projections the job's adapters touch
        targets = tuple(sorted(set().union(*(a.targets for a in adapters))))
        engine_config = dataclasses.replace(engine_config, lora_targets=targets)
    engine = runtime.start_engine(engine_config)
    if modules and on_vllm and (note := engine.register_loras(modules)):
        ui.info(note)
    for adapter in adapters:
        engine.lora.register(adapter)
    warm_up = getattr(engine, "warm_up", None)  # our engine: one-time costs before the job clock
    if warm_up is not None:
        warm_up()
    if engine_config.gpu_memory_utilization is not None:
        if not str(getattr(runtime, "device", "cpu")).startswith("cuda"):
            ui.info(
                "--gpu-memory-utilization is for CUDA and ignored on the CPU; the KV cache is "
                "sized by --kv-cache-memory"
            )
        elif engine_config.kv_cache_memory is not None:
            ui.info("--gpu-memory-utilization is ignored: --kv-cache-memory sets the KV cache")
    asked, got = engine_config.max_model_len, getattr(engine, "max_model_len", None)
    if asked is not None and isinstance(got, int) and got < asked:
        ui.info(f"--max-model-len {asked} is above the model's context length; capped to {got}")
    kv = getattr(engine, "kv_cache_bytes", None)
    if kv is not None:
        blocks, bs = getattr(engine, "num_kv_blocks", None), engine_config.block_size
        layout = f", {blocks} blocks of {bs} tokens ({blocks * bs} tokens)" if blocks else ""
        ui.info(f"KV cache: {format_bytes(kv)}{layout}")
    return runtime, engine


def _backend_runtime(opts: Any, load_runtime: Callable[..., Any]) -> Any:
    """The runtime of `opts.backend` for `opts` (a `BatchOptions`): `load_runtime` (llmctl's
    loader, or a test's stand-in) for llmctl, vLLM's offline engine behind the same protocol for
    vllm. Its `start_engine(EngineConfig)` gives the engine."""
    backend = getattr(opts, "backend", DEFAULT_BACKEND)
    engine_args = getattr(opts, "engine_args", {}) or {}
    check_backend(backend, opts.engine, engine_args)
    if backend == "llmctl":
        impl = getattr(opts, "model_impl", "auto")
        return load_runtime(opts.model, dtype=opts.dtype, device=opts.device, model_impl=impl)
    from llmctl.batch.vllm_backend import load_vllm_runtime

    engine = {**opts.engine, **lora_engine_fields(opts)}  # the adapters' fields (vLLM's names)
    return load_vllm_runtime(
        opts.model, opts.dtype, opts.device, vllm_engine_args(engine, engine_args)
    )
