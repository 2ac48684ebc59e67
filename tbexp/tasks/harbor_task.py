"""Harbor task directories: load, validate, and describe one task.

A task directory holds `task.toml`, `instruction.md`, `environment/`
(a Dockerfile and the files it copies), `tests/` (`test.sh` plus pytest
files) and optionally `solution/solve.sh`. Only the fields tbexp uses are
read from `task.toml`; the rest is kept verbatim in `Task.config` so nothing
Harbor understands is lost.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path


class TaskError(ValueError):
    """A task directory that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Task:
    name: str  # "org/name" from task.toml, or the directory name
    path: Path
    instruction: str
    config: dict = field(repr=False)  # the parsed task.toml
    workdir: str = "/app"
    verifier_timeout_s: float = 600.0
    agent_timeout_s: float = 600.0

    @property
    def metadata(self) -> dict:
        return self.config.get("metadata", {})

    @property
    def family(self) -> str:
        return str(self.metadata.get("family", self.path.parent.name))

    @property
    def docker_image(self) -> str:
        """A prebuilt image to run instead of building environment/ ("" = build it)."""
        return str(self.config.get("environment", {}).get("docker_image") or "")

    @property
    def network_mode(self) -> str:
        """Harbor's names: "public", "no-network", "allowlist". Without either key: no network, tbexp's default."""
        environment = self.config.get("environment", {})
        if "network_mode" in environment:
            return str(environment["network_mode"])
        return "public" if environment.get("allow_internet") is True else "no-network"

    @property
    def build_timeout_s(self) -> float:
        return float(self.config.get("environment", {}).get("build_timeout_sec", 600.0))

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution_script(self) -> Path | None:
        script = self.path / "solution" / "solve.sh"
        return script if script.is_file() else None


def load_task(path: str | Path) -> Task:
    """Read and check one Harbor task directory.

    >>> load_task("no/such/dir")
    Traceback (most recent call last):
    ...
    tbexp.tasks.harbor_task.TaskError: no/such/dir: not a task directory (no such directory)
    """
    path = Path(path)
    if not path.is_dir():
        raise TaskError(f"{path}: not a task directory (no such directory)")
    toml_path = path / "task.toml"
    if not toml_path.is_file():
        raise TaskError(f"{toml_path}: missing (every Harbor task needs task.toml)")
    try:
        config = tomllib.loads(toml_path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise TaskError(f"{toml_path}: broken TOML: {err}") from err
    for section in ("task", "metadata", "verifier", "agent", "environment"):
        if section in config and not isinstance(config[section], dict):
            raise TaskError(f"{toml_path}: [{section}] must be a table")
    instruction_path = path / "instruction.md"
    if not instruction_path.is_file():
        raise TaskError(f"{instruction_path}: missing (the agent's instruction)")
    test_sh = path / "tests" / "test.sh"
    if not test_sh.is_file():
        raise TaskError(f"{test_sh}: missing (a task without tests cannot be verified)")
    environment = config.get("environment", {})
    return Task(
        name=str(config.get("task", {}).get("name", path.name)),
        path=path,
        instruction=instruction_path.read_text(),
        config=config,
        workdir=str(environment.get("workdir", "/app")),
        verifier_timeout_s=_seconds(config, "verifier", toml_path),
        agent_timeout_s=_seconds(config, "agent", toml_path),
    )


def load_tasks(root: str | Path) -> list[Task]:
    """All task directories directly under `root` (or `root` itself), sorted by name."""
    root = Path(root)
    if (root / "task.toml").is_file():
        return [load_task(root)]
    if not root.is_dir():
        raise TaskError(f"{root}: no such task directory or dataset")
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not dirs:
        raise TaskError(f"{root}: holds no task directories")
    return [load_task(d) for d in dirs]


def _seconds(config: dict, section: str, toml_path: Path) -> float:
    value = config.get(section, {}).get("timeout_sec", 600.0)
    if not isinstance(value, (int, float)) or value <= 0:
        raise TaskError(f"{toml_path}: [{section}].timeout_sec must be a positive number, got {value!r}")
    return float(value)
