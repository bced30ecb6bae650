"""Structured outputs: what a constrained request asks for, the grammar that enforces it, and the
check of a finished output against it.

Owns: `StructuredOutputsParams` (vLLM's: exactly one of `json` (a JSON schema), `json_object`,
`regex`, `choice`, `grammar` (Lark, or GBNF/EBNF with `::=`)), `constraint_error` (a request
error naming the constraint's field), `grammar_of` (the grammar engine's grammar for a
constraint, or the request's error: a schema, pattern or grammar that is wrong is
`invalid_parameter` naming the field, a schema feature the engine cannot compile is
`unsupported_parameter`) and `check_output` (after decoding: the JSON parses and validates
against the schema, the text is one of the choices, the pattern matches). Pure functions of the
request: the matchers, bound to a tokenizer, are engine/grammar.py's.

The grammar engine is llguidance, chosen over xgrammar by measurement (BENCHMARKS.md, grammar
engines): a schema compiles in under 1 ms (xgrammar 3-10 ms), and a JSON Schema keyword it does
not implement is refused by name, where xgrammar silently drops `uniqueItems`, `not`, `if/then`
and `multipleOf` and lets invalid output through; xgrammar's per-token mask is cheaper (2 us
against 20-30 us), small against a decode step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from llmctl.engine.requests import json_type, show
from llmctl.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it by default, which models have seen most: ", " and ": ", no other
# whitespace (a free-whitespace grammar lets a weak model pad until max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CHOICES = 4096


def constraint_error(source: str, message: str, code: str = "invalid_parameter") -> RequestError:
    """The request's error; `param` (OpenAI's) is the request field holding the constraint."""
    parts = source.split(".")
    param = parts[1] if parts[0] in ("body", "sampling_params") and len(parts) > 1 else parts[0]
    return RequestError(code, f"{source}: {message}", param=param)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's `StructuredOutputsParams`; exactly one field set).
    `source` names where the request gave it, for error messages (not compared)."""

    json: Any = None  # a JSON schema: an object (or its JSON text), or true
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    source: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else " and ".join(given)
            raise constraint_error(
                self.source, f"give exactly one of {', '.join(KINDS)} (got {what})"
            )
        if isinstance(self.json, str):  # vLLM takes the schema as JSON text too
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as e:
                raise constraint_error(f"{self.source}.json", f"not JSON: {e}") from None
        self._check_types()

    def _check_types(self) -> None:
        kind, value, at = self.kind, self.value, f"{self.source}.{self.kind}"
        if kind == "json" and not isinstance(value, (dict, bool)):
            raise constraint_error(at, f"a JSON schema must be an object, got {json_type(value)}")
        if kind == "json_object" and value is not True:
            raise constraint_error(at, f"must be true, got {show(value)}")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise constraint_error(at, f"must be a non-empty string, got {show(value)}")
        if kind == "choice":
            if not isinstance(value, list) or not value or len(value) > MAX_CHOICES:
                raise constraint_error(at, f"must be a list of 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in value):
                raise constraint_error(at, "every choice must be a non-empty string")

    @classmethod
    def of(cls, value: Any, source: str = "structured_outputs") -> StructuredOutputsParams:
        """From a request's object (vLLM's field names) or an instance (kept)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise constraint_error(source, f"must be an object, got {json_type(value)}")
        if isinstance(value.get("source"), str):  # dataclasses.asdict of one (Ray's rows)
            value = dict(value)
            source = value.pop("source")
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise constraint_error(
                source, f"unknown field {unknown[0]!r}; use one of {', '.join(KINDS)}",
                "unsupported_parameter",
            )  # fmt: skip
        return cls(**{k: v for k, v in value.items() if v is not None}, source=source)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def value(self) -> Any:
        return getattr(self, self.kind)

    def key(self) -> str:
        """The same text for equal constraints: what compiled grammars are cached by."""
        return f"{self.kind}\x1f{json.dumps(self.value, sort_keys=True)}"

    def to_dict(self) -> dict:
        return {self.kind: self.value}


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) enforcing `params`; the request's error where the
    constraint is wrong or cannot be compiled (the grammar engine checks it without a
    tokenizer)."""
    from llguidance import LLMatcher

    kind, value, at = params.kind, params.value, f"{params.source}.{params.kind}"
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else value
        _check_schema(schema, at)
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        code = "unsupported_parameter"  # a valid schema the engine cannot compile
    elif kind == "regex":
        try:
            re.compile(value)
        except re.error as e:
            raise constraint_error(at, f"not a valid pattern: {e}") from None
        grammar, code = LLMatcher.grammar_from_regex(value), "unsupported_parameter"
    elif kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        grammar, code = LLMatcher.grammar_from_lark(lark), "invalid_parameter"
    else:
        grammar, code = _grammar_text(value, at), "invalid_parameter"
    error = LLMatcher.validate_grammar(grammar)
    if error:
        first = error.strip().splitlines()[0][:300]
        if code == "unsupported_parameter":
            first = f"the grammar engine cannot compile it: {first}"
        raise constraint_error(at, first, code)
    return grammar


def _check_schema(schema: Any, at: str) -> None:
    """A schema that is not valid JSON Schema (its own meta-schema) is the request's error."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(map(str, e.path)) or "the root"
        raise constraint_error(
            at, f"not a valid JSON schema at {where}: {e.message[:200]}"
        ) from None


def _grammar_text(text: str, at: str) -> str:
    """vLLM's `grammar`: GBNF/EBNF (rules written `::=`, as xgrammar takes them) converted to
    Lark, or Lark as llguidance takes it."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(text)
    except Exception as e:  # noqa: BLE001 - any conversion failure is the grammar's fault
        raise constraint_error(at, f"not a valid grammar: {e}") from None
    return LLMatcher.grammar_from_lark(lark)


def check_output(params: StructuredOutputsParams, text: str) -> str | None:
    """Why the finished `text` does not satisfy `params`, or None where it does (a grammar is
    judged by its matcher alone: engine/grammar.py)."""
    kind, value = params.kind, params.value
    if kind in ("json", "json_object"):
        try:
            doc = json.loads(text)
        except ValueError as e:
            return f"the output is not JSON: {e}"
        if kind == "json_object":
            return None if isinstance(doc, dict) else f"the output is a JSON {json_type(doc)}"
        import jsonschema

        cls = jsonschema.validators.validator_for(value, default=jsonschema.Draft202012Validator)
        error = jsonschema.exceptions.best_match(cls(value).iter_errors(doc))
        if error is None:
            return None
        where = "/".join(map(str, error.absolute_path)) or "the root"
        return f"the output does not match the schema at {where}: {error.message[:200]}"
    if kind == "choice":
        return None if text in value else f"the output {show(text)} is not one of the choices"
    if kind == "regex":
        return None if re.fullmatch(value, text) else "the output does not match the pattern"
    return None
