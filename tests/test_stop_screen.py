"""stop_screen.py: checking only the rows whose newest token can end a stop string stops every row where decoding
every row's tail every step (the samplers' check) stops it, for the tokenizer families it screens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tbexp.backends.sampling import Stops
from tbexp.backends.stop_screen import EVERY_TOKEN, StopScreen
from tests.test_local_backend import char_tokenizer

MODELS = Path(__file__).resolve().parent.parent / "tbexp" / "models"
TEXT = [
    "naïve café → ✓ 日本語の文 🎉 done",
    "</cmd> ```bash\nls -la /app\n``` exit 0",
    '{"keystrokes": "cat file.txt\\n", "done": true}',
    "Ünïcödé ßtraße — “quotes” and ‘apostrophes’ … ellipsis",
    "a.b,c;d:e!f?g (h) [i] {j} <k> |l| ~m~ `n`",
]
STOPS = [("</cmd>",), ("```",), ("é",), ("🎉",), ("日本",), ("a.", "!f"), ("}",), ("true}", "exit 0"), ("–",)]


def metaspace_byte_fallback() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: ▁ for spaces, byte-fallback tokens, and a decoder that strips the first space."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    tok.train_from_iterator(TEXT * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """A GPT-2/Qwen-style byte-level BPE trained here (multi-byte characters span several tokens)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


TOKENIZERS = {
    "tiny (byte-level BPE)": lambda: AutoTokenizer.from_pretrained(MODELS / "tiny"),
    "tiny_terminus": lambda: AutoTokenizer.from_pretrained(MODELS / "tiny_terminus"),
    "byte-level BPE with multi-byte characters": byte_level_bpe,
    "metaspace + byte fallback": metaspace_byte_fallback,
    "one character a token": char_tokenizer,
}


@pytest.mark.parametrize("make", TOKENIZERS.values(), ids=TOKENIZERS.keys())
def test_screened_rows_stop_exactly_where_every_row_checked_stops(make):
    tokenizer = make()
    screen = StopScreen(tokenizer, len(tokenizer) + 3)  # the model has 3 ids the tokenizer does not know
    rng = random.Random(0)
    stopped = checked = steps = 0
    for row in range(300):
        strings = rng.choice(STOPS)
        stops = Stops(frozenset(), strings)
        text = " ".join(rng.choice(TEXT) for _ in range(3))
        tokens = tokenizer.encode(text, add_special_tokens=False)[:80]
        for i in rng.sample(range(len(tokens)), len(tokens) // 5):  # some tokens no text would encode to
            tokens[i] = rng.randrange(len(tokenizer) + 3)
        ends = screen.ends(strings)
        assert ends is not EVERY_TOKEN
        want = got = None
        for t in range(1, len(tokens) + 1):
            tail = tokens[:t][-stops.tail_tokens :]
            full = any(s in tokenizer.decode(tail) for s in strings)  # the samplers' check, every step
            if want is None and full:
                want = t
            if got is None and tokens[t - 1] in ends:
                checked += 1
                if screen.stopped([tail], [strings])[0]:
                    got = t
        steps += len(tokens)
        assert got == want, (row, strings, tokenizer.decode(tokens[: want or got]))
        stopped += want is not None
    print(f"{stopped} of 300 rows stopped; {checked} of {steps} steps decoded")
    assert stopped > 30  # many rows reached a stop string, so the comparison means something
    assert checked < 0.6 * steps  # and most steps decoded nothing


def test_stop_strings_the_screen_cannot_vouch_for_check_every_row():
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "tiny")
    screen = StopScreen(tokenizer, len(tokenizer))
    assert screen.ends(()) == frozenset()  # no stop strings: never decoded
    assert screen.ends(("ok\n",)) is EVERY_TOKEN  # a decoder may add or strip whitespace around a token
    assert screen.ends(("bad\ufffd",)) is EVERY_TOKEN
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2, "c": 3}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    assert StopScreen(PreTrainedTokenizerFast(tokenizer_object=wordpiece), 4).ends(("ab",)) is EVERY_TOKEN
    cleaned = AutoTokenizer.from_pretrained(MODELS / "tiny", clean_up_tokenization_spaces=True)
    assert StopScreen(cleaned, len(cleaned)).ends(("</cmd>",)) is EVERY_TOKEN  # transformers rewrites its text
