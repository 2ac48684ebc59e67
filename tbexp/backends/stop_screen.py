"""Stop strings checked for hundreds of rows a step without decoding most of them.

The samplers end a reply once a stop string appears in the decoded text of
its last `Stops.tail_tokens` tokens (sampling.py), checked after every token.
Decoding every row's tail every step costs the host ~27 µs a row through
transformers' `batch_decode` (7 ms at 256 rows), more than a decode step of
the GPU. A string that was absent before this token and is present now must
end inside the text this token added, so it holds the stop string's last
character, unless this token only completes a character whose bytes came
before it (it decodes alone to U+FFFD) or adds nothing alone. `StopScreen`
decodes every token id once per tokenizer and keeps, per set of last
characters, which ids can end a stop string (`ends`); only rows whose newest
token is one of them are decoded, and their check is the samplers' own, so
the rows stop where they stopped before.

Where that argument needs more than the decoder gives, every row is decoded
as before (`ends` returns EVERY_TOKEN): a stop string ending in whitespace (a
decoder may add whitespace between tokens, or strip it from the first),
one containing U+FFFD, a decoder other than ByteLevel, Metaspace,
ByteFallback, Fuse, Replace and Strip of whitespace (Llama, Qwen, Mistral and
GPT-2 style tokenizers), or transformers' clean-up of spaces. Decoding goes
straight to the `tokenizers` library when transformers would add nothing to it
(a fast tokenizer without clean-up): 3× faster at 256 rows, and a few rows are
decoded one by one, 4× faster than waking its thread pool.
"""

from __future__ import annotations

import json
from collections.abc import Callable

SCREENED_DECODERS = {"ByteLevel", "Metaspace", "ByteFallback", "Fuse", "Replace", "Strip", "Sequence"}
REPLACEMENT = "\ufffd"
PARALLEL_ROWS = 64  # fewer rows are decoded one by one: the tokenizers library's thread pool costs more to wake


class _EveryToken:
    """`ends` where any token may end a stop string: every row is checked every step."""

    def __contains__(self, token: int) -> bool:
        return True


EVERY_TOKEN = _EveryToken()


class StopScreen:
    """Which token ids can end a request's stop strings, and the batched check of the rows they flag."""

    def __init__(self, tokenizer, vocab_size: int):
        self.decode = _batch_decoder(tokenizer)
        self._screens = _decoder_screens(tokenizer)
        self._pieces: list[str] | None = None  # each token id decoded alone, built on first use
        self._ends: dict[frozenset[str], frozenset[int] | _EveryToken] = {}
        self._known, self._vocab = len(tokenizer), vocab_size  # the model's ids past the tokenizer's are flagged

    def ends(self, strings: tuple[str, ...]) -> frozenset[int] | _EveryToken:
        """The token ids after which one of `strings` may first appear: no stop strings, none; EVERY_TOKEN where
        the screen does not apply. Ids of the model the tokenizer does not know count as able to."""
        if not strings:
            return frozenset()
        last = frozenset(s[-1] for s in strings)
        if not self._screens or any(c.isspace() for c in last) or any(REPLACEMENT in s for s in strings):
            return EVERY_TOKEN
        if last not in self._ends:
            if self._pieces is None:
                self._pieces = self.decode([[i] for i in range(self._known)])
            flagged = (i for i, p in enumerate(self._pieces) if not p or REPLACEMENT in p or not last.isdisjoint(p))
            self._ends[last] = frozenset(flagged).union(range(self._known, self._vocab))
        return self._ends[last]

    def stopped(self, tails: list[list[int]], strings: list[tuple[str, ...]]) -> list[bool]:
        """Whether each tail's text holds one of its stop strings: the samplers' own check, on these rows."""
        texts = self.decode(tails) if len(tails) >= PARALLEL_ROWS else [self.decode([t])[0] for t in tails]
        return [any(s in text for s in stops) for text, stops in zip(texts, strings)]


def _batch_decoder(tokenizer) -> Callable[[list[list[int]]], list[str]]:
    """`tokenizer.batch_decode`, through the `tokenizers` library directly where transformers adds nothing to it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda seqs: (
            backend.decode_batch(seqs, skip_special_tokens=False)
            if len(seqs) >= PARALLEL_ROWS
            else [backend.decode(ids, skip_special_tokens=False) for ids in seqs]
        )
    return tokenizer.batch_decode


def _decoder_screens(tokenizer) -> bool:
    """Whether the tokenizer's decoder keeps a token's text its own (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    decoder = json.loads(backend.to_str()).get("decoder")
    return decoder is None or _screened(decoder)


def _screened(decoder: dict) -> bool:
    kind = decoder.get("type")
    if kind == "Sequence":
        return all(_screened(d) for d in decoder.get("decoders", []))
    if kind == "Strip":
        return str(decoder.get("content", " ")).isspace()
    return kind in SCREENED_DECODERS
