"""The per-row generation fields of run-batch rows: sampling overrides (the SamplingParams fields
by their row names), n / logprobs / prompt_logprobs in each row shape's spelling, a row's
`sampling_params` object (Ray Data LLM and vLLM rows), and the features refused rather than
ignored. Pure functions on parsed JSON values; they raise RequestError (the row's error).

Owns: OVERRIDE_KEYS, OUTPUT_KEYS, STRUCTURED_KEYS, NEUTRAL_VALUES, `row_overrides`,
`output_overrides`, `structured_override` (a row's output constraint in any of its spellings),
`sampling_params_overrides`, `refuse_unsupported`. The row shapes themselves are rows.py's.
"""

from __future__ import annotations

from llmctl.engine.requests import check_text, json_type, show
from llmctl.engine.structured import StructuredOutputsParams
from llmctl.errors import RequestError

OVERRIDE_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
)
# Generation features llmctl does not implement, with the values that ask for none of them. In an
# OpenAI body every other unknown field is refused too; a simple row may carry other keys.
NEUTRAL_VALUES: dict[str, tuple] = {
    "best_of": (1,),
    "stream": (False,),
    "stream_options": (),
    "echo": (False,),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
}


def request_error(code: str, message: str, param: str | None = None) -> RequestError:
    return RequestError(code, message, param=param)


_OVERRIDE_SHAPES = {
    "stop": ("a string or an array of strings", (str, list)),
    "ignore_eos": ("true or false", (bool, int, float, str)),
}


def row_overrides(obj: dict, where: str = "") -> dict:
    """The row's sampling overrides, as given; values in the wrong JSON shape are refused here
    (an array where a number goes), their ranges and types by SamplingParams (job)."""
    out = {}
    for key in (*OVERRIDE_KEYS, "max_completion_tokens"):
        value = obj.get(key)
        if value is None:
            continue
        wanted, shapes = _OVERRIDE_SHAPES.get(key, ("a number", (bool, int, float, str)))
        if not isinstance(value, shapes):
            raise request_error(
                "invalid_parameter",
                f"{where}{key} must be {wanted}, got {json_type(value)}",
                param=key,
            )
        if key == "stop":
            for s in [value] if isinstance(value, str) else value:
                if isinstance(s, str):
                    check_text(s, f"{where}stop")
        out["max_tokens" if key == "max_completion_tokens" else key] = value
    return out


OUTPUT_KEYS = ("n", "logprobs", "top_logprobs", "prompt_logprobs")


def output_overrides(obj: dict, endpoint: str | None = None, where: str = "") -> dict:
    """n, logprobs and prompt_logprobs as SamplingParams fields (their ranges are checked
    there). Simple rows and completions ask `logprobs: k`; chat asks `logprobs: true` with
    `top_logprobs: k` (OpenAI's spellings)."""
    out = {k: obj[k] for k in ("n", "prompt_logprobs") if obj.get(k) is not None}
    lp, top = obj.get("logprobs"), obj.get("top_logprobs")
    if endpoint == "chat":
        if lp is not None and not isinstance(lp, bool):
            raise request_error(
                "invalid_parameter", f"{where}logprobs must be true or false", param="logprobs"
            )
        if top is not None and not lp:
            raise request_error(
                "invalid_parameter",
                f"{where}top_logprobs needs {where}logprobs: true",
                param="top_logprobs",
            )
        if lp:
            out["logprobs"] = 0 if top is None else top
        return out
    if top is not None and top != 0:
        raise request_error(
            "invalid_parameter",
            f"{where}top_logprobs is the chat endpoint's; here logprobs: K asks for K alternatives",
            param="top_logprobs",
        )
    if lp is True:
        raise request_error(
            "invalid_parameter",
            f"{where}logprobs must be the number of alternatives (0 to 20), got true",
            param="logprobs",
        )
    if lp is not None and lp is not False:
        out["logprobs"] = lp
    return out


# Where a row asks for structured outputs: vLLM's object, its older per-kind fields (and Ray Data
# LLM's older `guided_decoding` object), and OpenAI's `response_format`.
GUIDED_KINDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KEYS = ("structured_outputs", "guided_decoding", *GUIDED_KINDS, "response_format")


def structured_override(obj: dict, where: str = "") -> dict:
    """{"structured_outputs": StructuredOutputsParams} for the row's constraint, or {}; more
    than one spelling in a row, or a wrong one, is the row's error naming the field."""
    given = [k for k in STRUCTURED_KEYS if obj.get(k) is not None]
    if given == ["response_format"]:
        found = _response_format(obj["response_format"], f"{where}response_format")
        return {} if found is None else {"structured_outputs": found}
    if len(given) > 1:
        raise request_error(
            "invalid_parameter",
            f"{where}{given[0]} and {where}{given[1]} both constrain the output; give one",
            param=given[1],
        )
    if not given:
        return {}
    key = given[0]
    value = obj[key] if key not in GUIDED_KINDS else {GUIDED_KINDS[key]: obj[key]}
    return {"structured_outputs": StructuredOutputsParams.of(value, f"{where}{key}")}


def _response_format(value: object, at: str) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema with
    {name, schema, strict}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, source=at)
    if kind != "json_schema":
        raise request_error(
            "invalid_parameter",
            f"{at} must be an object whose type is text, json_object or json_schema, got "
            f"{show(value)}",
            param="response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or spec.get("schema") is None:
        raise request_error(
            "invalid_parameter",
            f"{at}.json_schema must be an object with a schema (and a name)",
            param="response_format",
        )
    return StructuredOutputsParams(json=spec["schema"], source=f"{at}.json_schema.schema")


def _is_neutral(value: object, neutral: tuple) -> bool:
    return any(type(value) is type(n) and value == n for n in neutral)


def refuse_unsupported(
    obj: dict, allowed: tuple | None, where: str = "", neutral_values: dict = NEUTRAL_VALUES
) -> None:
    """A generation feature we do not implement is an error, never silently ignored. With
    `allowed` (an OpenAI body, sampling_params) every field not in it is such a feature."""
    for key, value in obj.items():
        if value is None or (allowed is not None and key in allowed):
            continue
        neutral = neutral_values.get(key)
        if neutral is None and allowed is None:
            continue  # a simple row's own columns (metadata) are passed over
        if neutral is None or not _is_neutral(value, neutral):
            raise request_error(
                "unsupported_parameter",
                f"{where}{key}={show(value)} is not supported: run-batch answers with text "
                f"(n of them with n; constrained with response_format or structured_outputs), "
                f"not streams or tool calls; remove the field",
                param=key,
            )


# vLLM SamplingParams fields a row's `sampling_params` may hold besides OVERRIDE_KEYS and
# stop_token_ids, with the values that change nothing here (other values are refused).
VLLM_NEUTRAL_VALUES: dict[str, tuple] = {
    "min_tokens": (0,),
    "detokenize": (True,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "bad_words": ([],),
    "flat_logprobs": (False,),
    "extra_args": ({},),
}


def sampling_params_overrides(obj: dict, overrides: dict) -> dict:
    """`overrides` with the row's `sampling_params` object (Ray Data LLM and vLLM rows: the
    SamplingParams fields by vLLM's names) merged in; a field given both there and in the row
    with another value, or one llmctl does not implement, is the row's error."""
    sp = obj.get("sampling_params")
    if sp is None:
        return overrides
    if not isinstance(sp, dict):
        raise request_error(
            "invalid_parameter",
            f"sampling_params must be an object, got {json_type(sp)}",
            param="sampling_params",
        )
    sp = {k: v for k, v in sp.items() if v is not None}
    known = (*OVERRIDE_KEYS, "n", "logprobs", "prompt_logprobs", "stop_token_ids", *STRUCTURED_KEYS)
    refuse_unsupported(sp, known, "sampling_params.", {**NEUTRAL_VALUES, **VLLM_NEUTRAL_VALUES})
    merged = dict(overrides)
    found = {
        **row_overrides(sp, "sampling_params."),
        **output_overrides(sp, None, "sampling_params."),
        **structured_override(sp, "sampling_params."),
    }
    ids = sp.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise request_error(
                "invalid_parameter",
                "sampling_params.stop_token_ids must be an array of integers",
                param="stop_token_ids",
            )
        found["stop_token_ids"] = ids
    for key, value in found.items():
        if key in merged and merged[key] != value:
            raise request_error(
                "invalid_parameter",
                f"{key} is given in the row ({show(merged[key])}) and in sampling_params "
                f"({show(value)}); give it once",
                param=key,
            )
        merged[key] = value
    return merged
