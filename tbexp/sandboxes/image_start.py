"""What an image runs when a container of it starts (ENTRYPOINT, CMD, HEALTHCHECK), and starting that as a service.

A sandbox runs its own commands, so it never *is* the image's main process; but a task whose image starts a daemon
(a database, a web server the tests talk to) needs that daemon up before the agent, as it is in the task's container.
`ImageStart` is read from a Dockerfile (the bwrap builder, dockerfile.py's instructions) or from a Docker image's config,
and `start_service(sandbox, start)` runs it in the sandbox, detached, before the agent:

* an ENTRYPOINT runs with Harbor's command for the main container (`sh -c "sleep infinity"`, its compose files'
  `command`), as Harbor's docker environment runs it: an entrypoint script that starts a daemon and then
  `exec "$@"` starts the daemon and sleeps;
* without an ENTRYPOINT, a CMD runs, unless it is an idle default (a bare shell or interpreter, `sleep infinity`,
  `tail -f /dev/null`: what base images and keep-alive commands say). Harbor's own environment replaces CMD with its
  sleep, so there such a daemon never starts: tbexp starts it, as `docker run IMAGE` would (docs/environments.md);
* a HEALTHCHECK (or a compose healthcheck) is waited for, as `docker compose up --wait` waits: its test is run in the
  sandbox every interval until it passes; `retries` failures after the start period make the start fail
  (`SandboxError`: the episode is invalid, the agent never ran). Without one nothing is waited for, as in Docker.

The service's output goes to SERVICE_LOG in the sandbox. What a sandbox must do for the service to outlive the exec
that starts it is its own (`Sandbox.start_daemon`: bwrap's session sandbox, Docker's kept processes).
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import Any

HARBOR_COMMAND = ["sh", "-c", "sleep infinity"]  # Harbor's base compose file: the main service's command
SERVICE_LOG = "/tmp/tbexp-service.log"
IDLE = re.compile(r"(ba|da|z|a|fi)?sh|python[0-9.]*|node|irb|jshell|pwsh")  # a bare one of these runs no service
KEEP_ALIVE = (["sleep", "infinity"], ["tail", "-f", "/dev/null"], ["sleep", "inf"])
DEFAULT_HEALTH = {"interval_s": 30.0, "timeout_s": 30.0, "start_period_s": 0.0, "retries": 3}  # Docker's defaults


@dataclass
class Healthcheck:
    test: list[str]  # ["CMD", argv...] or ["CMD-SHELL", "command"]
    interval_s: float = 30.0
    timeout_s: float = 30.0
    start_period_s: float = 0.0
    retries: int = 3

    def command(self) -> str:
        """The test as one shell command line."""
        kind, *rest = self.test
        return rest[0] if kind == "CMD-SHELL" else shlex.join(rest)


@dataclass
class ImageStart:
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    healthcheck: Healthcheck | None = None
    cmd_set: bool = field(default=False, repr=False)  # CMD set by this build (an ENTRYPOINT after it keeps it)

    def service_argv(self, command: list[str] | None = None) -> list[str] | None:
        """The argv to start as the image's service, or None where the image starts none.

        `command`: what runs the container instead of CMD (a compose file's `command`); an ENTRYPOINT gets Harbor's.

        >>> ImageStart(entrypoint=["/start.sh"], cmd=["bash"]).service_argv()
        ['/start.sh', 'sh', '-c', 'sleep infinity']
        >>> ImageStart(cmd=["python3", "/srv/app.py"]).service_argv(), ImageStart(cmd=["/bin/bash"]).service_argv()
        (['python3', '/srv/app.py'], None)
        """
        if self.entrypoint:
            return [*self.entrypoint, *(command if command is not None else HARBOR_COMMAND)]
        argv = command if command is not None else self.cmd
        if not argv or _idle(argv):
            return None
        return list(argv)

    def as_json(self) -> dict[str, Any]:
        return {
            "entrypoint": self.entrypoint,
            "cmd": self.cmd,
            "healthcheck": self.healthcheck and asdict(self.healthcheck),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> ImageStart:
        data = data or {}
        health = data.get("healthcheck")
        return cls(data.get("entrypoint"), data.get("cmd"), Healthcheck(**health) if health else None)

    @classmethod
    def from_docker(cls, config: dict[str, Any]) -> ImageStart:
        """From `docker inspect`'s Config (Entrypoint, Cmd, Healthcheck with durations in nanoseconds)."""
        health = config.get("Healthcheck") or {}
        test = health.get("Test") or []
        check = None
        if test and test[0] in ("CMD", "CMD-SHELL"):
            ns = {k: health.get(k) for k in ("Interval", "Timeout", "StartPeriod")}
            check = Healthcheck(
                list(test),
                (ns["Interval"] or 30e9) / 1e9,
                (ns["Timeout"] or 30e9) / 1e9,
                (ns["StartPeriod"] or 0) / 1e9,
                int(health.get("Retries") or 3),
            )
        return cls(config.get("Entrypoint") or None, config.get("Cmd") or None, check)


def _idle(argv: list[str]) -> bool:
    """A bare shell or interpreter, or a keep-alive: a base image's default, no service.

    >>> _idle(["bash"]), _idle(["/usr/bin/python3"]), _idle(["sh", "-c", "sleep infinity"]), _idle(["redis-server"])
    (True, True, True, False)
    """
    if argv in KEEP_ALIVE:
        return True
    if len(argv) == 1 and IDLE.fullmatch(argv[0].rsplit("/", 1)[-1]):
        return True
    return (
        len(argv) == 3
        and IDLE.fullmatch(argv[0].rsplit("/", 1)[-1])
        and argv[1] == "-c"
        and _idle(shlex.split(argv[2]))
    )


# -- reading a Dockerfile's start instructions ----------------------------------------------------------------------


def apply_start(step: Any, start: ImageStart, shell: list[str]) -> None:
    """ENTRYPOINT, CMD or HEALTHCHECK (a dockerfile.Instruction) applied to `start`, as Docker keeps them."""
    if step.keyword == "HEALTHCHECK":
        start.healthcheck = read_healthcheck(step)
        return
    argv = step.words() if step.args.startswith("[") else [*shell, step.args]  # shell form goes through SHELL
    if step.keyword == "CMD":
        start.cmd, start.cmd_set = argv, True
    else:  # ENTRYPOINT resets a CMD the base image set, not one this build set before it
        start.entrypoint = argv
        start.cmd = start.cmd if start.cmd_set else None


def read_healthcheck(step: Any) -> Healthcheck | None:
    """HEALTHCHECK [--interval=D] [--timeout=D] [--start-period=D] [--retries=N] CMD command | NONE."""
    from tbexp.sandboxes.dockerfile import DockerfileError

    words = step.args.split(None, 1)
    if words and words[0].upper() == "NONE":
        return None
    if not words or words[0].upper() != "CMD" or len(words) < 2:
        raise DockerfileError(f"{step.where}: HEALTHCHECK expects [options] CMD command, or NONE")
    rest = words[1].strip()
    test = ["CMD", *_json_words(rest)] if rest.startswith("[") else ["CMD-SHELL", rest]
    values = dict(DEFAULT_HEALTH)
    for name, value in step.flags.items():
        key = {"interval": "interval_s", "timeout": "timeout_s", "start-period": "start_period_s"}.get(name)
        if key:
            values[key] = duration_s(value, f"{step.where}: HEALTHCHECK --{name}")
        elif name == "retries" and value.isdigit():
            values["retries"] = int(value)
        elif name != "start-interval":
            raise DockerfileError(f"{step.where}: HEALTHCHECK --{name}={value}: not a HEALTHCHECK option")
    return Healthcheck(test, **values)


def duration_s(text: str | int | float, where: str) -> float:
    """A Docker/compose duration (`1m30s`, `500ms`, `2s`, a bare number of seconds) in seconds.

    >>> duration_s("1m30s", ""), duration_s("500ms", ""), duration_s(3, "")
    (90.0, 0.5, 3.0)
    """
    from tbexp.sandboxes.base import EnvironmentBuildError

    if isinstance(text, (int, float)):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", text.strip())
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise EnvironmentBuildError(f"{where}: {text!r} is not a duration (like 1m30s, 500ms)")
    scale = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


def _json_words(text: str) -> list[str]:
    import json

    value = json.loads(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"not a JSON list of strings: {text}")
    return value


# -- starting it in a sandbox -----------------------------------------------------------------------------------


def start_service(sandbox: Any, start: ImageStart | None, command: list[str] | None = None) -> str:
    """Start the image's service in `sandbox` (detached, as the image's USER) and wait for its healthcheck.

    Returns the command started ('' for none). SandboxError where the healthcheck never passes.
    """
    from tbexp.sandboxes.base import SandboxError

    argv = start.service_argv(command) if start else None
    if argv is None:
        return ""
    line = shlex.join(argv)
    launch = (
        f"if command -v setsid >/dev/null; then setsid {line} >{SERVICE_LOG} 2>&1 </dev/null & "
        f"else {line} >{SERVICE_LOG} 2>&1 </dev/null & fi"
    )
    started = sandbox.start_daemon(launch, timeout_s=60)
    if started.exit_code != 0:
        raise SandboxError(f"the image's service ({line}) could not be started: {started.output[-300:]}")
    if start.healthcheck:
        wait_healthy(sandbox, start.healthcheck, line)
    return line


def wait_healthy(sandbox: Any, check: Healthcheck, what: str) -> None:
    """Run the healthcheck until it passes; SandboxError after `retries` failures past the start period."""
    from tbexp.sandboxes.base import SandboxError

    began = time.monotonic()
    failures, last = 0, None
    while True:
        last = sandbox.exec(check.command(), timeout_s=check.timeout_s)
        if last.exit_code == 0:
            return
        if time.monotonic() - began >= check.start_period_s:
            failures += 1
        if failures >= check.retries:
            log = sandbox.exec(f"tail -c 1500 {SERVICE_LOG} 2>/dev/null", timeout_s=10).output
            raise SandboxError(
                f"the image's service ({what}) never became healthy: its healthcheck ({check.command()}) failed "
                f"{failures} times (last exit {last.exit_code}: {last.output.strip()[-300:]}); its output:\n{log}"
            )
        time.sleep(check.interval_s)
