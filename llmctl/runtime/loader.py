"""Loading a model: resolve a folder or hub id, read config/tokenizer/generation config, map weights.

Owns: `resolve_model_path`, `load_model` (safetensors only, memory-mapped, never pickle) and
`load_runtime`, which bundles model and tokenizer into a `Runtime` that starts engines over them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import ModelLoadError, RequestError, UsageError
from llmctl.models.config import ModelConfig

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "data" / "demo-model"
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
           "float32": "float32", "fp32": "float32", "float": "float32"}


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """None -> the embedded demo model; an existing folder -> itself; otherwise a hub id, when online."""
    if model is None or str(model) == "":
        return DEMO_MODEL_DIR
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.exists():
        raise ModelLoadError(f"{path} is a file; pass the model folder that holds config.json")
    text = str(model)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise ModelLoadError(f"model folder {text!r} not found")
    return _download(text)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]))
    except Exception as e:  # offline, unknown repo, gated: all the same advice
        raise ModelLoadError(
            f"cannot fetch {repo_id!r} from the hub ({type(e).__name__}); download it where the hub is "
            f"reachable and pass the local folder instead: --model /path/to/folder"
        ) from None


def resolve_dtype(dtype: str, config: ModelConfig, device: str):
    """--dtype to a torch dtype. auto: the checkpoint's dtype, except on the CPU, where half precision
    becomes bfloat16 (fast CPU half matmuls are rare), or float32 when the CPU has no bf16 units
    (`cpu_bf16.native_bf16`: PyTorch's bf16 matmuls there run several times slower than float32)."""
    import torch

    from llmctl.kernels.cpu_bf16 import native_bf16

    if dtype == "auto":
        wanted = _DTYPES.get(str(config.torch_dtype or "float32").replace("torch.", ""), "float32")
        if wanted in ("float16", "bfloat16") and device == "cpu":
            wanted = "bfloat16" if native_bf16() else "float32"
        return getattr(torch, wanted)
    if dtype not in _DTYPES:
        raise UsageError(f"unknown --dtype {dtype!r}; use auto, bfloat16, float16 or float32")
    return getattr(torch, _DTYPES[dtype])


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageError(f"unknown --device {device!r}; use auto, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but no CUDA device is available")
    return device


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shard {missing[0]} named in the index is missing")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise ModelLoadError(f"{path} holds only pickle checkpoints (.bin/.pt); llmctl loads safetensors only, never pickle")
    raise ModelLoadError(f"{path} has no .safetensors weights")


def load_model(path: Path, dtype: str = "auto", device: str = "cpu"):
    """Build our model for `path` and copy its safetensors weights in. Returns (model, config)."""
    import torch
    from safetensors import safe_open

    from llmctl.models.llama import LlamaForCausalLM

    config = ModelConfig.from_file(path / "config.json")
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, config, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    quant = config.raw.get("quantization_config")
    if quant is not None:
        return _load_quantized(model, path, config, quant, torch_dtype, device)
    params = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name not in params:
                    raise ModelLoadError(f"{file.name}: unexpected tensor {name!r} for a {config.model_type} model")
                t = f.get_tensor(name)
                if tuple(t.shape) != tuple(params[name].shape):
                    raise ModelLoadError(f"{file.name}: {name} has shape {tuple(t.shape)}, expected {tuple(params[name].shape)}")
                # Always a copy: get_tensor may return a view of the memory-mapped file, which the file
                # could change under us, at the file's alignment (safetensors' header leaves data
                # 8-byte aligned; the CPU kernels measured ~20% slower on such weights than on 64).
                loaded[name] = t.to(device=device, dtype=torch_dtype, copy=True)
    if config.tie_word_embeddings:
        loaded.pop("lm_head.weight", None)
    missing = [n for n in params if n not in loaded and not (config.tie_word_embeddings and n == "lm_head.weight")]
    if missing:
        raise ModelLoadError(f"{path}: weights missing for {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _materialise_buffers(model, config, device)
    model = model.eval().requires_grad_(False)
    _accelerate_2of4(model, config)
    return model, config


def _accelerate_2of4(model, config: ModelConfig) -> None:
    """A 2:4 checkpoint from `llmctl sparsify` (config.json `sparsity_config.pattern == "2:4"`): on an
    Ampere+ GPU, swap its pruned linears to semi-structured sparse where timed faster; elsewhere they
    stay dense. The per-linear decisions are kept on `model.semi_structured` for reports and tests."""
    meta = config.raw.get("sparsity_config") or {}
    if meta.get("pattern") != "2:4":
        return
    from llmctl.compress.sparse import semi_structured as ss

    model.semi_structured = ss.accelerate_from_config(model, config.raw, timer=ss.time_dense_vs_sparse)


def _materialise_buffers(model, config: ModelConfig, device: str) -> None:
    from llmctl.models.rope import RotaryEmbedding

    rotary = RotaryEmbedding(config).to(device)
    model.rotary.cos, model.rotary.sin = rotary.cos, rotary.sin


def _load_quantized(model, path, config, quant, torch_dtype, device):
    try:
        from llmctl.compress.formats import load_quantized  # provided by the quantize work
    except ImportError:
        raise ModelLoadError(f"{path}: quantized checkpoints ({quant.get('quant_method')}) are not supported in this build") from None
    model = load_quantized(model, path, config, quant, torch_dtype, device)
    _materialise_buffers(model, config, device)
    return model.eval().requires_grad_(False), config


def read_generation_eos(path: Path, config: ModelConfig) -> tuple[int, ...]:
    """EOS ids from generation_config.json, falling back to config.json."""
    ids = list(config.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            eos = [eos]
        if eos:
            ids = list(eos)
    return tuple(dict.fromkeys(ids))


def load_tokenizer(path: Path):
    """The model's tokenizer, or None when the folder has none (token-id prompts only)."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None


@dataclass
class Runtime:
    """A loaded model with its tokenizer, ready to serve through `start_engine`."""

    model: Any
    config: ModelConfig
    tokenizer: Any
    model_path: Path
    dtype: Any
    device: str
    eos_token_ids: tuple[int, ...]

    def start_engine(self, engine_config=None):
        """A new engine over this model (`EngineConfig` settings); loads the draft model first when
        `speculative == "draft"`."""
        from llmctl.engine.llm_engine import LLMEngine

        return LLMEngine(self.model, self.config, engine_config, eos_token_ids=self.eos_token_ids,
                         detokenize=self.decode, proposer=self._proposer(engine_config),
                         device=self.device, dtype=self.dtype)

    def _proposer(self, engine_config):
        from llmctl.engine.spec_decode import DraftModelProposer, NgramProposer

        mode = getattr(engine_config, "speculative", None)
        if mode == "ngram":
            return NgramProposer()
        if mode != "draft":
            return None
        dtype = str(self.dtype).replace("torch.", "")
        draft, dcfg = load_model(resolve_model_path(engine_config.draft_model), dtype, self.device)
        if dcfg.vocab_size != self.config.vocab_size:
            raise UsageError(f"the draft model's vocabulary ({dcfg.vocab_size}) differs from the "
                             f"target's ({self.config.vocab_size})")
        return DraftModelProposer(draft, self.device)

    @property
    def model_name(self) -> str:
        return "llmctl-demo" if self.model_path == DEMO_MODEL_DIR else str(self.model_path)

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise RequestError("no_tokenizer", f"this model has no tokenizer; {what} needs one (use prompt_token_ids)")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._need_tokenizer("a text prompt").encode(text))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: Any) -> list[int]:
        tok = self._need_tokenizer("a chat prompt")
        validate_messages(messages)
        if not getattr(tok, "chat_template", None):
            raise RequestError("no_chat_template", "this model has no chat template; send `prompt` instead of `messages`")
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)


def validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("invalid_type", "messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise RequestError("invalid_type", f"messages[{i}] must be an object with role and content")
        if m["role"] not in CHAT_ROLES:
            raise RequestError("invalid_role", f"messages[{i}] has unknown role {m['role']!r}; known: {', '.join(CHAT_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise RequestError("invalid_type", f"messages[{i}].content must be a string")


def load_runtime(model: str | os.PathLike | None = None, dtype: str = "auto", device: str = "auto") -> Runtime:
    """Load everything needed to serve `model` (None: the embedded demo model)."""
    import torch

    path = resolve_model_path(model)
    device = resolve_device(device)
    net, config = load_model(path, dtype, device)
    dtype_t = next(net.parameters()).dtype if dtype == "auto" else resolve_dtype(dtype, config, device)
    return Runtime(
        model=net,
        config=config,
        tokenizer=load_tokenizer(path),
        model_path=path,
        dtype=dtype_t if isinstance(dtype_t, torch.dtype) else torch.float32,
        device=device,
        eos_token_ids=read_generation_eos(path, config),
    )
