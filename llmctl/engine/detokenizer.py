"""Output text built token by token, so stop strings are checked in time independent of length.

Owns: `IncrementalText`. Decoding the whole output at every step costs O(length) per token,
O(length^2) per request. Instead (as vLLM's incremental detokenizer does) each step decodes only a
short window: the tokens since the last emitted text (`prefix`), once without and once with the
tokens not yet emitted. Both decodes start at the same token, so a tokenizer's rule for a leading
space applies to both alike and their difference is the new text. A window ending in U+FFFD (a
UTF-8 character split over byte tokens) is held back until the character completes.
"""

from __future__ import annotations

from typing import Callable

Detokenize = Callable[[list[int]], str]


class IncrementalText:
    __slots__ = ("text", "_prefix", "_read")

    def __init__(self) -> None:
        self.text = ""  # the output text emitted so far
        self._prefix = 0  # output-token index where the decode window starts
        self._read = 0  # output tokens whose text is in `text`

    def update(self, detokenize: Detokenize, output_ids: list[int]) -> int:
        """Catch the text up with `output_ids` (all output tokens so far); returns where the new
        text starts in `self.text`."""
        start = len(self.text)
        before = (
            detokenize(output_ids[self._prefix : self._read]) if self._read > self._prefix else ""
        )
        window = detokenize(output_ids[self._prefix :])
        if len(window) > len(before) and not window.endswith("\ufffd"):
            self.text += window[len(before) :]
            self._prefix, self._read = self._read, len(output_ids)
        return start


def first_stop(text: str, stops: list[str], since: int = 0) -> int | None:
    """Where the earliest of `stops` starts in `text`, looking only at matches that end after
    `since` (earlier ones were looked for at an earlier step); None when there is none."""
    hits = []
    for s in stops:
        i = text.find(s, max(0, since - len(s) + 1))
        if i >= 0:
            hits.append(i)
    return min(hits) if hits else None
