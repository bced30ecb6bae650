"""A model ready to serve: weights, tokenizer and EOS ids bundled into a `Runtime`.

Owns: `Runtime` (model, config, text codec; `start_engine` builds an engine over them, which
prepares the model for inference, and loads a draft model for speculative decoding)
and `load_runtime`. Resolving the model is in resolve.py,
weights in weights.py, the tokenizer and chat template in tokenizer.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import UsageError
from llmctl.models.config import ModelConfig
from llmctl.runtime.resolve import resolve_device, resolve_dtype, resolve_model_path
from llmctl.runtime.tokenizer import TextCodec, TextMethods, load_tokenizer, read_generation_eos
from llmctl.runtime.weights import load_model


@dataclass
class Runtime(TextMethods):
    """A loaded model with its tokenizer, ready to serve through `start_engine`."""

    model: Any
    config: ModelConfig
    tokenizer: Any
    model_path: Path
    dtype: Any
    device: str
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        self.text = TextCodec(self.tokenizer)

    def start_engine(self, engine_config=None):
        """A new engine over this model (`EngineConfig` settings); loads the draft model first when
        `speculative == "draft"`."""
        from llmctl.engine.grammar import Grammars
        from llmctl.engine.llm_engine import LLMEngine

        native = getattr(getattr(engine_config, "kernels", None), "native", True)
        grammars = None
        if self.tokenizer is not None:  # structured outputs: matchers over this tokenizer
            grammars = Grammars(self.tokenizer, self.config.vocab_size, self.eos_token_ids, native)
        return LLMEngine(
            self.model,
            self.config,
            engine_config,
            eos_token_ids=self.eos_token_ids,
            detokenize=self.decode,
            proposer=self._proposer(engine_config),
            grammars=grammars,
            device=self.device,
            dtype=self.dtype,
        )

    def _proposer(self, engine_config):
        from llmctl.engine.spec_decode import DraftModelProposer, NgramProposer

        mode = getattr(engine_config, "speculative", None)
        if mode == "ngram":
            return NgramProposer(engine_config.prompt_lookup_max, engine_config.prompt_lookup_min)
        if mode != "draft":
            return None
        dtype = str(self.dtype).replace("torch.", "")
        draft, dcfg = load_model(resolve_model_path(engine_config.draft_model), dtype, self.device)
        if not dcfg.native:
            raise UsageError(f"the draft model cannot run natively: {dcfg.not_native}")
        if dcfg.vocab_size != self.config.vocab_size:
            raise UsageError(
                f"the draft model's vocabulary ({dcfg.vocab_size}) differs from the "
                f"target's ({self.config.vocab_size})"
            )
        return DraftModelProposer(draft, self.device)


def load_runtime(
    model: str | os.PathLike | None = None,
    dtype: str = "auto",
    device: str = "auto",
    model_impl: str = "auto",
) -> Runtime:
    """Load everything needed to serve `model` (None: the embedded demo model); `model_impl`:
    auto, llmctl or transformers (runtime/weights.py)."""
    import torch

    path = resolve_model_path(model)
    device = resolve_device(device)
    net, config = load_model(path, dtype, device, model_impl)
    dtype_t = (
        next(net.parameters()).dtype if dtype == "auto" else resolve_dtype(dtype, config, device)
    )
    return Runtime(
        model=net,
        config=config,
        tokenizer=load_tokenizer(path),
        model_path=path,
        dtype=dtype_t if isinstance(dtype_t, torch.dtype) else torch.float32,
        device=device,
        eos_token_ids=read_generation_eos(path, config),
    )
