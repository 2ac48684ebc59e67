"""Shared fixtures: composed configs, the sandbox root file system, tiny hand-made tasks."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from tbexp.config import register

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
# The conformance and attack suites' task directories hold the tasks' own pytest files, which run inside
# sandboxes, not here.
collect_ignore = ["conformance", "attacks"]

register()
# W&B's server cannot be reached from the tests: a user's WANDB_MODE=online must not send their runs or reports there.
os.environ.pop("WANDB_MODE", None)

try:  # the Docker engine fixture lives beside the Docker tests
    from tests.docker_service import docker_engine  # noqa: F401
except ImportError:  # pragma: no cover - only while the Docker tests are absent
    pass
from tests.tinker_server import tinker_server, tinker_service  # noqa: F401, E402  (one server for the session)


@pytest.fixture(autouse=True)
def _default_cache_root():
    """A job built by one test makes its cache root the process's (tbexp.cache); the next test starts without it."""
    from tbexp.cache import use_root

    yield
    use_root(None)


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


def compose_job(*overrides: str):
    """The job the entry point would build for these overrides (its run directory: the working directory)."""
    from tbexp.job import Job

    return Job(compose_config(*overrides))


def collect_oracle(path: Path, *overrides: str) -> dict[str, float]:
    """The oracle's verified conversations on the SFT tasks of the config these overrides compose, into `path`."""
    from tbexp.stages.collect import collect

    job = compose_job(*overrides)
    return collect(job, job.tasks("sft"), "oracle", path).metrics


@pytest.fixture(scope="session")
def rootfs() -> Path:
    """The sandbox root; built by scripts/setup.sh, which the test command runs first."""
    cfg = compose_config()
    path = Path(cfg.sandbox.rootfs)
    if not (path / ".tbexp-complete").exists():
        result = subprocess.run([str(REPO / "scripts/build_rootfs.sh"), str(path)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.fail(f"no sandbox root file system and scripts/build_rootfs.sh failed:\n{result.stderr[-2000:]}")
    if shutil.which("bwrap") is None:
        pytest.fail("bwrap is not installed: run scripts/setup.sh (apt-get install bubblewrap)")
    return path


@pytest.fixture
def sandbox_settings(rootfs):
    """The bwrap sandbox node with short time limits for tests."""
    cfg = compose_config(
        "sandbox.command_timeout_s=5", "sandbox.disk_mb=64", "sandbox.memory_mb=256", "sandbox.pids_limit=64"
    )
    return cfg.sandbox


def make_task(
    root: Path,
    name: str = "demo",
    files: dict[str, str] | None = None,
    tests: str | None = None,
    solution: str | None = "echo done > /app/out.txt\n",
) -> Path:
    """A small Harbor task directory: by default, write `done` to /app/out.txt."""
    task = root / name
    (task / "environment" / "app").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "task.toml").write_text(
        f'schema_version = "1.0"\n[task]\nname = "test/{name}"\n[metadata]\nfamily = "demo"\n[verifier]\ntimeout_sec = 30.0\n[agent]\ntimeout_sec = 60.0\n[environment]\nworkdir = "/app"\n'
    )
    (task / "instruction.md").write_text("Write the word done into /app/out.txt.\n")
    (task / "environment" / "Dockerfile").write_text("FROM tbexp-base:bookworm\nWORKDIR /app\nCOPY app/ /app/\n")
    for rel, content in (files or {"input.txt": "hello\n"}).items():
        (task / "environment" / "app" / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / "environment" / "app" / rel).write_text(content)
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\ncd /app\n"
        "python3 -m pytest -q -p no:cacheprovider --junitxml=/logs/verifier/junit.xml /tests/test_outputs.py\n"
        "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
    )
    default_tests = """
        from pathlib import Path
        def test_exists():
            assert Path("/app/out.txt").exists()
        def test_content():
            assert Path("/app/out.txt").read_text().strip() == "done"
        def test_input_untouched():
            assert Path("/app/input.txt").read_text() == "hello\\n"
    """
    (task / "tests" / "test_outputs.py").write_text(textwrap.dedent(tests or default_tests))
    if solution is not None:
        (task / "solution").mkdir()
        (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solution)
    return task


@pytest.fixture
def demo_task(tmp_path):
    from tbexp.tasks import load_task

    return load_task(make_task(tmp_path))


def leftover_state() -> dict[str, int]:
    """What sandboxes could leave behind on the host: bwrap processes, work dirs, cgroups."""
    from tbexp.sandboxes.bwrap import WORK_PARENT
    from tbexp.sandboxes.cgroup import leftover_cgroups

    mine = str(os.getpid())
    procs = subprocess.run(["pgrep", "-P", mine], capture_output=True, text=True).stdout.split()  # our children
    works = [p for p in WORK_PARENT.iterdir() if p.name.startswith(mine + "-")] if WORK_PARENT.is_dir() else []
    groups = [g for g in leftover_cgroups() if g.dirs[0].name.startswith(mine + "-")]
    return {"child_processes": len(procs), "work_dirs": len(works), "cgroups": len(groups)}
