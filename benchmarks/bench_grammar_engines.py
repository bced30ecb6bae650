"""xgrammar against llguidance, the two maintained grammar engines, for structured outputs on the
CPU (issue 37): compile time per JSON schema, the cost of the next-token mask per decoded token,
and which JSON Schema features each compiles.

The mask cost is measured along the tokens of a valid answer: for each token, compute the mask
of allowed next tokens and advance the matcher by the token (what the engine does per row and
step). Compile time is the first compile of each schema by a fresh compiler (no cache).

    python benchmarks/bench_grammar_engines.py --tokenizer $TMPDIR/smollm2-135m-instruct \
        --out benchmarks/results/grammar_engines.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "email": {"type": "string"},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "invoice": {
        "type": "object",
        "properties": {
            "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
            "total": {"type": "number"},
            "currency": {"enum": ["EUR", "USD", "GBP"]},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                    "required": ["sku", "qty"],
                },
                "minItems": 1,
            },
        },
        "required": ["invoice_id", "total", "currency", "items"],
    },
    "sentiment": {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "reasons": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["label", "confidence"],
    },
    "nested": {
        "$defs": {
            "address": {
                "type": "object",
                "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                "required": ["city"],
            }
        },
        "type": "object",
        "properties": {
            "home": {"$ref": "#/$defs/address"},
            "work": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
        },
        "required": ["home"],
    },
}
ANSWERS = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
    "invoice": {
        "invoice_id": "INV-0042",
        "total": 1234.5,
        "currency": "EUR",
        "items": [{"sku": "A-1", "qty": 3}, {"sku": "B-22", "qty": 1}],
    },
    "sentiment": {"label": "positive", "confidence": 0.93, "reasons": ["fast", "cheap"]},
    "nested": {"home": {"street": "1 Main St", "city": "Paris"}, "work": None, "tags": ["a"]},
}
# One schema per JSON Schema feature: does the engine compile it?
FEATURES = {
    "enum": {"enum": ["a", "b", 3]},
    "const": {"const": "x"},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}}]},
    "$ref/$defs": SCHEMAS["nested"],
    "recursive $ref": {
        "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
        "$ref": "#/$defs/n",
    },
    "pattern": {"type": "string", "pattern": "^[a-z]+[0-9]{2}$"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minimum/maximum": {"type": "integer", "minimum": 3, "maximum": 99},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "format uuid": {"type": "string", "format": "uuid"},
    "additionalProperties false": SCHEMAS["person"],
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
    "minItems/maxItems": {
        "type": "array",
        "items": {"type": "integer"},
        "minItems": 1,
        "maxItems": 3,
    },
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "minProperties": {"type": "object", "minProperties": 1},
    "type list": {"type": ["string", "null"]},
    "if/then/else": {
        "if": {"type": "string"},
        "then": {"minLength": 1},
        "else": {"type": "integer"},
    },
    "not": {"not": {"type": "string"}},
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, threads: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id]
        )
        self.threads, self.vocab = threads, vocab

    def compile(self, schema):
        compiler = self.xgr.GrammarCompiler(
            self.info, max_threads=self.threads, cache_enabled=False
        )
        return compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def walk(self, compiled, tokens: list[int]) -> list[tuple[float, float, float]]:
        """Seconds per token of (computing the mask, the library applying it to float32 logits,
        advancing the matcher). llmctl applies masks with its own C kernel: the first and the
        last are what it pays to the library."""
        xgr = self.xgr
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, self.vocab)
        logits = torch.zeros(1, self.vocab)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            t1 = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, mask)
            t2 = time.perf_counter()
            ok = matcher.accept_token(t)
            times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
            assert ok, "the answer's token was rejected"
        return times


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, vocab)
        self.vocab = vocab

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
        matcher = self.llg.LLMatcher(self.tok, grammar)  # builds the parser: its compile step
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def walk(self, grammar, tokens: list[int]) -> list[tuple[float, float, float]]:
        matcher = self.llg.LLMatcher(self.tok, grammar)
        mask = self.lt.allocate_token_bitmask(1, self.vocab)
        logits = torch.zeros(1, self.vocab)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            self.lt.fill_next_token_bitmask(matcher, mask, 0)
            t1 = time.perf_counter()
            self.lt.apply_token_bitmask_inplace(logits, mask)
            t2 = time.perf_counter()
            ok = matcher.consume_token(t)
            times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
            assert ok, matcher.get_error()
        return times


def measure(engine, tokenizer, repeats: int) -> dict:
    out: dict = {"compile_ms": {}, "us_per_token": {}, "features": {}}
    for name, schema in SCHEMAS.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled = engine.compile(schema)
            times.append(time.perf_counter() - t0)
        out["compile_ms"][name] = round(1e3 * statistics.median(times), 2)
        text = json.dumps(ANSWERS[name], separators=(",", ":"))
        tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        per_token = [t for _ in range(repeats) for t in engine.walk(compiled, tokens)]
        out["us_per_token"][name] = {
            part: round(1e6 * statistics.median(t[i] for t in per_token), 1)
            for i, part in enumerate(("mask", "apply", "advance"))
        }
    for name, schema in FEATURES.items():
        try:
            engine.compile(schema)
            out["features"][name] = "compiles"
        except Exception as e:  # noqa: BLE001 - any failure means "not covered"
            out["features"][name] = f"refused: {type(e).__name__}: {str(e)[:80]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="a folder holding a tokenizer.json")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tokenizer)
    results = {"tokenizer": args.tokenizer, "vocab": vocab, "threads": args.threads}
    for cls in (XGrammar, LLGuidance):
        engine = cls(tokenizer, vocab, args.threads)
        results[cls.name] = measure(engine, tokenizer, args.repeats)
        print(cls.name, json.dumps(results[cls.name], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
