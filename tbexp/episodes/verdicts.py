"""Whose failure is it? The rule that makes an episode scored, scored with damage, or invalid.

An episode that ends without a usable test report is either the agent's
failure (scored: a policy must never escape a low reward by wrecking its own
sandbox, or GRPO, which drops invalid episodes, would teach it to) or the
infrastructure's (invalid: dropped, since a 0 would punish the policy for
what it did not do). The rule, applied by `tbexp.episodes.rollout.run_episode`:

* **invalid**: nothing the agent did can have caused it. The sandbox or its
  image could not be made or started, the policy's files could not be
  uploaded, the policy itself raised, or the agent ran no command at all
  before the sandbox or the verifier failed. Also invalid: the verifier gives
  no result even in a *control*: a fresh sandbox of the same task, started
  after the episode's own one is stopped and never touched by any agent
  (a test.sh that needs the network, a missing pytest, an engine that died).
* **scored with damage** (`Episode.damage` says what broke): once the agent
  has run a command, a command that makes the sandbox fail (`SandboxError`
  or `OSError` from an exec) ends the agent's turns and the verifier still
  runs; its report, if it gives one, is scored as usual. If the verifier
  then gives no result (an exec or a copy fails, no reward file, no test of
  a pytest task reported, a time-out), twice where the sandbox still runs
  commands, while the control does give one, the agent broke what the tests
  need: the episode is scored on an empty report (no test passed, no task
  reward), so every reward gives it 0.
* **valid**: everything else; the verifier's report is scored. That includes
  a verifier that failed once in a sandbox that still runs commands and then
  verified: a passing fault, not the agent's.

The same rule holds for each step of a multi-step task (its control verifies
that step in a fresh sandbox) and for a separate verifier (the second look and
the control repeat the whole hand-over: the artifacts from the agent's sandbox,
a fresh verifier sandbox; tbexp.episodes.separate_verifier).

A cheap health probe (`echo` in the sandbox, after the verifier failed and
before the sandbox is stopped) tells "the sandbox is broken" (no second
verifier run; the damage record says the sandbox no longer ran commands)
from "the sandbox works but the verifier gave nothing" (the verifier runs
once more). The control, not the probe, decides whose failure a lasting one
is, because an agent that is root in its container can break pytest and
leave bash working.

What is simplified: a control result is remembered per task and sandbox
setting for the life of the process (one extra sandbox per task at most),
so an infrastructure fault that comes and goes is judged by the first
control's answer; and an engine fault during the agent's commands that has
healed by the time of the control counts as the agent's.
"""

from __future__ import annotations

import threading
from typing import Any

from tbexp.episodes.separate_verifier import verify_task
from tbexp.episodes.verifier import TestReport, VerifierError
from tbexp.sandboxes.base import Sandbox, SandboxError, make_sandbox
from tbexp.tasks.harbor_task import Task

PROBE = "echo tbexp-probe-ok"
PROBE_TIMEOUT_S = 10.0
INFRA_ERRORS = (SandboxError, VerifierError, OSError)  # what a broken sandbox or verifier raises

_controls: dict[tuple[str, str], str] = {}  # (task path, sandbox settings) -> "" when the control verified
_controls_lock = threading.Lock()


def probe(sandbox: Sandbox) -> str:
    """'' when the sandbox still runs a command, else what went wrong."""
    try:
        result = sandbox.exec(PROBE, timeout_s=PROBE_TIMEOUT_S)
    except INFRA_ERRORS as err:
        return f"{type(err).__name__}: {err}"
    if result.exit_code != 0 or "tbexp-probe-ok" not in result.output:
        return f"exit {result.exit_code}: {result.output.strip()[-200:]}"
    return ""


def second_look(
    sandbox: Sandbox, task: Task, err: Exception, shared_tests: tuple = (), isolation: str = "shared"
) -> tuple[TestReport | None, str, str]:
    """After the verifier failed in a sandbox the agent used: (report, failure, health).

    The sandbox is probed; one that still runs commands is verified once more, so a passing fault gives
    the report of the second run and failure ''. Otherwise the report is None, `failure` says what the
    verifier raised and `health` what the probe found ('' = the sandbox still ran commands).
    """
    failure = f"{type(err).__name__}: {err}"
    health = probe(sandbox)
    if health:
        return None, failure, health
    try:
        return verify_task(sandbox, task, shared_tests, isolation), "", ""
    except INFRA_ERRORS as again:
        again_said = f"{type(again).__name__}: {again}"
        return None, (failure if again_said == failure else f"{failure}; again: {again_said}"), ""


def control(task: Task, sandbox_settings: Any, shared_tests: tuple = ()) -> str:
    """'' when the task's (or the one step's) verifier gives a result in a fresh sandbox no agent touched."""
    key = (str(task.path), task.steps[0].name if len(task.steps) == 1 else "", str(sandbox_settings))
    with _controls_lock:  # one control per task at a time; the others wait for its answer
        if key not in _controls:
            _controls[key] = _run_control(task, sandbox_settings, shared_tests)
        return _controls[key]


def _run_control(task: Task, sandbox_settings: Any, shared_tests: tuple) -> str:
    sandbox = make_sandbox(sandbox_settings, task)
    try:
        sandbox.start()
        verify_task(sandbox, task, shared_tests)
        return ""
    except Exception as err:  # noqa: BLE001 - whatever stops a fresh sandbox from verifying is not the agent's
        return f"{type(err).__name__}: {err}"
    finally:
        try:
            sandbox.stop()
        except Exception:  # noqa: BLE001 - the control's answer is what matters here
            pass


def judge(failure: str, health: str, task: Task, sandbox_settings: Any, shared_tests: tuple = ()) -> tuple[str, str]:
    """(invalid, damage) for an episode whose verifier gave no result after the agent ran commands."""
    why = control(task, sandbox_settings, shared_tests)
    if why:
        return f"{failure}; the verifier fails in a fresh sandbox too: {why}", ""
    state = f"the sandbox no longer ran commands ({health})" if health else "the sandbox still ran commands"
    return "", f"the verifier gave no result after the agent's commands ({failure}); {state}; a fresh sandbox verifies"


NO_RESULT = TestReport()  # a damaged episode's report: no test passed, no task reward, so every reward gives 0
