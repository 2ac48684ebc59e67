"""tbexp's sandboxes as Harbor environments, so Harbor's own runner can use them.

    EnvironmentConfig(import_path="tbexp.sandboxes.harbor_env:BwrapEnvironment")     # or harbor run -e ...
    EnvironmentConfig(import_path="tbexp.sandboxes.harbor_env:DockerEnvironment", kwargs={"sandbox": {"cpus": 2}})

`SandboxEnvironment` adapts any `tbexp.sandboxes.base.Sandbox` to
`harbor.environments.base.BaseEnvironment`: the task directory is the parent of
Harbor's `environment_dir`, `start`/`stop` are the sandbox's, and each async
method runs the blocking sandbox call on a thread. Harbor's `exec(command, cwd,
env, timeout_sec, user)` becomes one `Sandbox.exec` of a script that changes
directory and exports the variables first. The sandbox node comes from
the sandbox's own schema (`BwrapSandboxConfig`, `DockerSandboxConfig`) defaults, overlaid by the environment's `kwargs["sandbox"]`,
then by the task's own `memory_mb` / `storage_mb` / `cpus` (docker only: bwrap has no CPU quota).

What it simplifies or refuses:
* Output: stdout and stderr come back interleaved, all in `stdout`; the
  sandbox's `output_limit_bytes` still applies (a command printing more is
  killed, exit 125), so Harbor agents that print a lot need a larger limit.
* Processes: in `BwrapEnvironment` what a command starts lives on until the
  environment stops, as in a container (`tbexp.sandboxes.bwrap_session`).
  `DockerEnvironment`'s sandbox ends whatever an exec started, except the
  tmux server of a command that starts one (`tmux new-session`, as
  terminus-2's TmuxSession does): that command runs through
  `Sandbox.start_daemon`, so the server and its panes live until stop. Other
  agents that keep a background process between execs run only in bwrap.
* Users: a command Harbor runs as a user (`[agent].user`, `[verifier].user`)
  runs as that user (`Sandbox.as_user`); None is the image's USER.
* Network: tbexp sandboxes have none, so the environment declares
  `disable_internet`, and a task whose network mode is `public` runs offline too,
  as in tbexp's own episodes (the downloads a Terminal-Bench test.sh makes are
  provisioned: sandboxes/provision.py, applied to Harbor's verifier command).
* A prebuilt `[environment] docker_image` is run as tbexp's sandboxes run it.
* No host mounts: Harbor downloads `/logs/...` after each phase instead.
* A separate verifier environment is built from the directory Harbor names
  (`tests/` with its own Dockerfile), as tbexp's episodes build it.
* Verification is hardened as in tbexp's own episodes (tbexp.episodes.integrity): Harbor's verifier announces
  itself with its first command (`rm -f -- /logs/verifier/reward.txt /logs/verifier/reward.json`, as root);
  before it runs, every process the agent left is ended, what it planted where the verifier reads is set aside,
  `/logs/verifier` and `/tests` are made afresh (Harbor itself only removes the two reward files), and test.sh
  gets tbexp's start-up. What was found is written to `tbexp-integrity.json` in the trial's folder, which
  tbexp.episodes.harbor_trials reads into the episode. Any later command of another kind (a multi-step task's
  next step) is the agent's again.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # harbor imports litellm, which goes online otherwise

from harbor.environments.base import BaseEnvironment, ExecResult  # noqa: E402
from harbor.environments.capabilities import EnvironmentCapabilities  # noqa: E402
from harbor.models.trial.paths import EnvironmentPaths  # noqa: E402
from hydra.utils import get_class  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from tbexp.config import BwrapSandboxConfig, DockerSandboxConfig, SandboxConfig  # noqa: E402
from tbexp.episodes import integrity  # noqa: E402
from tbexp.episodes.verifier import PREPARE, PREPARE_LOGS, PREPARE_TIMEOUT_S  # noqa: E402
from tbexp.sandboxes import provision  # noqa: E402
from tbexp.sandboxes.base import Sandbox  # noqa: E402
from tbexp.tasks.harbor_task import Task  # noqa: E402

HARBOR_REMOVE_REWARDS = "rm -f -- /logs/verifier/reward.txt /logs/verifier/reward.json"  # Verifier's first exec
HARBOR_TEST = re.compile(r"^\(?/tests/\S+?\)? > /logs/verifier/test-stdout\.txt 2>&1$")  # build_execution_command's
INTEGRITY_FILE = "tbexp-integrity.json"  # in the trial's folder
NO_TIMEOUT_S = 24 * 3600.0  # Harbor's timeout_sec=None means "none"; the trial's own time-outs bound the phase
TMUX_SERVER_START = "tmux new-session"  # a command that starts a tmux server, whose panes must outlive the exec

# Sandbox calls block for the whole command, so they get their own threads rather than asyncio's
# default pool (cpu_count + 4 threads), which would queue trials once more of them run at once.
_threads = ThreadPoolExecutor(max_workers=128, thread_name_prefix="tbexp-harbor-env")


class SandboxEnvironment(BaseEnvironment):
    """A Harbor environment backed by one single-use tbexp sandbox."""

    sandbox_schema: ClassVar[type[SandboxConfig]]  # its settings (their `_target_` is the tbexp Sandbox class)
    sandbox_name: ClassVar[str]  # its `sandbox.name`, also Harbor's environment type

    def __init__(self, *args: Any, sandbox: dict[str, Any] | None = None, **kwargs: Any):
        base = OmegaConf.structured(self.sandbox_schema)
        self.settings = OmegaConf.merge(base, sandbox or {})
        super().__init__(*args, **kwargs)
        self._apply_task_resources()
        self.task = Task(
            name=self.environment_name,
            path=Path(self.environment_dir).parent,
            environment_path=Path(self.environment_dir),  # tests/ for a separate verifier
            instruction="",
            config={},
            workdir=self.task_env_config.workdir or "/app",
            docker_image=self.task_env_config.docker_image or "",
            network_mode="no-network",  # offline whatever the task asks, as tbexp's own episodes run it
        )
        # for_task: a task whose image starts a service gets the sandbox kind that keeps it (bwrap's session sandbox)
        self.sandbox: Sandbox = get_class(self.settings._target_).for_task(self.settings, self.task)

    @classmethod
    def type(cls) -> str:  # Harbor declares it static; a classmethod is called the same way
        return f"tbexp-{cls.sandbox_name}"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        dockerfile = Path(self.environment_dir) / "Dockerfile"
        if not dockerfile.is_file() and not self.task_env_config.docker_image:
            raise FileNotFoundError(
                f"{dockerfile}: missing, and no [environment] docker_image; tbexp sandboxes build a task from its "
                "Dockerfile or run its prebuilt image (a docker-compose.yaml's other services beside it, in Docker)"
            )

    def _apply_task_resources(self) -> None:
        """The task's own limits win over the node's defaults, as in Harbor's environments."""
        for key, value in (
            ("memory_mb", self._effective_memory_mb),
            ("disk_mb", self._effective_storage_mb),
            ("cpus", self._effective_cpus),
        ):
            if value and key in self.settings:  # bwrap has no CPU quota
                self.settings[key] = value

    async def _call(self, fn, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(_threads, partial(fn, *args))

    async def start(self, force_build: bool) -> None:
        await self._call(self.sandbox.start)
        paths = EnvironmentPaths.for_os(self.os)
        dirs = dict.fromkeys(
            [
                str(paths.agent_dir),
                str(paths.verifier_dir),
                str(paths.artifacts_dir),
                *self._mount_targets(writable_only=True),
            ]
        )
        await self.ensure_dirs(list(dirs))  # what Harbor's local environments get from their mounts
        await self._call(self.sandbox.mark_agent_start)  # what runs and changes from here on is the agent's

    async def stop(self, delete: bool) -> None:
        await self._call(self.sandbox.stop)  # single-use: stopping always deletes

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        user = self._resolve_user(user)
        verifier = (
            command == HARBOR_REMOVE_REWARDS or command.startswith("chmod +x /tests/") or HARBOR_TEST.match(command)
        )
        if verifier and not self.sandbox.verifying:
            await self._call(self._begin_verification)
        elif not verifier and self.sandbox.verifying:  # a multi-step task's next step: the agent's again
            await self._call(self._back_to_the_agent)
        script = _with_cwd_and_env(command, cwd, self._merge_env(env))
        if HARBOR_TEST.match(command):  # Harbor's verifier: uv offline, on what provision.py put in place
            script = provision.verifier_command(
                getattr(self.sandbox, "provision", None),
                f"bash -c {shlex.quote(integrity.exports(self.sandbox) + script)}",
            )
        timeout_s = float(timeout_sec) if timeout_sec else NO_TIMEOUT_S
        result = await self._call(self._exec_as, user, script, timeout_s)
        if callback := self._output_callback():
            await callback(result.output, "stdout")
        return ExecResult(stdout=result.output, stderr="", return_code=result.exit_code)

    def _begin_verification(self) -> None:
        # A separate verifier environment built from tests/ holds the tests in its image (Harbor skips the upload).
        in_image = Path(self.environment_dir).name == "tests"
        record = integrity.begin(self.sandbox, self.task, tests_in_image=in_image)
        with self.sandbox.as_user("root"):  # Harbor removes only the reward files
            self.sandbox.exec(PREPARE_LOGS if in_image else PREPARE, timeout_s=PREPARE_TIMEOUT_S)
        path = Path(self.trial_paths.trial_dir) / INTEGRITY_FILE
        path.write_text(json.dumps(record.record(), indent=1))

    def _back_to_the_agent(self) -> None:
        integrity.end(self.sandbox)
        self.sandbox.mark_agent_start()

    def _exec_as(self, user, script: str, timeout_s: float):
        run = self.sandbox.start_daemon if TMUX_SERVER_START in script else self.sandbox.exec
        with self.sandbox.as_user(user):
            return run(script, timeout_s)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await self._call(self.sandbox.upload, Path(source_path), target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._call(self.sandbox.upload, Path(source_dir), target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        await self._call(self.sandbox.download, source_path, Path(target_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self._call(self.sandbox.download, source_dir, Path(target_dir))


def _with_cwd_and_env(command: str, cwd: str | None, env: dict[str, str] | None) -> str:
    """`command` preceded by the `cd` and `export`s Harbor asked for, on its own first line, so the command's line
    numbers (in bash's error messages) are those it has alone, as where Harbor's environments pass `env` to the
    process.

    >>> print(_with_cwd_and_env("ls\\nwc", "/app", {"A": "1 2"}))
    cd -- /app || exit 1; export A='1 2'; ls
    wc
    """
    setup = [f"cd -- {shlex.quote(cwd)} || exit 1"] if cwd else []
    setup += [f"export {key}={shlex.quote(str(value))}" for key, value in (env or {}).items()]
    return "; ".join([*setup, command])


@dataclass
class BwrapSessionConfig(BwrapSandboxConfig):
    """bwrap's settings, for the sandbox whose processes live between execs, as a container's do."""

    _target_: str = "tbexp.sandboxes.bwrap_session.BwrapSessionSandbox"


class BwrapEnvironment(SandboxEnvironment):
    sandbox_schema = BwrapSessionConfig
    sandbox_name = "bwrap"

    def _validate_definition(self) -> None:
        super()._validate_definition()
        from tbexp.sandboxes.dockerfile import read_dockerfile

        if not self.task_env_config.docker_image:  # an unreadable Dockerfile is refused now, not mid-trial
            read_dockerfile(Path(self.environment_dir) / "Dockerfile")


class DockerEnvironment(SandboxEnvironment):
    sandbox_schema = DockerSandboxConfig
    sandbox_name = "docker"
