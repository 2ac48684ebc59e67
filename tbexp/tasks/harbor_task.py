"""Task directories, read with Harbor's own task model.

`load_task` hands a directory to `harbor.models.task.task.Task`, the class Harbor's Trial loads, so every
`task.toml` schema Harbor reads loads here the same way: `[environment] docker_image`, the time-outs,
`cpus` / `memory_mb` / `storage_mb` (and the legacy `memory = "2G"`), `network_mode` (and the legacy
`allow_internet`), `[agent]` / `[verifier]` user, `[verifier]` env / environment_mode with a separate verifier
environment (Harbor's own resolution: `tests/Dockerfile`, else a copy of the task's environment) and the
`artifacts` handed to it, several named rewards, and multi-step tasks (`[[steps]]` with `steps/<name>/`).
Loaded tasks are cached on disk by content (model_cache.py).
A Terminal-Bench 1 directory (`task.yaml`) is first converted by Harbor's own mapper (`tbexp.tasks.migrate`).

tbexp's `Task` keeps the values its episode loop reads as plain fields, the raw `task.toml` in `config`
and Harbor's parsed `TaskConfig` in `harbor`. What Harbor leaves open gets tbexp's defaults: no
`[agent] timeout_sec` is 600 s (Harbor: no limit), no `workdir` is /app.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tbexp.errors import TbexpError

DEFAULT_TIMEOUT_S = 600.0  # agent and verifier, where task.toml names none
SINGLE_STEP = "main"  # the name of the one step of a task without [[steps]]


class TaskError(TbexpError, ValueError):
    """A task directory that cannot be used; the message names the file."""


@dataclass(frozen=True)
class VerifierEnvironment:
    """Where a separate verifier runs (Harbor's `resolve_verifier_environment_definition`, read once at load)."""

    directory: Path  # the build context: tests/ (holding the verifier's Dockerfile) or, without one, environment/
    bundled_tests: bool  # the image holds the tests (tests/Dockerfile's `COPY . /tests/`): they are not uploaded
    docker_image: str = ""  # a prebuilt verifier image; "" = build `directory`
    network_mode: str = "no-network"
    workdir: str = "/app"
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None


@dataclass(frozen=True)
class TaskStep:
    """One step of a task: its instruction, and the files Harbor gives that step."""

    name: str
    instruction: str
    tests_dirs: tuple[Path, ...] = ()  # copied to /tests in order (the task's tests/, then the step's own)
    solution_script: Path | None = None  # the oracle's solve.sh: the step's own, else the task's
    workdir_dir: Path | None = None  # steps/<name>/workdir: copied into the working directory before the step
    agent_timeout_s: float = DEFAULT_TIMEOUT_S
    verifier_timeout_s: float = DEFAULT_TIMEOUT_S
    verifier_env: dict[str, str] = field(default_factory=dict)
    min_reward: float | dict[str, float] | None = None  # below it, the remaining steps are not run (Harbor's gate)
    verifier_environment: VerifierEnvironment | None = None  # this step's separate verifier; None: shared
    artifacts: tuple[str, ...] = ()  # what a separate verifier gets from the agent's sandbox (the step's own added)
    artifact_excludes: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (source, its `exclude` patterns), where set

    @property
    def setup_script(self) -> Path | None:
        """steps/<name>/workdir/setup.sh, run in the working directory before the step's agent."""
        script = self.workdir_dir / "setup.sh" if self.workdir_dir else None
        return script if script and script.is_file() else None


@dataclass(frozen=True)
class Task:
    name: str  # "org/name" from task.toml, or the directory name
    path: Path
    instruction: str  # a multi-step task's first step's instruction
    config: dict = field(repr=False)  # the raw task.toml
    workdir: str = "/app"
    verifier_timeout_s: float = DEFAULT_TIMEOUT_S
    agent_timeout_s: float = DEFAULT_TIMEOUT_S
    # Harbor's parsed TaskConfig (`harbor`), or its fields as JSON in a task unpickled from the cache (model_cache.py),
    # made a TaskConfig on first use so that a cached load does not import Harbor's models; None when built by hand
    harbor_config: Any = field(default=None, repr=False, compare=False)
    docker_image: str = ""  # a prebuilt image; "" = build environment/
    network_mode: str = "public"  # Harbor's values: public | no-network | allowlist (Harbor's default is public)
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    build_timeout_s: float = 600.0
    verifier_env: dict[str, str] = field(default_factory=dict, repr=False)  # as written; ${VAR} resolved at verify time
    verifier_environment: VerifierEnvironment | None = None  # Harbor's separate verifier mode; None: shared
    artifacts: tuple[str, ...] = ()  # task.toml's `artifacts` sources, handed to a separate verifier
    artifact_excludes: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (source, its `exclude` patterns), where set
    agent_user: str | int | None = None  # [agent] user: the agent's commands run as it; None = the image's USER
    verifier_user: str | int | None = None  # [verifier] user: test.sh runs as it; None = the image's USER
    steps: list[TaskStep] = field(default_factory=list, repr=False)  # in order; one for a single-step task
    environment_path: Path | None = None  # the build context when not `path/environment` (a verifier's own)

    def __post_init__(self):
        if not self.steps:  # a Task built by hand (Harbor's environments do) is one step, as Harbor runs it
            object.__setattr__(self, "steps", [self._single_step()])

    @property
    def harbor(self) -> Any:
        """harbor.models.task.config.TaskConfig of this task (None for a Task built by hand)."""
        if isinstance(self.harbor_config, dict):
            from harbor.models.task.config import TaskConfig

            object.__setattr__(self, "harbor_config", TaskConfig.model_validate(self.harbor_config))
        return self.harbor_config

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if hasattr(self.harbor_config, "model_dump"):  # only the fields task.toml set, so model_fields_set survives
            state["harbor_config"] = self.harbor_config.model_dump(mode="json", exclude_unset=True)
        return state

    @property
    def metadata(self) -> dict:
        return self.config.get("metadata", {})

    @property
    def family(self) -> str:
        """`family` from the metadata, else `category`, else the task's name without its org and trailing number."""
        for key in ("family", "category"):
            if self.metadata.get(key):
                return str(self.metadata[key])
        return family_from_name(self.name)

    @property
    def environment_dir(self) -> Path:
        return self.environment_path or self.path / "environment"

    @property
    def verifier_environment_dir(self) -> Path | None:
        """The folder of the verifier's own Dockerfile, when a separate verifier is built from one."""
        ve = self.verifier_environment
        return ve.directory if ve and ve.bundled_tests and not ve.docker_image else None

    @property
    def separate_verifier(self) -> VerifierEnvironment | None:
        """The verifier's own environment (of the one step, for a step), or None where the verifier is shared."""
        return self.steps[0].verifier_environment if len(self.steps) == 1 else self.verifier_environment

    def for_verifier(self) -> Task:
        """This task as its separate verifier's sandbox sees it: that environment, its limits, its network."""
        ve = self.separate_verifier
        if ve is None:
            raise TaskError(f"{self.path / 'task.toml'}: the verifier is not separate (no verifier environment)")
        return replace(
            self,
            environment_path=ve.directory,
            docker_image=ve.docker_image,
            network_mode=ve.network_mode,
            workdir=ve.workdir,
            cpus=ve.cpus,
            memory_mb=ve.memory_mb,
            storage_mb=ve.storage_mb,
            verifier_environment=None,
            steps=[replace(step, verifier_environment=None) for step in self.steps],
        )

    @property
    def tests_dir(self) -> Path:
        """The folder whose test.sh runs (for one step of a multi-step task, that step's own when it has one)."""
        dirs = self.steps[0].tests_dirs if len(self.steps) == 1 else ()
        return dirs[-1] if dirs else self.path / "tests"

    @property
    def solution_script(self) -> Path | None:
        if len(self.steps) == 1 and self.steps[0].solution_script:
            return self.steps[0].solution_script
        script = self.path / "solution" / "solve.sh"
        return script if script.is_file() else None

    def for_step(self, step: TaskStep) -> Task:
        """This task as its one step `step`: what the agent, the oracle and the verifier of that step see."""
        return replace(
            self,
            instruction=step.instruction,
            agent_timeout_s=step.agent_timeout_s,
            verifier_timeout_s=step.verifier_timeout_s,
            verifier_env=step.verifier_env,
            verifier_environment=step.verifier_environment,
            artifacts=step.artifacts,
            artifact_excludes=step.artifact_excludes,
            steps=[step],
        )

    def _single_step(self) -> TaskStep:
        tests = self.path / "tests"
        script = self.path / "solution" / "solve.sh"
        return TaskStep(
            name=SINGLE_STEP,
            instruction=self.instruction,
            tests_dirs=(tests,),
            solution_script=script if script.is_file() else None,
            agent_timeout_s=self.agent_timeout_s,
            verifier_timeout_s=self.verifier_timeout_s,
            verifier_env=self.verifier_env,
            verifier_environment=self.verifier_environment,
            artifacts=self.artifacts,
            artifact_excludes=self.artifact_excludes,
        )


class TaskSet(list):
    """The loadable tasks of a set, plus `unloadable`: task directory -> why it could not be loaded, and `excluded`:
    task name -> why `tasks.manifest` keeps it out."""

    def __init__(self, tasks=(), unloadable: dict[str, str] | None = None, excluded: dict[str, str] | None = None):
        super().__init__(tasks)
        self.unloadable: dict[str, str] = dict(unloadable or {})
        self.excluded: dict[str, str] = dict(excluded or {})


def family_from_name(name: str) -> str:
    """A task's name without its org and a trailing instance number.

    >>> family_from_name("terminal-bench/fix-git-3"), family_from_name("hello_world"), family_from_name("org/7zip")
    ('fix-git', 'hello_world', '7zip')
    """
    short = name.rsplit("/", 1)[-1]
    return re.sub(r"[-_.]\d+$", "", short) or short


def load_task(path: str | Path, migrated_dir: Path | None = None) -> Task:
    """Read and check one task directory: Harbor's layout, or Terminal-Bench 1's (converted into `migrated_dir`).

    >>> load_task("no/such/dir")
    Traceback (most recent call last):
    ...
    tbexp.tasks.harbor_task.TaskError: no/such/dir: not a task directory (no such directory)
    """
    path = Path(path)
    if not path.is_dir():
        raise TaskError(f"{path}: not a task directory (no such directory)")
    if not (path / "task.toml").is_file() and (path / "task.yaml").is_file():
        from tbexp.tasks.migrate import MigrationError, migrate_tb1

        try:
            path = migrate_tb1(path, migrated_dir)
        except MigrationError as err:  # a task that cannot be used, as every other loading error
            raise TaskError(str(err)) from err
    toml_path = path / "task.toml"
    if not toml_path.is_file():
        raise TaskError(f"{toml_path}: missing (every Harbor task needs task.toml; a Terminal-Bench 1 task, task.yaml)")
    # Harbor's checks walk the task's trees (~70 ms a task on a loaded machine): a stage loads the same set several
    # times (memo by stamps), and each new process finds the loaded task cached on disk by content (model_cache.py)
    key = (path, *(_stamp(path / name) for name in ("task.toml", "instruction.md", "tests", "steps", "solution")))
    if key not in _loaded:
        from tbexp.tasks.model_cache import cached_task

        _loaded[key] = cached_task(path, lambda: _parse(path, toml_path))
    return _loaded[key]


def _parse(path: Path, toml_path: Path) -> Task:
    try:
        config = tomllib.loads(toml_path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise TaskError(f"{toml_path}: broken TOML: {err}") from err
    return _from_harbor(path, config, _harbor_task(path, config))


def load_tasks(root: str | Path, migrated_dir: Path | None = None) -> TaskSet:
    """All task directories directly under `root` (or `root` itself), sorted by name.

    A directory that cannot be loaded is listed in the result's `unloadable` with its reason; only a set
    with no loadable task at all is an error.
    """
    root = Path(root)
    if (root / "task.toml").is_file() or (root / "task.yaml").is_file():
        return TaskSet([load_task(root, migrated_dir)])
    if not root.is_dir():
        raise TaskError(f"{root}: no such task directory or dataset")
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not dirs:
        raise TaskError(f"{root}: holds no task directories")
    tasks, unloadable = [], {}
    for d in dirs:
        try:
            tasks.append(load_task(d, migrated_dir))
        except TaskError as err:
            unloadable[str(d)] = str(err)
    if not tasks:
        reasons = "\n".join(f"  {reason}" for reason in unloadable.values())
        raise TaskError(f"{root}: none of its {len(dirs)} task directories can be loaded:\n{reasons}")
    return TaskSet(tasks, unloadable)


_loaded: dict[tuple, Task] = {}  # (path, stamps of its files) -> the Task loaded from them


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def _harbor_task(path: Path, config: dict) -> Any:
    """Harbor's own Task for `path`; its refusals become TaskErrors that name the file."""
    import warnings

    from harbor.models.task.task import Task as HarborTask
    from pydantic import ValidationError

    try:
        with warnings.catch_warnings():  # legacy fields (memory, allow_internet) are migrated, as Harbor does
            warnings.simplefilter("ignore", DeprecationWarning)
            task = HarborTask(path)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'task.toml'}: {e['msg']}" for e in err.errors())
        raise TaskError(f"{path / 'task.toml'}: {problems}") from err
    except (OSError, ValueError, RuntimeError) as err:
        raise TaskError(_missing_file(path, config) or f"{path}: {err}") from err
    if not task.config.environment.docker_image and not task.paths.environment_dir.is_dir():
        raise TaskError(f"{task.paths.environment_dir}: missing (and task.toml names no [environment].docker_image)")
    return task


def _missing_file(path: Path, config: dict) -> str:
    """The usual reason Harbor refuses a task, said by file name; "" when it is something else."""
    if config.get("steps"):
        return ""
    if not (path / "instruction.md").is_file():
        return f"{path / 'instruction.md'}: missing (the agent's instruction)"
    if not (path / "tests" / "test.sh").is_file():
        return f"{path / 'tests' / 'test.sh'}: missing (a task without tests cannot be verified)"
    return ""


def _from_harbor(path: Path, config: dict, harbor_task: Any) -> Task:
    cfg = harbor_task.config
    env = cfg.environment
    agent_timeout_s = _positive(cfg.agent.timeout_sec, "agent", path)
    verifier_timeout_s = _positive(cfg.verifier.timeout_sec, "verifier", path)
    steps = [_step(harbor_task, s, path) for s in cfg.steps] if cfg.steps else []
    return Task(
        name=harbor_task.name,
        path=path,
        instruction=steps[0].instruction if steps else harbor_task.instruction,
        config=config,
        workdir=env.workdir or "/app",
        verifier_timeout_s=verifier_timeout_s,
        agent_timeout_s=agent_timeout_s,
        harbor_config=cfg,
        docker_image=env.docker_image or "",
        network_mode=env.network_mode.value,
        cpus=None if env.cpus is None else float(env.cpus),
        memory_mb=env.memory_mb,
        storage_mb=env.storage_mb,
        build_timeout_s=float(env.build_timeout_sec),
        verifier_env=dict(cfg.verifier.env),
        verifier_environment=_verifier_environment(harbor_task, None),
        artifacts=_artifact_sources(cfg.artifacts),
        artifact_excludes=_artifact_excludes(cfg.artifacts),
        agent_user=cfg.agent.user,
        verifier_user=cfg.verifier.user,
        steps=steps,
    )


def _step(harbor_task: Any, step: Any, path: Path) -> TaskStep:
    """One [[steps]] entry, with the files and time-outs Harbor's MultiStepTrial gives it."""
    paths, cfg = harbor_task.paths, harbor_task.config
    tests = tuple(d for d in (paths.tests_dir, paths.step_tests_dir(step.name)) if d.is_dir())
    solve = paths.discovered_step_solve_path_for(step.name, None) or paths.discovered_solve_path_for(None)
    workdir = paths.step_workdir_dir(step.name)
    agent_timeout = step.agent.timeout_sec if step.agent.timeout_sec is not None else cfg.agent.timeout_sec
    return TaskStep(
        name=step.name,
        instruction=harbor_task.step_instruction(step.name),
        tests_dirs=tests,
        solution_script=solve if solve and solve.suffix == ".sh" else None,
        workdir_dir=workdir if workdir.is_dir() else None,
        agent_timeout_s=_positive(agent_timeout, f"steps.{step.name}.agent", path),
        # Harbor takes the step's [verifier] timeout_sec, whose default (600) shadows the task's
        verifier_timeout_s=_positive(step.verifier.timeout_sec, f"steps.{step.name}.verifier", path),
        verifier_env={**cfg.verifier.env, **step.verifier.env},
        min_reward=step.min_reward,
        verifier_environment=_verifier_environment(harbor_task, step),
        artifacts=_artifact_sources([*cfg.artifacts, *step.artifacts]),
        artifact_excludes=_artifact_excludes([*cfg.artifacts, *step.artifacts]),
    )


def _verifier_environment(harbor_task: Any, step: Any) -> VerifierEnvironment | None:
    """Harbor's separate verifier environment of the task (or of one step), or None where the verifier is shared."""
    from harbor.models.task.verifier_mode import resolve_verifier_environment_definition

    definition = resolve_verifier_environment_definition(harbor_task.config, harbor_task.paths, step)
    if definition is None:
        return None
    env = definition.config
    return VerifierEnvironment(
        directory=definition.directory,
        bundled_tests=definition.bundled_tests,
        docker_image=env.docker_image or "",
        network_mode=env.network_mode.value,
        workdir=env.workdir or harbor_task.config.environment.workdir or "/app",
        cpus=None if env.cpus is None else float(env.cpus),
        memory_mb=env.memory_mb,
        storage_mb=env.storage_mb,
    )


def _artifact_sources(entries: list) -> tuple[str, ...]:
    """The sources of task.toml's `artifacts` (a path, or a table with `source`), in order, once each."""
    sources = [entry if isinstance(entry, str) else entry.source for entry in entries]
    return tuple(dict.fromkeys(sources))


def _artifact_excludes(entries: list) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(source, exclude patterns) of the `artifacts` tables that name some; the first entry of a source wins."""
    excludes: dict[str, tuple[str, ...]] = {}
    for entry in entries:
        if not isinstance(entry, str) and entry.exclude:
            excludes.setdefault(entry.source, tuple(entry.exclude))
    return tuple(excludes.items())


def _positive(value: float | None, section: str, path: Path) -> float:
    if value is None:
        return DEFAULT_TIMEOUT_S
    if value <= 0:
        raise TaskError(f"{path / 'task.toml'}: [{section}].timeout_sec must be a positive number, got {value!r}")
    return float(value)
