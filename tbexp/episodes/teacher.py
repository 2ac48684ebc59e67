"""policy=teacher: an OpenAI-compatible chat endpoint answers each turn of the episode's agent protocol.

The endpoint is called through litellm, as Harbor's `LiteLLM` calls it: `litellm.completion(model, messages,
api_base, api_key, ...)`, the model named the litellm way (`hosted_vllm/NAME` for vLLM or `python -m tbexp.serve`,
`openai/NAME` for any OpenAI-compatible API; a bare name gets `openai/`). The key is read from the environment
variable `collect.teacher_key_env` names, never from the config, so it lands in no log or `.hydra/config.yaml`.

The agent (raw_command, terminus_2, ...) builds the prompt and parses the reply exactly as for policy=model; the
teacher only answers the conversation so far. What a hosted API needs:
* retries with exponential backoff (`teacher_backoff_s` x 2^attempt, plus up to 25% jitter so that concurrent
  episodes do not retry in step; a `Retry-After` header is honoured when longer) on 429s, time-outs, connection
  errors, 5xx and malformed replies (no choices, no text), at most `teacher_retries` times per call;
* no retry of what another try cannot fix (401/403/404, a 400): the episode fails at once;
* a prompt over the teacher's context (litellm's ContextWindowExceededError) ends the episode as done, as
  policy=model does when it runs out of context.
An episode whose call still fails after the retries is invalid (its policy raised) and is marked so in
`TeacherClient.failed`: collect does not enter it in its ledger, so a resumed collection runs it again.

* at most `collect.teacher_max_rpm` requests a minute across all episodes (0 = no limit): requests are spaced
  60/rpm seconds apart (`RateLimit`), retries included, so a collection stays under a hosted API's quota
  instead of living on 429s.

Simplified: litellm's own retries are off (`num_retries=0`) so that every retry is counted here; the rate limit
spaces requests evenly (no bursts) and knows nothing of a quota's tokens per minute.
"""

from __future__ import annotations

import os
import random
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tbexp.agents.base import Agent
from tbexp.errors import TbexpError
from tbexp.tasks.harbor_task import Task

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm goes online for its cost map otherwise


class TeacherError(TbexpError, RuntimeError):
    """A teacher call that failed for good: retries used up, or an error no retry can fix."""


class MalformedReply(Exception):
    """A reply with a status of 200 that carries no usable text."""


@dataclass(frozen=True)
class TeacherSettings:
    base_url: str  # the endpoint, e.g. http://127.0.0.1:8000/v1
    model: str  # litellm's name: provider/model
    api_key: str
    temperature: float
    top_p: float
    max_tokens: int
    timeout_s: float
    retries: int
    backoff_s: float
    seed: int | None = None  # each reply's seed is a function of (seed, task, run, turn)
    max_rpm: float = 0.0  # requests a minute, all episodes together; 0 = no limit

    @property
    def name(self) -> str:
        """The teacher as rows record it."""
        return f"{self.model}@{self.base_url}"


def teacher_settings(collect: Any, sampling: Any, seed: int | None) -> TeacherSettings:
    """The settings from the `collect` and `sampling` nodes; the key from the environment."""
    if not collect.teacher_url or not collect.teacher_model:
        raise TeacherError("policy=teacher needs collect.teacher_url=<base URL …/v1> and collect.teacher_model=<name>")
    key = os.environ.get(collect.teacher_key_env, "") if collect.teacher_key_env else ""
    model = collect.teacher_model if "/" in collect.teacher_model else f"openai/{collect.teacher_model}"
    return TeacherSettings(
        base_url=collect.teacher_url,
        model=model,
        api_key=key or "none",  # litellm's OpenAI client refuses an empty key; a local server ignores it
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=collect.teacher_max_tokens,
        timeout_s=collect.teacher_timeout_s,
        retries=collect.teacher_retries,
        backoff_s=collect.teacher_backoff_s,
        seed=seed,
        max_rpm=collect.teacher_max_rpm,
    )


class RateLimit:
    """Requests spaced `60 / max_rpm` seconds apart, whichever thread asks: each takes the next free slot."""

    def __init__(
        self, max_rpm: float, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
    ):
        self.interval_s = 60.0 / max_rpm if max_rpm > 0 else 0.0
        self.clock, self.sleep = clock, sleep
        self.next_s = 0.0
        self.lock = threading.Lock()

    def wait(self) -> float:
        """Waits for this request's slot; returns how long it waited."""
        if not self.interval_s:
            return 0.0
        with self.lock:
            now = self.clock()
            slot = max(now, self.next_s)
            self.next_s = slot + self.interval_s
        if slot > now:
            self.sleep(slot - now)
        return slot - now


@dataclass
class Usage:
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class TeacherClient:
    """What every teacher episode shares: the settings, the call with its retries, and what the calls cost."""

    settings: TeacherSettings
    sleep: Callable[[float], None] = time.sleep
    usage: dict[tuple[str, int], Usage] = field(default_factory=dict)  # (task, run) -> its calls and tokens
    failed: dict[tuple[str, int], str] = field(default_factory=dict)  # (task, run) -> why its call failed for good
    retried: Counter[str] = field(default_factory=Counter)  # why calls were retried: rate_limit, timeout, ...
    lock: threading.Lock = field(default_factory=threading.Lock)
    rate: RateLimit | None = None  # None = from settings.max_rpm

    def __post_init__(self) -> None:
        if self.rate is None:
            self.rate = RateLimit(self.settings.max_rpm, sleep=self.sleep)

    def reply(self, messages: list[dict[str, str]], seed: int | None = None, episode: tuple[str, int] = ("", 0)) -> str:
        """The teacher's answer to `messages`, retried as the module says; its tokens counted under `episode`."""
        import litellm

        litellm.suppress_debug_info = True  # else every retried error prints a banner
        s = self.settings
        retryable = (
            litellm.RateLimitError,
            litellm.Timeout,
            litellm.APIConnectionError,
            litellm.InternalServerError,
            litellm.ServiceUnavailableError,
            litellm.BadGatewayError,
            litellm.APIResponseValidationError,
            MalformedReply,
        )
        for attempt in range(s.retries + 1):
            assert self.rate is not None
            self.rate.wait()
            try:
                response = litellm.completion(
                    model=s.model,
                    messages=messages,
                    api_base=s.base_url,
                    api_key=s.api_key,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    max_tokens=s.max_tokens,
                    timeout=s.timeout_s,
                    num_retries=0,
                    **({"seed": seed} if seed is not None else {}),
                )
                text = _text(response)
                self._count(episode, response)
                return text
            except litellm.ContextWindowExceededError:
                raise
            except retryable as err:
                reason = _reason(err)
                with self.lock:
                    self.retried[reason] += 1
                if attempt == s.retries:
                    self._fail(episode, f"{reason} after {s.retries} retries: {_first_line(err)}")
                self.sleep(self._wait(attempt, err))
            except Exception as err:  # 401, 403, 404, 400: another try gets the same answer
                self._fail(episode, f"{type(err).__name__}: {_first_line(err)}")
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def _wait(self, attempt: int, err: Exception) -> float:
        backoff = self.settings.backoff_s * 2**attempt * (1 + 0.25 * random.random())
        return max(backoff, _retry_after(err))

    def _count(self, episode: tuple[str, int], response: Any) -> None:
        usage = getattr(response, "usage", None)
        with self.lock:
            mine = self.usage.setdefault(episode, Usage())
            mine.calls += 1
            mine.prompt_tokens += int(getattr(usage, "prompt_tokens", 0) or 0)
            mine.completion_tokens += int(getattr(usage, "completion_tokens", 0) or 0)

    def _fail(self, episode: tuple[str, int], why: str) -> None:
        with self.lock:
            self.failed[episode] = why
        raise TeacherError(f"teacher {self.settings.name}: {why}")


class TeacherPolicy:
    """One episode's policy: each turn, the teacher's reply to the conversation so far."""

    def __init__(self, task: Task, agent: Agent, client: TeacherClient, run: int = 0):
        self.uploads: dict[Path, str] = {}
        self.client = client
        self.episode = (task.name, run)
        self.done_reply = agent.format([], done=True)
        self.out_of_context = False
        seed = client.settings.seed
        self._seed = None if seed is None else zlib.crc32(f"{seed}/{task.name}/{run}".encode())
        self._turn = 0

    def act(self, messages: list[dict[str, str]]) -> str:
        import litellm

        seed = None if self._seed is None else (self._seed + self._turn) % 2**31
        self._turn += 1
        try:
            return self.client.reply(messages, seed, self.episode)
        except litellm.ContextWindowExceededError:
            self.out_of_context = True
            return self.done_reply


def _text(response: Any) -> str:
    choices = getattr(response, "choices", None)
    if not choices:
        raise MalformedReply("the reply has no choices")
    content = getattr(getattr(choices[0], "message", None), "content", None)
    if not isinstance(content, str) or not content.strip():
        raise MalformedReply("the reply's message has no text")
    return content


def _reason(err: Exception) -> str:
    import litellm

    if isinstance(err, litellm.RateLimitError):
        return "rate_limit"
    if isinstance(err, litellm.Timeout):
        return "timeout"
    if isinstance(err, (MalformedReply, litellm.APIResponseValidationError)):
        return "malformed"
    text = str(err)
    if "[200 OK]" in text or "no 'choices'" in text:
        return "malformed"  # litellm reports a 200 it cannot read (not JSON, no choices) as a server error
    if isinstance(err, litellm.APIConnectionError):
        return "connection"
    return "server_error"


def _retry_after(err: Exception) -> float:
    """The server's `Retry-After` in seconds, 0 when it sent none."""
    response = getattr(err, "response", None)
    headers = getattr(response, "headers", None) or {}
    try:
        return float(headers.get("retry-after", 0) or 0)
    except (TypeError, ValueError):  # an HTTP date: the backoff stands
        return 0.0


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
