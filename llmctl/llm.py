"""The Python API: `LLM(model).generate(prompts, SamplingParams(...))`, the same engine as the
CLI, in vLLM's shapes so that vLLM scripts run unchanged (`llm.generate(prompts,
sampling_params=..., use_tqdm=False)`, `out.outputs[0].text`, `{"prompt_token_ids": [...]}`,
`llm.chat(conversation)`). `LLM(model, batch_invariant=True)`: each output independent of its
batch-mates (issue 20). `llm.generate(prompts, reorder="prefix")`: prompts sharing a prefix are
admitted one after another (`engine.prefix_order`; outputs still in input order), as
`run-batch --reorder prefix` does.

Owns: `LLM`, the prompt forms it accepts (`TextPrompt`, `TokensPrompt`), and the translation
of vLLM's engine keywords (enforce_eager, gpu_memory_utilization, speculative_config, ...) into
`EngineConfig` fields.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypedDict

from llmctl.engine.config import EngineConfig
from llmctl.engine.lora import LoRARequest
from llmctl.engine.params import RequestOutput, SamplingParams
from llmctl.engine.prefix_order import prefix_order
from llmctl.engine.vllm_config import speculative_from_vllm
from llmctl.errors import RequestError, UsageError
from llmctl.runtime.loader import load_runtime
from llmctl.runtime.lora import load_adapter


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt


def engine_fields(
    enforce_eager: bool,
    gpu_memory_utilization: float | None,
    speculative_config: dict | None,
    tensor_parallel_size: int,
    engine_kwargs: dict,
) -> dict:
    """vLLM's LLM keywords folded into our EngineConfig keywords (which are also accepted)."""
    fields = dict(engine_kwargs)
    if tensor_parallel_size != 1:
        raise UsageError("tensor_parallel_size must be 1: llmctl runs a model on one device")
    if enforce_eager:
        fields["cuda_graphs"] = False
    if speculative_config is not None:
        fields.update(speculative_from_vllm(speculative_config))
    if gpu_memory_utilization is not None:  # EngineConfig checks it; CUDA only, as in run-batch
        fields["gpu_memory_utilization"] = gpu_memory_utilization
    return fields


class LLM:
    """A loaded model with its engine. Engine keywords: see `EngineConfig` (block_size,
    kv_cache_memory, kv_cache_dtype, batch_invariant, ...), and vLLM's: `max_model_len`, `seed`,
    `model_impl` (auto, llmctl or transformers: whose model code runs it), `enable_lora`,
    `max_loras`, `max_lora_rank` (LoRA adapters, given per prompt to `generate`),
    `enforce_eager` (no CUDA graphs), `gpu_memory_utilization` (CUDA: the KV cache fills the
    device up to that fraction; ignored on the CPU), `speculative_config`,
    `tensor_parallel_size=1`."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        *,
        model_impl: str = "auto",
        enforce_eager: bool = False,
        gpu_memory_utilization: float | None = None,
        speculative_config: dict | None = None,
        tensor_parallel_size: int = 1,
        **engine_kwargs: Any,
    ):
        fields = engine_fields(
            enforce_eager,
            gpu_memory_utilization,
            speculative_config,
            tensor_parallel_size,
            engine_kwargs,
        )
        EngineConfig(**fields)  # a bad keyword fails before the model loads
        self.runtime = load_runtime(model, dtype=dtype, device=device, model_impl=model_impl)
        self.engine = self.runtime.start_engine(EngineConfig(**fields))
        self._lora_cache: dict[tuple[str, str], Any] = {}  # (name, path) -> engine.lora.Adapter

    def get_tokenizer(self):
        return self.runtime.tokenizer

    def _prompt_ids(self, prompt: Any) -> tuple[list[int], str | None]:
        """One prompt in any accepted form -> (token ids, its text or None)."""
        if isinstance(prompt, str):
            return self.runtime.encode(prompt), prompt
        if isinstance(prompt, dict):
            extra = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if extra:
                raise RequestError("invalid_type", f"prompt keys not supported: {extra}")
            if prompt.get("prompt_token_ids") is not None:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if isinstance(prompt.get("prompt"), str):
                return self.runtime.encode(prompt["prompt"]), prompt["prompt"]
            raise RequestError(
                "invalid_type", "a dict prompt needs 'prompt' (text) or 'prompt_token_ids'"
            )
        if isinstance(prompt, (list, tuple)):
            return list(prompt), None
        raise RequestError(
            "invalid_type",
            f"a prompt is text, a list of token ids or a dict, got {type(prompt).__name__}",
        )

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable = True,
        *,
        on_finish: Callable[[RequestOutput], None] | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        reorder: str = "none",
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Text prompts, token-id lists or dicts ({"prompt": ...} / {"prompt_token_ids": ...})
        in; outputs in input order. Bad prompts raise RequestError. `use_tqdm` is accepted for
        vLLM scripts; there is no progress bar. `params` is the older name of
        `sampling_params`. `reorder="prefix"` (llmctl's, not vLLM's): the engine gets prompts
        sharing a prefix one after another, so its prefix cache serves them. `lora_request`: one
        LoRARequest for every prompt or one (or None) per prompt, on an LLM made with
        enable_lora=True."""
        if reorder not in ("none", "prefix"):
            raise UsageError(f"reorder must be 'none' or 'prefix', got {reorder!r}")
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        chosen = sampling_params if sampling_params is not None else params
        chosen = chosen if chosen is not None else SamplingParams()
        per = list(chosen) if isinstance(chosen, (list, tuple)) else [chosen] * len(prompts)
        if len(per) != len(prompts):
            raise UsageError(f"{len(per)} sampling params for {len(prompts)} prompts")
        loras = self._adapters(lora_request, len(prompts))
        return self._run([self._prompt_ids(p) for p in prompts], per, on_finish, reorder, loras)

    def _adapters(self, lora_request, n: int) -> list:
        """One engine.lora.Adapter (or None) per prompt, each folder read once per LLM."""
        per = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
        if len(per) != n:
            raise UsageError(f"{len(per)} lora requests for {n} prompts")
        cache = self._lora_cache
        for req in per:
            if req is not None and (req.lora_name, req.lora_path) not in cache:
                cache[req.lora_name, req.lora_path] = load_adapter(req.lora_name, req.lora_path)
        return [None if r is None else cache[r.lora_name, r.lora_path] for r in per]

    def _run(
        self,
        prompts: list[tuple[list[int], str | None]],
        per,
        on_finish,
        reorder: str = "none",
        loras: list | None = None,
    ):
        engine = self.engine
        order = range(len(prompts))
        if reorder == "prefix":
            order = prefix_order([ids for ids, _ in prompts], engine.engine_config.block_size)
        for i in order:
            engine.add_request(str(i), prompts[i][0], per[i], lora=loras[i] if loras else None)
        results: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                out.prompt = prompts[int(out.request_id)][1]
                results[out.request_id] = out
                if on_finish:
                    on_finish(out)
        return [results[str(i)] for i in range(len(prompts))]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable = True,
        *,
        params: SamplingParams | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of them, through the model's chat
        template with the assistant turn opened (and `tools`, OpenAI's function objects, given
        to it as vLLM does; `lora_request` as `generate`'s); outputs in order."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]  # type: ignore[list-item]
        chosen = sampling_params if sampling_params is not None else params
        kw = {"tools": tools} if tools else {}
        ids = [{"prompt_token_ids": self.runtime.apply_chat_template(c, **kw)} for c in messages]
        outs = self.generate(ids, chosen, lora_request=lora_request)
        for o in outs:
            o.prompt = self.runtime.decode(o.prompt_token_ids)
        return outs
