"""One chat-completions request answered with tbexp's renderer and sampler, in OpenAI's JSON shapes.

What is implemented: `messages` (user and assistant turns, alternating, starting and ending with a user turn;
content as a string or as a list of text parts), `temperature`, `top_p`, `max_tokens` (or
`max_completion_tokens`), `stop` (a string or a list of strings), `seed`, `n` and `logprobs`. The prompt is
rendered by the model's renderer exactly as an episode renders it (`Renderer.initial_tokens`, then for each
earlier reply its tokens and `continuation_tokens`), and sampled by the backend's `Sampler`, so the tokens and
logprobs served are the ones tbexp's own policy would get.

The response carries what vLLM returns with `return_token_ids`, which litellm keeps and Harbor's `LiteLLM`
reads into rollout details: the top-level `prompt_token_ids`, each choice's `token_ids` (every sampled token,
the closing stop token included, as tbexp trains on them) and `logprobs.content[].logprob` (one entry per
token id, logp under the untempered model, as Tinker and vLLM's raw logprobs report it). Token ids are
returned whether or not `return_token_ids` was asked for; logprobs only when `logprobs` is true.

Earlier replies in `messages`: when an assistant turn's text is one this endpoint produced (kept in a bounded
table of recent replies), its sampled tokens are used, so a multi-turn prompt is token for token the one an
episode builds; other assistant text is encoded as `Renderer.supervised` encodes it (the same tokens, unless
the sampler had chosen a different split of the same text).

Simplified: no streaming, tools, response formats or `top_logprobs` (refused with a 400 that says so); system
messages are refused too, since tbexp's renderers have no system role. Unknown request keys are ignored, as
OpenAI-compatible servers do for the extras clients send.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tbexp.errors import TbexpError

REPLIES_KEPT = 4096  # recent replies whose sampled tokens are reused when a client sends them back
UNSUPPORTED = ("stream", "tools", "tool_choice", "functions", "response_format")


class RequestError(TbexpError):
    """A request this endpoint refuses; becomes an OpenAI-style error body with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass
class ChatEndpoint:
    sampler: Any  # tbexp.backends.base.Sampler
    renderer: Any  # tbexp.models.renderers.Renderer
    model_name: str  # the name clients send as `model` and /v1/models lists
    context_tokens: int  # prompt + completion may not exceed this (model.max_length_tokens)
    _replies: OrderedDict = field(default_factory=OrderedDict)
    _replies_lock: threading.Lock = field(default_factory=threading.Lock)

    def models(self) -> dict[str, Any]:
        entry = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tbexp"}
        return {"object": "list", "data": [{**entry, "max_model_len": self.context_tokens}]}

    def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """The chat.completion object answering `request` (a decoded JSON body); RequestError if refused."""
        from tinker import types

        _refuse_unsupported(request)
        if request.get("model") not in (None, self.model_name):
            raise RequestError(
                f"model {request.get('model')!r} is not served here; this server serves {self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        prompt = self.prompt_tokens(_messages(request))
        params, stop_strings = self._sampling_params(request, len(prompt))
        n = _integer(request, "n", 1, minimum=1)
        sequences = self.sampler.sample(types.ModelInput.from_ints(prompt), n, params).result()
        choices = [self._choice(i, s, stop_strings, bool(request.get("logprobs"))) for i, s in enumerate(sequences)]
        completion_tokens = sum(len(s.tokens) for s in sequences)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt) + completion_tokens,
            },
            "prompt_token_ids": prompt,
        }

    def prompt_tokens(self, messages: list[str]) -> list[int]:
        """Alternating user/assistant texts (user first and last) as the tokens an episode would hold."""
        r = self.renderer
        tokens = r.initial_tokens(messages[0])
        for reply_text, user_text in zip(messages[1::2], messages[2::2]):
            reply = self._reply_tokens(reply_text)
            tokens = tokens + reply + r.continuation_tokens(user_text, reply)
        return tokens

    def _reply_tokens(self, text: str) -> list[int]:
        with self._replies_lock:
            sampled = self._replies.get(text)
        return (
            list(sampled)
            if sampled is not None
            else self.renderer.encode_text(text) + self.renderer.end_of_turn_tokens()
        )

    def _remember(self, text: str, tokens: list[int]) -> None:
        with self._replies_lock:
            self._replies[text] = tuple(tokens)
            self._replies.move_to_end(text)
            while len(self._replies) > REPLIES_KEPT:
                self._replies.popitem(last=False)

    def _sampling_params(self, request: dict[str, Any], prompt_len: int):
        from tinker import types

        room = self.context_tokens - prompt_len
        max_tokens = request.get("max_completion_tokens", request.get("max_tokens"))
        if max_tokens is None:
            max_tokens = room  # as vLLM: the rest of the context
        elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError(f"max_tokens={max_tokens!r}: must be a positive integer", param="max_tokens")
        if room < 1 or max_tokens > room:
            # vLLM's wording: litellm and Harbor recognise "maximum context length" as a context overflow.
            raise RequestError(
                f"This model's maximum context length is {self.context_tokens} tokens. However, you requested "
                f"{prompt_len + max(max_tokens, 1)} tokens ({prompt_len} in the messages, {max(max_tokens, 1)} in "
                f"the completion). Please reduce the length of the messages or completion.",
                param="messages",
                code="context_length_exceeded",
            )
        stop_strings = _stop_strings(request)
        stop: list[int] | list[str] = self.renderer.stop()
        if stop_strings:  # Tinker's stops are all ids or all strings: the end-of-turn tokens as their text
            stop = [self.renderer.tokenizer.decode([t]) for t in self.renderer.stop()] + stop_strings
        temperature = _number(request, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(request, "top_p", 1.0, 0.0, 1.0)
        if top_p <= 0.0:
            raise RequestError("top_p must be greater than 0", param="top_p")
        seed = request.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise RequestError(f"seed={seed!r}: must be an integer", param="seed")
        params = types.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed)
        return params, stop_strings

    def _choice(self, index: int, sequence: Any, stop_strings: list[str], with_logprobs: bool) -> dict[str, Any]:
        text = self.renderer.decode_reply(sequence.tokens)
        cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]  # OpenAI's stop strings are not part of the content
        else:
            self._remember(text, sequence.tokens)
        choice: dict[str, Any] = {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": "stop" if sequence.stop_reason == "stop" else "length",
            "token_ids": list(sequence.tokens),
        }
        if with_logprobs:
            choice["logprobs"] = {
                "content": [self._token_logprob(t, lp) for t, lp in zip(sequence.tokens, sequence.logprobs)]
            }
        return choice

    def _token_logprob(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.renderer.tokenizer.decode([token])
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode()), "top_logprobs": []}


def _refuse_unsupported(request: dict[str, Any]) -> None:
    for key in UNSUPPORTED:
        if request.get(key):
            raise RequestError(f"{key!r} is not supported by tbexp.serve", param=key)
    if request.get("top_logprobs"):
        raise RequestError(
            "top_logprobs is not supported: the sampler reports only the sampled token's logprob", param="top_logprobs"
        )


def _messages(request: dict[str, Any]) -> list[str]:
    """The texts of `messages`, checked to alternate user/assistant from a user turn to a user turn."""
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    texts = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        expected = "user" if i % 2 == 0 else "assistant"
        if role != expected:
            raise RequestError(
                f"messages[{i}] has role {role!r}, expected {expected!r}: tbexp's renderers take user and assistant "
                f"turns alternating, starting with user (no system role)",
                param="messages",
            )
        texts.append(_text(message.get("content"), i))
    if len(texts) % 2 == 0:
        raise RequestError("the last message must be a user turn (the reply to generate follows it)", param="messages")
    return texts


def _text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(f"messages[{index}].content must be a string or a list of text parts", param="messages")


def _stop_strings(request: dict[str, Any]) -> list[str]:
    stop = request.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a non-empty string or a list of them", param="stop")
    return stop


def _number(request: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = request.get(key)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(f"{key}={value!r}: must be a number in [{low}, {high}]", param=key)
    return float(value)


def _integer(request: dict[str, Any], key: str, default: int, minimum: int) -> int:
    value = request.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise RequestError(f"{key}={value!r}: must be an integer >= {minimum}", param=key)
    return value
