"""tbexp's sampler as a Harbor `BaseLLM`, and Harbor's terminus-2 driven by it.

`TbexpLLM.call(prompt, message_history)` renders Harbor's chat (history plus
the new user prompt) with the model's renderer (`tbexp.models.renderers`),
samples one reply from the backend's `Sampler` (local or Tinker, through the
`ModelRuntime` every model-policy episode shares, so concurrent trials are
batched as native episodes are), and returns the reply text with
`prompt_token_ids`, `completion_token_ids` and `logprobs`, which Harbor's
`Chat` collects into the trial's rollout details. The context limit is
`model.max_length_tokens` (the runtime's `max_context_tokens`), the output
limit `sampling.max_tokens`; a prompt that leaves no room for a reply raises
Harbor's `ContextLengthExceededError`.

Token-exact history: when the history ends with the reply this LLM sampled
last, the prompt is the previous prompt + the reply *as sampled* +
`continuation_tokens(new prompt)`, exactly as tbexp's own model policy builds
an episode, so the rollout details hold the tokens the model saw and sampled.
Any other history (the first call, or one Harbor rewrote, e.g. after context
summarization) is rendered from its text.

Seeds: with a runtime seed, reply k of run r of a task is drawn with
`crc32(f"{seed}/{task}/{r}") + k`, the seed `ModelPolicy` uses, so a reply
sees the same draw in both harnesses whenever the prompts agree.

Simplified: a reply cut at `sampling.max_tokens` is returned as it is, as the
native loop takes it, where Harbor's `TinkerLLM` raises
`OutputLengthExceededError` and terminus-2 then tells the model its reply was
cut; raising would leave that turn's tokens out of the rollout details.

`TbexpTerminus2` is Harbor's `Terminus2` with its LLM replaced by `TbexpLLM`;
everything else (templates, tmux session, parser, confirmation of
`task_complete`, summarization when enabled) is Harbor's own. Harbor builds
agents from serialisable kwargs, so the live runtime is handed over through
`serve(runtime)`, which returns the key the agent's `tbexp_policy` kwarg names.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # harbor imports litellm, which goes online otherwise

from harbor.agents.terminus_2.terminus_2 import Terminus2  # noqa: E402
from harbor.llms.base import BaseLLM, ContextLengthExceededError, LLMResponse  # noqa: E402
from harbor.models.metric.usage_info import UsageInfo  # noqa: E402

from tbexp.episodes.policies import ModelRuntime, sample_reply  # noqa: E402

_runtimes: dict[str, ModelRuntime] = {}
_conversations: dict[str, Conversation] = {}  # trial key -> what its LLM saw and sampled, for the episode record
_registry_lock = threading.Lock()


@dataclass
class Conversation:
    """One trial's calls: the messages as Harbor sent them and every reply's tokens."""

    messages: list[dict[str, str]] = field(default_factory=list)  # the last call's history, its prompt, its reply
    prompts: list[list[int]] = field(default_factory=list)  # per call, the whole prompt's tokens
    replies: list[list[int]] = field(default_factory=list)  # per call, the sampled tokens
    logprobs: list[list[float]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # per call, the reply's text
    sample_s: float = 0.0
    turns: list[Any] = field(default_factory=list)  # a command agent's turns as run (exit statuses); [] for terminus-2


def serve(runtime: ModelRuntime) -> str:
    """Make `runtime` reachable from agents Harbor builds: the key for the `tbexp_policy` agent kwarg."""
    key = f"runtime-{id(runtime)}"
    with _registry_lock:
        _runtimes[key] = runtime
    return key


def withdraw(key: str) -> None:
    with _registry_lock:
        _runtimes.pop(key, None)


def claim(policy_key: str, trial_key: str = "") -> tuple[ModelRuntime, Conversation]:
    """For an agent Harbor built: the runtime `serve` registered under `policy_key`, and a new record of what its
    LLM sees, which `conversation(trial_key)` hands to the harness after the trial."""
    with _registry_lock:
        if policy_key not in _runtimes:
            raise KeyError(f"tbexp_policy={policy_key!r}: no runtime served under that key (see serve())")
        record = Conversation()
        if trial_key:
            _conversations[trial_key] = record
        return _runtimes[policy_key], record


def conversation(trial_key: str) -> Conversation | None:
    """What the LLM of the trial started with `tbexp_trial=trial_key` saw and sampled (None: it never sampled)."""
    with _registry_lock:
        return _conversations.pop(trial_key, None)


class TbexpLLM(BaseLLM):
    def __init__(self, runtime: ModelRuntime, seed: int | None = None, record: Conversation | None = None, **kwargs):
        super().__init__(**kwargs)
        self.runtime = runtime
        self.seed = seed  # this episode's base seed (None: the sampler's own RNG)
        self.record = record if record is not None else Conversation()

    def get_model_context_limit(self) -> int:
        return self.runtime.max_context_tokens

    def get_model_output_limit(self) -> int | None:
        return self.runtime.params.max_tokens

    async def call(self, prompt: str, message_history: list[dict[str, Any]] = [], **kwargs: Any) -> LLMResponse:
        history = [{"role": m.get("role", "user"), "content": m.get("content", "")} for m in message_history]
        tokens = self._render(history, prompt)
        limit = self.runtime.max_context_tokens
        if len(tokens) + self.runtime.params.max_tokens > limit:
            raise ContextLengthExceededError(
                f"prompt of {len(tokens)} tokens + {self.runtime.params.max_tokens} reply tokens exceeds "
                f"model.max_length_tokens={limit}"
            )
        turn = len(self.record.replies)
        sequence, spent_s = await asyncio.to_thread(self._sample, tokens, turn)
        text = self.runtime.renderer.decode_reply(sequence.tokens)
        r = self.record
        r.messages = [*history, {"role": "user", "content": prompt}, {"role": "assistant", "content": text}]
        r.prompts.append(tokens)
        r.replies.append(list(sequence.tokens))
        r.logprobs.append(list(sequence.logprobs))
        r.texts.append(text)
        r.sample_s += spent_s
        usage = UsageInfo(
            prompt_tokens=len(tokens), completion_tokens=len(sequence.tokens), cache_tokens=0, cost_usd=0.0
        )
        return LLMResponse(
            content=text,
            usage=usage,
            prompt_token_ids=tokens,
            completion_token_ids=list(sequence.tokens),
            logprobs=list(sequence.logprobs),
        )

    def _render(self, history: list[dict[str, str]], prompt: str) -> list[int]:
        renderer, r = self.runtime.renderer, self.record
        if r.replies and history == r.messages:  # the conversation goes on from the reply sampled last
            return r.prompts[-1] + r.replies[-1] + renderer.continuation_tokens(prompt, r.replies[-1])
        if not history:
            return renderer.initial_tokens(prompt)
        tokens, _ = renderer.supervised(history)  # a history Harbor rewrote: rendered from its text
        last_reply = renderer.encode_text(history[-1]["content"]) + renderer.end_of_turn_tokens()
        return tokens + renderer.continuation_tokens(prompt, last_reply)

    def _sample(self, tokens: list[int], turn: int):
        r = self.runtime
        params = r.params if self.seed is None else r.params.model_copy(update={"seed": self.seed + turn})
        start = time.perf_counter()
        sequence = sample_reply(r, tokens, params)
        return sequence, time.perf_counter() - start


def episode_seed(runtime_seed: int | None, task_name: str, run: int) -> int | None:
    """The base seed of one episode's replies, as `tbexp.episodes.policies.ModelPolicy` derives it."""
    return None if runtime_seed is None else zlib.crc32(f"{runtime_seed}/{task_name}/{run}".encode())


class TbexpTerminus2(Terminus2):
    """Harbor's terminus-2, sampling from tbexp: kwargs `tbexp_policy` (from `serve`), `tbexp_trial`, `tbexp_seed`."""

    def __init__(self, *args: Any, tbexp_policy: str, tbexp_trial: str = "", tbexp_seed: int | None = None, **kwargs):
        runtime, record = claim(tbexp_policy, tbexp_trial)
        self._tbexp = (runtime, tbexp_seed, record)
        kwargs.setdefault("model_name", "tbexp")
        super().__init__(*args, **kwargs)

    @classmethod
    def check_model_credentials(cls, connection, *, kwargs, env, explicit_env=None) -> None:
        """No API key: the model is sampled in this process (or through backend=tinker's own client)."""

    @classmethod
    def resolve_model_connection_config(cls, model_name, resolve_env, **connection_kwargs):
        from harbor.agents.agent_auth_resolution import ResolvedModelConnection

        return ResolvedModelConnection()

    def _init_llm(self, *args: Any, **kwargs: Any) -> BaseLLM:
        runtime, seed, record = self._tbexp
        return TbexpLLM(runtime, seed, record)
