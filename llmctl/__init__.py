"""llmctl: compress large language models and push millions of prompts through them offline.

The Python API mirrors the CLI: `llmctl.LLM(model).generate(prompts, SamplingParams(...))`.
Heavy modules are imported lazily so `import llmctl` (and `llmctl --help`) stays fast.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]


def __getattr__(name: str):
    if name in ("LLM", "TextPrompt", "TokensPrompt"):
        import llmctl.llm

        return getattr(llmctl.llm, name)
    if name == "SamplingParams":
        from llmctl.engine.params import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from llmctl.engine.lora import LoRARequest

        return LoRARequest
    if name == "StructuredOutputsParams":
        from llmctl.engine.structured import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(name)
