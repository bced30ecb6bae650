"""PEFT adapters with random non-zero weights for the LoRA tests, and transformers + PEFT
(merged) greedy references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_engine_exactness import model_greedy

# two adapters on different projections; the second with rsLoRA scaling
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "down_proj"], use_rslora=True),
}


def make_adapter(base: Path, folder: Path, seed: int, **config) -> Path:
    """Save a PEFT LoRA adapter of `base` whose A and B are random (PEFT starts B at zero, which
    would make the adapter a no-op)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft = get_peft_model(hf, LoraConfig(**config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft.save_pretrained(str(folder))
    return folder


def merged_greedy(
    base: Path, adapter: Path | None, prompts, max_new: int, weights: dict | None = None
) -> list[list[int]]:
    """transformers' greedy tokens with `adapter` merged into the weights (None: the base);
    `weights`: tensors by name replacing the base's first (a quantized model's dequantized
    weights)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if weights:
        missing = set(weights) - set(hf.state_dict())
        assert not missing, missing
        hf.load_state_dict(weights, strict=False)
    if adapter is not None:
        from peft import PeftModel

        hf = PeftModel.from_pretrained(hf, str(adapter)).merge_and_unload()
    return model_greedy(hf, prompts, max_new)


@pytest.fixture(scope="module")
def adapters(shakespeare_model, tmp_path_factory):
    """name -> folder of each ADAPTERS adapter of the tinyshakespeare fixture."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(shakespeare_model, root / name, seed, **cfg)
        for seed, (name, cfg) in enumerate(ADAPTERS.items())
    }
