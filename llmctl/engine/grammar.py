"""The grammar engine (llguidance) bound to the model's tokenizer: a matcher per constrained
sequence, and what each engine step does with them.

Owns: `Grammars`: llguidance's view of the tokenizer (built once), the grammars compiled per
distinct constraint (an LRU cache: rows sharing a schema compile it once), `start` (a request's
matcher, or its error), `mask` (each constrained row's disallowed tokens set to -inf on the
step's logits, the rows' masks computed on the library's threads; a row with speculative
drafts gets one mask per draft position, computed by advancing its matcher over the drafts the
grammar allows and rolling it back, so a draft the grammar rejects has probability 0 and is
never accepted), `advance` (a sampled token consumed:
whether the grammar has ended) and `status` (at the end: valid, incomplete or invalid).
Built by the runtime from the tokenizer (runtime/loader.py) and given to the engine.

Preemption needs nothing here: a preempted sequence keeps its tokens, and its matcher the state
they put it in. Forked completions (n > 1) start their own matcher (`Sequence.matcher` None).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

import torch

from llmctl.engine.sequence import Sequence
from llmctl.engine.structured import (
    StructuredOutputsParams,
    check_output,
    constraint_error,
    grammar_of,
)
from llmctl.errors import RequestError
from llmctl.kernels.cpu import elementwise

CACHE_SIZE = 1024  # distinct constraints whose grammar is kept


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int], native=True):
        """`tokenizer`: the model's Hugging Face tokenizer; `vocab_size`: the logits' width (the
        model's, which may pad the tokenizer's); `native`: KernelConfig.native (the C mask)."""
        self._hf, self._eos = tokenizer, sorted(eos_token_ids)
        self._tokenizer = None  # llguidance's, built on first use (a second or so for 150k)
        self.vocab_size, self.native = vocab_size, native
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self.compiled = 0  # distinct constraints compiled so far
        self._pool = None  # llguidance.LLExecutor, made on first use

    @property
    def tokenizer(self):
        """llguidance's view of the tokenizer; RequestError where it cannot read this one."""
        if self._tokenizer is None:
            import llguidance.hf

            if not self._eos:
                raise RequestError(
                    "unsupported_parameter",
                    "structured outputs need an end-of-sequence token, and this model has none",
                )
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, self.vocab_size, eos_token=self._eos
                )
            except Exception as e:  # noqa: BLE001 - whatever the library cannot read
                raise RequestError(
                    "unsupported_parameter",
                    f"structured outputs cannot use this tokenizer ({type(e).__name__}: {e})",
                ) from None
        return self._tokenizer

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The constraint's grammar, compiled once per distinct constraint (RequestError where
        the constraint is wrong or cannot be compiled)."""
        key = params.key()
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        grammar = self._grammars[key] = grammar_of(params)
        self.compiled += 1
        if len(self._grammars) > CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar

    def start(self, seq: Sequence) -> None:
        """`seq.matcher` for its constraint, advanced over any output tokens it has; raises the
        request's error where the grammar cannot be built for this tokenizer."""
        from llguidance import LLMatcher

        params = seq.params.structured_outputs
        matcher = LLMatcher(self.tokenizer, self.grammar(params), log_level=0)
        if matcher.is_error():
            message = matcher.get_error().strip().splitlines()[0][:300]
            raise constraint_error(params.source, message, "unsupported_parameter")
        if seq.num_output_tokens:
            matcher.consume_tokens(seq.output_token_ids)
        seq.matcher = matcher

    def mask(self, logits: torch.Tensor, seqs: list[Sequence], copy: bool) -> torch.Tensor:
        """logits [R, V] (a row per sequence, 1 + drafts rows for one with speculative drafts)
        with every constrained row's disallowed tokens at -inf: in place, or in a copy with
        `copy` (the caller reports logprobs of the model's own distribution)."""
        bits = torch.full((logits.shape[0], (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        row, plain = 0, []  # plain: (matcher, row) of the rows without drafts
        for seq in seqs:
            if seq.params.structured_outputs is not None:
                if seq.matcher is None:
                    self.start(seq)
                if seq.spec_token_ids:
                    self._fill(seq, bits, row)
                else:
                    plain.append((seq.matcher, row))
            row += 1 + len(seq.spec_token_ids)
        if plain:  # the library's threads, without the GIL: 20-30 us a row (BENCHMARKS.md)
            from llguidance.torch import fill_next_token_bitmask_par

            fill_next_token_bitmask_par(self._executor(), plain, bits)
        out = logits.clone() if copy else logits
        if self.native and elementwise.use_mask_rows(out, bits):
            return elementwise.mask_rows(out, bits)
        return mask_rows_reference(out, bits)

    def _executor(self):
        """llguidance's thread pool for masks, as many threads as torch uses (made once)."""
        if self._pool is None:
            from llguidance import LLExecutor

            self._pool = LLExecutor(max(1, torch.get_num_threads()))
        return self._pool

    def _fill(self, seq: Sequence, bits: torch.Tensor, row: int) -> None:
        """The masks of seq's rows from `row`: now, and after each draft the grammar allows."""
        from llguidance.torch import fill_next_token_bitmask

        matcher = seq.matcher
        fill_next_token_bitmask(matcher, bits, row)
        consumed = 0
        for i, draft in enumerate(seq.spec_token_ids):
            if not allowed(bits[row + i], draft) or not matcher.consume_token(draft):
                break  # later rows keep every token: verification stops at this draft
            consumed += 1
            fill_next_token_bitmask(matcher, bits, row + i + 1)
        if consumed:
            matcher.rollback(consumed)

    def advance(self, seq: Sequence, token: int) -> bool:
        """Consume a token seq has just appended; True where the grammar has ended (complete and
        accepting nothing more, or the token refused): the sequence stops there. Its matcher
        exists: add_request or `mask` started it before the token was sampled."""
        return not seq.matcher.consume_token(token) or seq.matcher.is_stopped()

    def status(self, seq: Sequence, text: str) -> tuple[str, str | None]:
        """("valid" | "incomplete" | "invalid", why) for a finished constrained sequence; its
        matcher is dropped."""
        matcher, params = seq.matcher, seq.params.structured_outputs
        seq.matcher = None
        if matcher is None:  # finished before sampling anything (a zero-token output)
            return "incomplete", "no output was generated"
        if matcher.is_error():
            return "invalid", f"the output left the grammar: {matcher.get_error()[:200]}"
        if not matcher.is_accepting():
            return "incomplete", "the output ended before the constraint was complete"
        why = check_output(params, text)
        return ("valid", None) if why is None else ("invalid", why)


def allowed(bits_row: torch.Tensor, token: int) -> bool:
    """Whether `token`'s bit is set in one mask row [words] (int32)."""
    return token >> 5 < bits_row.shape[0] and (int(bits_row[token >> 5]) >> (token & 31)) & 1 == 1


def mask_rows_reference(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of elementwise.mask_rows: x [R, V] with tokens whose bit is clear set
    to -inf, in place (only the rows with a clear bit are unpacked)."""
    rows = (bits != -1).any(dim=1).nonzero()[:, 0]
    if len(rows):
        shifts = torch.arange(32, dtype=torch.int32)
        sub = (bits[rows].unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
        keep = sub.view(len(rows), -1)[:, : x.shape[1]].bool()
        x[rows] = x[rows].masked_fill(~keep.to(x.device), float("-inf"))
    return x
