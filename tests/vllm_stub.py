"""A stand-in `vllm` module for the vLLM backend's adapter tests: the few names run-batch uses
(`EngineArgs`, `SamplingParams`, `LLMEngine.from_engine_args`, `sampling_params.RequestOutputKind`,
`platforms.current_platform`, `exceptions.VLLMClientError`, `lora.request.LoRARequest`), shaped
like vLLM 0.32's, with an engine that needs no model.

Each step gives every running request one token (a function of its prompt and position, as
`tests.fakes.FakeEngine`), returned as DELTA outputs; a request finishes at max_tokens or
the context length with "length". `test_real_vllm_api_matches_the_stub` checks these names
against the real vLLM where it imports. `install` puts it in this process's sys.modules;
`write_package` writes a `vllm` package over it for other processes (Ray replicas).
"""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class EngineArgs:
    model: str = ""
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = False
    seed: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    load_format: str = "auto"
    speculative_config: dict | None = None
    gpu_memory_utilization: float = 0.9
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


class VLLMClientError(Exception):
    pass


class VLLMValidationError(VLLMClientError):
    pass


class SamplingParams:
    def __init__(self, **kw: Any):
        if not -2.0 <= kw.get("presence_penalty", 0.0) <= 2.0:  # as vLLM's _verify_args
            raise VLLMValidationError("presence_penalty must be in [-2, 2]")
        self.kw = kw
        self.max_tokens = kw.get("max_tokens", 16)


def token_at(prompt: list[int], k: int) -> int:
    return 40 + (sum(prompt) + 7 * k) % 26  # printable tokens of the demo model's vocabulary


class StubEngine:
    """vLLM's LLMEngine as run-batch drives it; `interrupt_after` raises Ctrl-C at that step."""

    started: list["StubEngine"] = []  # every engine started, newest last (for assertions)
    interrupt_after: int | None = None

    def __init__(self, args: EngineArgs):
        self.args = args
        self.model_config = SimpleNamespace(max_model_len=args.max_model_len or 2048)
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.params: list[SamplingParams] = []
        self.loras: list[LoRARequest | None] = []  # each request's, in order
        self.steps = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "StubEngine":
        engine = cls(args)
        cls.started.append(engine)
        return engine

    def add_request(
        self, request_id: str, prompt: dict, params: SamplingParams, lora_request=None
    ) -> str:
        assert params.kw["output_kind"] is RequestOutputKind.DELTA  # the adapter needs deltas
        assert lora_request is None or self.args.enable_lora  # as vLLM refuses it
        self.params.append(params)
        self.loras.append(lora_request)
        self.requests[request_id] = (list(prompt["prompt_token_ids"]), params, [])
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[Any]:
        self.steps += 1
        if self.interrupt_after is not None and self.steps > self.interrupt_after:
            raise KeyboardInterrupt
        outs = []
        for rid, (prompt, params, out) in list(self.requests.items()):
            tok = token_at(prompt, len(out))
            out.append(tok)
            full = len(prompt) + len(out) >= self.model_config.max_model_len
            finished = len(out) >= params.max_tokens or full
            if finished:
                del self.requests[rid]
            done = SimpleNamespace(
                token_ids=[tok], text=f"<{tok}>", finish_reason="length" if finished else None
            )
            outs.append(SimpleNamespace(request_id=rid, outputs=[done], finished=finished))
        return outs


def install(monkeypatch, device_type: str = "cpu") -> type[StubEngine]:
    """Put the stub in sys.modules as `vllm` (and its submodules); returns the engine class."""

    class Engine(StubEngine):
        started: list[StubEngine] = []

    vllm = types.ModuleType("vllm")
    vllm.EngineArgs, vllm.SamplingParams, vllm.LLMEngine = EngineArgs, SamplingParams, Engine
    sp = types.ModuleType("vllm.sampling_params")
    sp.RequestOutputKind = RequestOutputKind
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(device_type=device_type)
    exceptions = types.ModuleType("vllm.exceptions")
    exceptions.VLLMClientError, exceptions.VLLMValidationError = (
        VLLMClientError,
        VLLMValidationError,
    )
    vllm.sampling_params, vllm.platforms, vllm.exceptions = sp, platforms, exceptions
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    vllm.lora, lora.request = lora, request
    modules = {"vllm": vllm, "vllm.sampling_params": sp, "vllm.platforms": platforms}
    modules.update({"vllm.exceptions": exceptions, "vllm.lora": lora, "vllm.lora.request": request})
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return Engine


# The files of a `vllm` package over this module, for processes that import vllm from a path.
PACKAGE = {
    "__init__.py": "from vllm_stub import EngineArgs, SamplingParams, StubEngine as LLMEngine\n",
    "sampling_params.py": "from vllm_stub import RequestOutputKind\n",
    "platforms.py": "from types import SimpleNamespace\n\n"
    "current_platform = SimpleNamespace(device_type='cpu')\n",
    "exceptions.py": "from vllm_stub import VLLMClientError, VLLMValidationError\n",
}


def write_package(parent: Path) -> Path:
    """Write the `vllm` package folder under `parent`; its importers need this module
    (`vllm_stub`) on their path too. Returns the folder."""
    folder = parent / "vllm"
    folder.mkdir()
    for name, text in PACKAGE.items():
        (folder / name).write_text(text)
    return folder
