"""Renderers: chat messages to tokens and back, token-exact across the turns of an episode.

An episode is built incrementally: `initial_tokens(first user message)` is
the prompt; the sampler's reply tokens are appended *as sampled*; then
`continuation_tokens(observation, reply)` closes the assistant turn (only if
the sample did not already end with an end-of-turn token), adds the next user
turn and opens the next assistant turn. The tokens trained on are therefore
the tokens that were sampled, never a re-tokenised copy of the decoded text
(which can differ: a sampler may emit `c` + `at` where encoding "cat" gives
one token). `supervised(messages)` renders a whole conversation for SFT the
same way, with each reply encoded on its own, so it equals the incremental
rendering token for token; weights are 1 on reply tokens and their
end-of-turn token, 0 elsewhere (completion-only loss).

Text between special tokens is encoded with special-token strings treated as
plain text, so an observation that happens to contain `<|im_end|>` cannot
close a turn. Each stretch of text between two special tokens is encoded as
one string (e.g. "user\\n" + content for ChatML), which is how Hugging Face's
chat templates tokenise ordinary messages.

Simplifications against the models' own chat templates, all deliberate so
that every assistant turn keeps the tokens it was sampled with:
* qwen3: every assistant turn keeps the empty think block of non-thinking
  mode (Qwen's template drops it from turns before the last user message).
* llama3: no default system block (Llama 3.1's template adds one with a
  knowledge-cutoff date); message text is not trimmed.
* gpt_oss: no system or developer message; replies go straight to the
  `final` channel, end with `<|return|>` and keep it in later turns (harmony
  would rewrite it to `<|end|>` in the history).
"""

from __future__ import annotations

from typing import Any

from tbexp.errors import TbexpError


class RendererError(TbexpError, ValueError):
    """A renderer that cannot work with this tokenizer, or messages it cannot render."""


class Renderer:
    """Base class: a format is its special tokens plus five token pieces built from them."""

    name: str = ""
    required: tuple[str, ...] = ()  # special tokens the tokenizer must have, each as one token
    optional_stops: tuple[str, ...] = ()  # extra stop tokens, used when the tokenizer has them

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids = {token: self._special_id(token) for token in self.required}
        for token in self.optional_stops:
            if self._has_special(token):
                self.ids[token] = self._special_id(token)
        self._end = self.end_of_turn_tokens()
        self._stops = self.stop()

    # The format: subclasses fill these in.
    def _prefix(self) -> list[int]:
        """Tokens at the very start of a conversation."""
        return []

    def _user(self, text: str) -> list[int]:
        """A complete user turn."""
        raise NotImplementedError

    def _assistant_header(self) -> list[int]:
        raise NotImplementedError

    def _after_turn(self) -> list[int]:
        """Tokens between an assistant turn's end marker and the next user turn."""
        return []

    def end_of_turn_tokens(self) -> list[int]:
        raise NotImplementedError

    def stop(self) -> list[int]:
        """Stop tokens for sampling one assistant turn; the sampled tokens include the stop."""
        return list(self._end)

    # The interface.
    def initial_tokens(self, first_user_message: str) -> list[int]:
        return self._prefix() + self._user(first_user_message) + self._assistant_header()

    def continuation_tokens(self, observation: str, sampled_reply_tokens: list[int]) -> list[int]:
        close = [] if self._ends_turn(sampled_reply_tokens) else list(self._end)
        return close + self._after_turn() + self._user(observation) + self._assistant_header()

    def decode_reply(self, sampled_reply_tokens: list[int]) -> str:
        """The reply's text: everything before the first stop token, special tokens left out."""
        tokens = list(sampled_reply_tokens)
        for i, token in enumerate(tokens):
            if token in self._stops:
                tokens = tokens[:i]
                break
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def supervised(self, messages: list[dict]) -> tuple[list[int], list[float]]:
        """Tokens and completion-only weights of a user/assistant conversation.

        Equal, token for token, to `initial_tokens(m0) + reply1 + continuation_tokens(m2, reply1) + ...`
        with each reply encoded on its own and closed by `end_of_turn_tokens()`.
        """
        _check_alternation(messages)
        tokens: list[int] = []
        weights: list[float] = []

        def add(piece: list[int], weight: float) -> None:
            tokens.extend(piece)
            weights.extend([weight] * len(piece))

        previous_reply: list[int] | None = None
        for message in messages:
            if message["role"] == "user":
                if previous_reply is None:
                    add(self.initial_tokens(message["content"]), 0.0)
                else:
                    add(self.continuation_tokens(message["content"], previous_reply), 0.0)
            else:
                previous_reply = self.encode_text(message["content"]) + self._end
                add(previous_reply, 1.0)
        return tokens, weights

    # Helpers.
    def encode_text(self, text: str) -> list[int]:
        """Plain text to tokens; special-token strings inside it stay plain text."""
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def _ends_turn(self, tokens: list[int]) -> bool:
        return bool(tokens) and tokens[-1] in self._stops

    def _has_special(self, token: str) -> bool:
        return token in self.tokenizer.get_vocab() and len(self.tokenizer.encode(token, add_special_tokens=False)) == 1

    def _special_id(self, token: str) -> int:
        if not self._has_special(token):
            raise RendererError(
                f"renderer {self.name!r} needs the special token {token!r}, which the tokenizer "
                f"{getattr(self.tokenizer, 'name_or_path', '') or type(self.tokenizer).__name__!r} does not have; "
                f"choose the renderer that matches the model (model.renderer: {', '.join(RENDERERS)})"
            )
        return int(self.tokenizer.convert_tokens_to_ids(token))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class PlainRenderer(Renderer):
    """The tiny model's format: `<|user|>text<|end|><|assistant|>reply<|end|><|user|>...`."""

    name = "plain"
    required = ("<|user|>", "<|assistant|>", "<|end|>")

    def _user(self, text: str) -> list[int]:
        return [self.ids["<|user|>"]] + self.encode_text(text) + [self.ids["<|end|>"]]

    def _assistant_header(self) -> list[int]:
        return [self.ids["<|assistant|>"]]

    def end_of_turn_tokens(self) -> list[int]:
        return [self.ids["<|end|>"]]


class Qwen3Renderer(Renderer):
    """ChatML in Qwen3's non-thinking mode: `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n` opens each reply."""

    name = "qwen3"
    required = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")
    optional_stops = ("<|endoftext|>",)

    def _user(self, text: str) -> list[int]:
        return (
            [self.ids["<|im_start|>"]]
            + self.encode_text("user\n" + text)
            + [self.ids["<|im_end|>"]]
            + self.encode_text("\n")
        )

    def _assistant_header(self) -> list[int]:
        return (
            [self.ids["<|im_start|>"]]
            + self.encode_text("assistant\n")
            + [self.ids["<think>"]]
            + self.encode_text("\n\n")
            + [self.ids["</think>"]]
            + self.encode_text("\n\n")
        )

    def _after_turn(self) -> list[int]:
        return self.encode_text("\n")

    def end_of_turn_tokens(self) -> list[int]:
        return [self.ids["<|im_end|>"]]

    def stop(self) -> list[int]:
        return [self.ids["<|im_end|>"]] + ([self.ids["<|endoftext|>"]] if "<|endoftext|>" in self.ids else [])


class Llama3Renderer(Renderer):
    """Llama 3 instruct: `<|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\ntext<|eot_id|>`."""

    name = "llama3"
    required = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

    def _prefix(self) -> list[int]:
        return [self.ids["<|begin_of_text|>"]]

    def _header(self, role: str) -> list[int]:
        return [self.ids["<|start_header_id|>"]] + self.encode_text(role) + [self.ids["<|end_header_id|>"]]

    def _user(self, text: str) -> list[int]:
        return self._header("user") + self.encode_text("\n\n" + text) + [self.ids["<|eot_id|>"]]

    def _assistant_header(self) -> list[int]:
        return self._header("assistant") + self.encode_text("\n\n")

    def end_of_turn_tokens(self) -> list[int]:
        return [self.ids["<|eot_id|>"]]


class GptOssRenderer(Renderer):
    """Harmony: `<|start|>user<|message|>text<|end|><|start|>assistant<|channel|>final<|message|>reply<|return|>`."""

    name = "gpt_oss"
    required = ("<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>")

    def _user(self, text: str) -> list[int]:
        return (
            [self.ids["<|start|>"]]
            + self.encode_text("user")
            + [self.ids["<|message|>"]]
            + self.encode_text(text)
            + [self.ids["<|end|>"]]
        )

    def _assistant_header(self) -> list[int]:
        return (
            [self.ids["<|start|>"]]
            + self.encode_text("assistant")
            + [self.ids["<|channel|>"]]
            + self.encode_text("final")
            + [self.ids["<|message|>"]]
        )

    def end_of_turn_tokens(self) -> list[int]:
        return [self.ids["<|return|>"]]

    def stop(self) -> list[int]:
        return [
            self.ids["<|return|>"],
            self.ids["<|end|>"],
        ]  # a final message ends with <|return|>; <|end|> closes any other


RENDERERS: dict[str, type[Renderer]] = {
    r.name: r for r in (PlainRenderer, Qwen3Renderer, Llama3Renderer, GptOssRenderer)
}


def make_renderer(name: str, tokenizer: Any) -> Renderer:
    """The renderer called `name` over `tokenizer`; fails at once if the tokenizer lacks its special tokens."""
    if name not in RENDERERS:
        raise RendererError(f"unknown renderer {name!r}; choose one of {', '.join(RENDERERS)}")
    return RENDERERS[name](tokenizer)


def _check_alternation(messages: list[dict]) -> None:
    for i, message in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if message.get("role") != expected:
            raise RendererError(
                f"message {i} has role {message.get('role')!r}; conversations alternate user/assistant, starting with user"
            )
