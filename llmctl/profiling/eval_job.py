"""`llmctl eval` end to end, minus the terminal: read the data, load the model(s), score, record.

Owns: `EvalRequest` (every eval option and its default), reading --data (plain text, or the
"text" fields of JSONL), the checks before scoring (a tokenizer, a window within the context, a
reference with the same vocabulary), the versioned record and `eval_rows`, the lines a table
shows. The math is `llmctl.runtime.evaluate` (shared with the quantize and sparsify reports).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmctl.errors import UsageError
from llmctl.profiling.dtypes import canonical_dtype
from llmctl.profiling.environment import environment

EVAL_SCHEMA, EVAL_SCHEMA_VERSION = "llmctl.eval", 1
WindowProgress = Callable[[int, int], None]  # (windows done, windows)


@dataclass(frozen=True)
class EvalRequest:
    """The options of one eval (the command passes the ones a user set)."""

    data: Path
    seq_len: int = 512  # tokens per window (at most the model's context)
    stride: int | None = None  # None: seq_len / 2
    reference: str | None = None  # model for KL(reference || model)
    max_tokens: int | None = None  # only the first N tokens of the data
    dtype: str = "auto"
    device: str = "auto"


def read_text(path: Path) -> str:
    """Plain text, or the "text" fields of a JSONL file joined by blank lines."""
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read --data {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--data {path} is not UTF-8 text") from None
    if path.suffix.lower() not in (".jsonl", ".ndjson"):
        return raw
    docs = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise UsageError(f'{path}:{n}: each JSONL row needs a string "text" field')
        docs.append(row["text"])
    return "\n\n".join(docs)


def _token_ids(runtime, req: EvalRequest) -> list[int]:
    text = read_text(req.data)
    if runtime.tokenizer is None:
        raise UsageError(f"{runtime.model_name} has no tokenizer; eval needs one to read --data")
    context = runtime.config.max_position_embeddings
    if req.seq_len > context:
        raise UsageError(f"--seq-len {req.seq_len} exceeds the model's context ({context})")
    ids = runtime.encode(text)
    return ids if req.max_tokens is None else ids[: req.max_tokens]


def _reference_model(runtime, req: EvalRequest):
    from llmctl.runtime.resolve import resolve_model_path
    from llmctl.runtime.weights import load_model

    model, config = load_model(resolve_model_path(req.reference), req.dtype, runtime.device)
    if config.vocab_size != runtime.config.vocab_size:
        raise UsageError(
            f"--reference has vocabulary {config.vocab_size}, the model "
            f"{runtime.config.vocab_size}; KL needs the same tokenizer"
        )
    return model


def run_eval(
    model: str | None,
    req: EvalRequest,
    load_runtime: Callable[..., Any],
    progress: WindowProgress | None = None,
) -> dict[str, Any]:
    """Score `model` (None: the demo model) on req.data and return the eval record."""
    from llmctl.runtime.evaluate import METHOD, perplexity

    runtime = load_runtime(model, dtype=req.dtype, device=req.device)
    ids = _token_ids(runtime, req)
    ref_model = None if req.reference is None else _reference_model(runtime, req)
    result = perplexity(runtime.model, ids, req.seq_len, req.stride, ref_model, progress)
    return {
        "schema": EVAL_SCHEMA,
        "schema_version": EVAL_SCHEMA_VERSION,
        "model": runtime.model_name,
        "reference": req.reference,
        "data": str(req.data),
        "method": METHOD,
        "environment": environment(runtime.device, canonical_dtype(runtime.dtype)),
        "result": result.to_dict(),
    }


def eval_rows(record: dict[str, Any]) -> list[tuple[str, str]]:
    """The (label, value) lines of the eval table."""
    r, env = record["result"], record["environment"]
    rows = [
        ("perplexity", f"{r['perplexity']:.4f}"),
        ("mean NLL (nats/token)", f"{r['mean_nll']:.5f}"),
    ]
    if r["mean_kl"] is not None:
        rows += [
            ("mean KL(reference || model)", f"{r['mean_kl']:.6f} nats"),
            ("reference perplexity", f"{r['reference_perplexity']:.4f}"),
        ]
    rows += [
        ("scored tokens / tokens", f"{r['num_scored_tokens']:,} / {r['num_tokens']:,}"),
        ("windows (seq-len, stride)", f"{r['num_windows']} ({r['seq_len']}, {r['stride']})"),
        ("dtype, device", f"{env['dtype']}, {env['device']}"),
    ]
    return rows
