"""The output fields of rows that asked for logprobs, prompt_logprobs or n > 1, in each shape.

Owns: the simple shape's `logprobs` / `prompt_logprobs` lists and its `outputs` list (n > 1),
the OpenAI chat shape (`choice.logprobs.content[]` with token, logprob, bytes, top_logprobs),
the OpenAI completions shape (`choice.logprobs` with tokens, token_logprobs, top_logprobs,
text_offset), and vLLM's `prompt_logprobs` ({token id: {logprob, rank, decoded_token}} per
prompt token, null first). Rows that asked for none of them get none of these fields.
"""

from __future__ import annotations

from typing import Any

Position = dict  # token id -> engine.params.Logprob, the scored token first


def _token(tid: int, lp: Any) -> dict:
    return {"token": lp.decoded_token, "token_id": tid, "logprob": lp.logprob}


def _top(pos: Position, k: int) -> list[tuple[int, Any]]:
    """The k alternatives by rank (the scored token among them when it ranks that high)."""
    return sorted(((t, v) for t, v in pos.items() if v.rank <= k), key=lambda tv: tv[1].rank)[:k]


def _simple_position(pos: Position, k: int | None) -> dict:
    """One position: the scored token (the first key) and its top alternatives by rank."""
    (tid, lp), *_ = pos.items()
    top = [_token(t, v) for t, v in _top(pos, k or 0)]
    return {**_token(tid, lp), "rank": lp.rank, "top_logprobs": top}


def simple_logprobs(positions: list[Position], k: int | None) -> list[dict]:
    return [_simple_position(p, k) for p in positions]


def simple_prompt_logprobs(positions: list[Position | None], k: int | None) -> list[dict | None]:
    return [None if p is None else _simple_position(p, k) for p in positions]


def simple_fields(result: Any, include_token_ids: bool) -> dict:
    """Fields added to a simple row: logprobs (n = 1), outputs (n > 1), prompt_logprobs."""
    rec: dict = {}
    outs = result.outputs or []
    k, pk = result.logprobs_k, result.prompt_logprobs_k
    if len(outs) > 1:
        rec["outputs"] = []
        for c in outs:
            o: dict = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason}
            if include_token_ids:
                o["token_ids"] = list(c.token_ids)
            if c.logprobs is not None:
                o["logprobs"] = simple_logprobs(c.logprobs, k)
            if getattr(c, "structured_output", None) is not None:
                o["structured_output"] = c.structured_output
            rec["outputs"].append(o)
    elif outs and outs[0].logprobs is not None:
        rec["logprobs"] = simple_logprobs(outs[0].logprobs, k)
    if result.prompt_logprobs is not None:
        rec["prompt_logprobs"] = simple_prompt_logprobs(result.prompt_logprobs, pk)
    return rec


def _bytes(text: str | None) -> list[int] | None:
    return None if text is None else list(text.encode("utf-8", "backslashreplace"))


def chat_logprobs(positions: list[Position], k: int) -> dict:
    """OpenAI chat: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": null}."""
    content = []
    for pos in positions:
        (_, lp), *_ = pos.items()
        top = [
            {"token": v.decoded_token, "logprob": v.logprob, "bytes": _bytes(v.decoded_token)}
            for _, v in _top(pos, k)
        ]
        content.append(
            {
                "token": lp.decoded_token,
                "logprob": lp.logprob,
                "bytes": _bytes(lp.decoded_token),
                "top_logprobs": top,
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(positions: list[Position], k: int) -> dict:
    """OpenAI completions: tokens, token_logprobs, top_logprobs (token -> logprob: the top k and
    the sampled token, so up to k + 1 entries) and text_offset (from the completion's start)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for pos in positions:
        (_, lp), *_ = pos.items()
        tokens.append(lp.decoded_token)
        token_lps.append(lp.logprob)
        top = {v.decoded_token: v.logprob for _, v in _top(pos, k)}
        top.setdefault(lp.decoded_token, lp.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(lp.decoded_token or "")
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(positions: list[Position | None]) -> list[dict | None]:
    """vLLM's shape: per prompt token, {token id: {logprob, rank, decoded_token}}; null first."""
    return [
        None
        if p is None
        else {
            str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
            for t, v in p.items()
        }
        for p in positions
    ]


def openai_choices(result: Any, endpoint: str, include_token_ids: bool) -> list[dict]:
    """The n choices of an OpenAI response body, each with its logprobs (null when not asked)."""
    choices = []
    k = result.logprobs_k or 0
    for c in result.outputs:
        lps = None
        if c.logprobs is not None:
            shape = chat_logprobs if endpoint == "chat" else completion_logprobs
            lps = shape(c.logprobs, k)
        if endpoint == "chat":
            choice: dict = {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": lps,
                "finish_reason": c.finish_reason,
            }
        else:
            choice = {
                "index": c.index,
                "text": c.text,
                "logprobs": lps,
                "finish_reason": c.finish_reason,
            }
        if include_token_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    return choices
