"""policy=teacher's calls: retries and backoff on what a hosted API does, against a scripted endpoint.

The endpoint is tests/teacher_server.py, a STAND-IN for a hosted API (offline, nothing else sends 429s, hangs or
malformed replies on cue); the calls go through litellm as in a collection. The real endpoint,
`python -m tbexp.serve`, is driven in tests/test_collect_teacher.py.
"""

from __future__ import annotations

import pytest

from tbexp.episodes.teacher import TeacherClient, TeacherError, TeacherSettings
from tests.teacher_server import ScriptedTeacher

HELLO = [{"role": "user", "content": "list the files"}]


def _client(url: str, retries: int = 3, timeout_s: float = 2.0) -> TeacherClient:
    settings = TeacherSettings(url, "openai/scripted", "none", 0.0, 1.0, 32, timeout_s, retries, backoff_s=0.01)
    # (max_rpm 0: the rate limit waits for nothing, so `waits` holds the backoffs alone)
    waits: list[float] = []
    client = TeacherClient(settings, sleep=waits.append)
    client.waits = waits  # type: ignore[attr-defined]
    return client


@pytest.mark.parametrize(
    "faults, reason",
    [
        (["429", "429"], "rate_limit"),
        (["slow"], "timeout"),
        (["garbage", "empty"], "malformed"),
        (["500"], "server_error"),
    ],
)
def test_a_passing_fault_is_retried_until_the_reply_comes(faults, reason):
    with ScriptedTeacher(lambda messages, body: "ls -la", faults, slow_s=4.0) as teacher:
        client = _client(teacher.url, timeout_s=1.0)
        assert client.reply(HELLO, 7, ("t", 0)) == "ls -la"
    assert teacher.requests == len(faults) + 1
    assert client.retried == {reason: len(faults)}
    assert client.usage[("t", 0)].calls == 1 and client.usage[("t", 0)].completion_tokens == 2
    waits = client.waits  # type: ignore[attr-defined]
    assert len(waits) == len(faults) and all(b > a for a, b in zip(waits, waits[1:]))  # backing off


def test_retries_run_out_and_the_episode_is_marked_failed():
    with ScriptedTeacher(lambda messages, body: "ls", ["429"] * 10) as teacher:
        client = _client(teacher.url, retries=3)
        with pytest.raises(TeacherError, match="rate_limit after 3 retries"):
            client.reply(HELLO, None, ("t", 1))
    assert teacher.requests == 4
    assert ("t", 1) in client.failed


def test_what_no_retry_can_fix_fails_at_once():
    with ScriptedTeacher(lambda messages, body: "ls", ["401"]) as teacher:
        client = _client(teacher.url)
        with pytest.raises(TeacherError, match="AuthenticationError"):
            client.reply(HELLO, None, ("t", 0))
    assert teacher.requests == 1 and not client.retried


def test_the_key_comes_from_the_environment_variable_named(monkeypatch):
    from tbexp.episodes.teacher import teacher_settings
    from tests.conftest import compose_config

    monkeypatch.setenv("MY_TEACHER_KEY", "sk-secret")
    cfg = compose_config(
        "collect.teacher_url=http://127.0.0.1:9/v1",
        "collect.teacher_model=big",
        "collect.teacher_key_env=MY_TEACHER_KEY",
    )
    settings = teacher_settings(cfg.collect, cfg.sampling, 0)
    assert settings.api_key == "sk-secret" and settings.model == "openai/big"
    with pytest.raises(TeacherError, match="teacher_url"):
        teacher_settings(compose_config().collect, cfg.sampling, 0)


def test_a_teacher_collects_and_nothing_else():
    from tbexp.config import ConfigError, check
    from tests.conftest import compose_config

    check(compose_config("stage=collect", "policy=teacher"))
    with pytest.raises(ConfigError, match="policy=teacher collects data"):
        check(compose_config("stage=eval", "policy=teacher"))
    with pytest.raises(ConfigError, match="min_pass_fraction"):
        check(compose_config("stage=collect", "collect.min_pass_fraction=0"))


def test_the_rate_limit_spaces_requests_across_threads():
    import threading

    from tbexp.episodes.teacher import RateLimit

    now = [100.0]
    waits: list[float] = []
    rate = RateLimit(120.0, clock=lambda: now[0], sleep=waits.append)  # 2 a second: 0.5 s apart
    threads = [threading.Thread(target=rate.wait) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(waits) == [0.5, 1.0, 1.5]  # the first goes at once, the others take the next slots
    now[0] = 200.0  # long after: a free slot again
    assert rate.wait() == 0.0
    assert RateLimit(0.0).wait() == 0.0


def test_a_rate_limited_client_waits_before_each_request():
    import time

    settings = TeacherSettings("http://x/v1", "openai/scripted", "none", 0.0, 1.0, 32, 1.0, 0, 0.01, max_rpm=300.0)
    with ScriptedTeacher(lambda messages, body: "ls") as teacher:
        client = TeacherClient(TeacherSettings(**{**settings.__dict__, "base_url": teacher.url}))
        start = time.monotonic()
        for _ in range(3):
            client.reply(HELLO, None, ("t", 0))
        elapsed = time.monotonic() - start
    assert elapsed >= 0.4  # 300 a minute: 0.2 s apart, so the third starts 0.4 s after the first
