"""Harbor's own trial runner on tbexp's sandboxes (tbexp.sandboxes.harbor_env).

.venv/bin/python -m pytest tests/test_harbor_interop.py -v

Harbor's `Trial` runs built-in held-out tasks (one per family) in bubblewrap
through `BwrapEnvironment`, with Harbor's `oracle` agent and Harbor's own
verifier: every reward must be 1 and valid; with Harbor's `nop` agent, 0 and
valid. The environment is also driven directly, to pin down how Harbor's
`exec(cwd, env, timeout_sec, user)` maps onto one sandbox exec, and what it
refuses (other users, tasks that want a network). The Docker variant runs when
`tbexp/sandboxes/docker.py` and the Docker engine fixture are there.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from harbor.models.task.config import NetworkMode, NetworkPolicy  # noqa: E402
from harbor.models.task.task import Task as HarborTask  # noqa: E402
from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig  # noqa: E402
from harbor.models.trial.paths import TrialPaths  # noqa: E402
from harbor.trial.trial import Trial  # noqa: E402

from tbexp.sandboxes.harbor_env import BwrapEnvironment  # noqa: E402
from tbexp.tasks.builtin import write_suite  # noqa: E402
from tests.conftest import REPO, leftover_state  # noqa: E402

pytestmark = [pytest.mark.sandbox, pytest.mark.filterwarnings("ignore:Task.checksum:DeprecationWarning")]
BWRAP = "tbexp.sandboxes.harbor_env:BwrapEnvironment"


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> list[Path]:
    """One held-out task per family (the smallest suite that has them all)."""
    root = write_suite(tmp_path_factory.mktemp("builtin") / "suite", train_per_family=4, heldout_per_family=1)
    return sorted((root / "heldout").iterdir())


def run_trials(
    task_dirs: list[Path],
    agent: str,
    trials_dir: Path,
    import_path: str = BWRAP,
    sandbox: dict | None = None,
    concurrency: int = 4,
):
    async def one(task_dir: Path, gate: asyncio.Semaphore):
        config = TrialConfig(
            task=TaskConfig(path=task_dir),
            agent=AgentConfig(name=agent),
            environment=EnvironmentConfig(import_path=import_path, kwargs={"sandbox": sandbox or {}}),
            trials_dir=trials_dir,
        )
        async with gate:
            trial = await Trial.create(config)
            return await trial.run()

    async def all_of_them():
        gate = asyncio.Semaphore(concurrency)
        return await asyncio.gather(*(one(d, gate) for d in task_dirs))

    return asyncio.run(all_of_them())


def _explain(result) -> str:
    info = result.exception_info
    return f"{result.task_name}: rewards={result.verifier_result and result.verifier_result.rewards} exception={info and info.exception_message}"


def test_oracle_trials_pass_in_bwrap(rootfs, heldout, tmp_path):
    results = run_trials(heldout, "oracle", tmp_path, sandbox={"rootfs": str(rootfs)})
    assert len(results) == len(heldout) >= 10
    for result in results:
        assert result.exception_info is None, _explain(result)
        assert result.reward_valid, _explain(result)
        assert result.verifier_result.rewards == {"reward": 1.0}, _explain(result)
    junit = list(tmp_path.glob("*/verifier/junit.xml"))
    assert len(junit) == len(heldout)  # Harbor downloaded /logs/verifier from every sandbox
    assert len(list(tmp_path.glob("*/agent/oracle.txt"))) == len(heldout)  # and the oracle's log from /logs/agent
    left = leftover_state()
    assert left["work_dirs"] == left["cgroups"] == 0, left  # Harbor stopped every sandbox


def test_nop_trials_score_zero(rootfs, heldout, tmp_path):
    results = run_trials(heldout[:3], "nop", tmp_path, sandbox={"rootfs": str(rootfs)})
    for result in results:
        assert result.reward_valid, _explain(result)
        assert result.verifier_result.rewards == {"reward": 0.0}, _explain(result)


def test_a_public_network_task_runs_offline_as_in_tbexp(rootfs, heldout, tmp_path):
    task = tmp_path / "public-task"
    shutil.copytree(heldout[0], task)
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace('network_mode = "no-network"', 'network_mode = "public"'))
    (result,) = run_trials([task], "oracle", tmp_path / "trials", sandbox={"rootfs": str(rootfs)})
    assert result.verifier_result.rewards["reward"] == 1.0
    env = _environment(task, tmp_path / "trial", rootfs, network=NetworkMode.PUBLIC)

    async def interfaces() -> str:
        await env.start(force_build=False)
        try:
            return (await env.exec("cat /proc/net/dev")).stdout
        finally:
            await env.stop(delete=True)

    listed = asyncio.run(interfaces())
    assert "lo:" in listed and not [line for line in listed.splitlines()[2:] if "lo:" not in line], listed


def _environment(
    task_dir: Path, trial_dir: Path, rootfs: Path, network=NetworkMode.NO_NETWORK, **sandbox
) -> BwrapEnvironment:
    task = HarborTask(task_dir)
    return BwrapEnvironment(
        environment_dir=task.paths.environment_dir,
        environment_name=task.name,
        session_id="interop-test",
        trial_paths=TrialPaths(trial_dir),
        task_env_config=task.config.environment,
        network_policy=NetworkPolicy(network_mode=network),
        sandbox={"rootfs": str(rootfs), **sandbox},
    )


def test_exec_maps_cwd_env_timeout_and_files(rootfs, heldout, tmp_path):
    env = _environment(heldout[0], tmp_path / "trial", rootfs, command_timeout_s=5)

    async def scenario():
        await env.start(force_build=False)
        try:
            here = await env.exec("pwd")
            moved = await env.exec("pwd; echo $GREETING; exit 3", cwd="/tmp", env={"GREETING": "hi there"})
            slow = await env.exec("sleep 5", timeout_sec=1)
            logs = await env.exec("test -d /logs/agent && test -d /logs/verifier && test -d /logs/artifacts")
            (tmp_path / "up").mkdir()
            (tmp_path / "up" / "a.txt").write_text("payload\n")
            await env.upload_dir(tmp_path / "up", "/tests")
            await env.exec("cp /tests/a.txt /logs/verifier/b.txt")
            await env.download_dir("/logs/verifier", tmp_path / "down")
            nobody = await env.exec("id -un", user="nobody")  # Harbor's [agent] / [verifier] user
            return here, moved, slow, logs, nobody
        finally:
            await env.stop(delete=True)

    here, moved, slow, logs, nobody = asyncio.run(scenario())
    assert here.stdout.strip() == "/app" and here.return_code == 0
    assert nobody.stdout.strip() == "nobody" and nobody.return_code == 0
    assert moved.stdout.split("\n")[:2] == ["/tmp", "hi there"] and moved.return_code == 3
    assert slow.return_code == 124
    assert logs.return_code == 0
    assert (tmp_path / "down" / "b.txt").read_text() == "payload\n"
    assert env.sandbox.settings.memory_mb == 512  # the task's memory_mb reached the sandbox


def _start_docker(request) -> None:
    """The Docker engine fixture when the Docker tests provide one, else the two set-up scripts directly."""
    try:
        request.getfixturevalue("docker_engine")
        return
    except pytest.FixtureLookupError:
        pass
    for script in ("start_dockerd.sh", "build_base_image.sh"):
        done = subprocess.run(["bash", str(REPO / "scripts" / script)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"no Docker engine: scripts/{script} failed: {done.stderr.strip()[-500:]}")


@pytest.mark.docker
def test_oracle_and_nop_trials_in_docker(request, heldout, tmp_path):
    pytest.importorskip("tbexp.sandboxes.docker", reason="tbexp/sandboxes/docker.py is not there")
    _start_docker(request)
    docker = "tbexp.sandboxes.harbor_env:DockerEnvironment"
    for result in run_trials(heldout[:3], "oracle", tmp_path / "oracle", import_path=docker, concurrency=2):
        assert result.reward_valid and result.verifier_result.rewards == {"reward": 1.0}, _explain(result)
    for result in run_trials(heldout[:1], "nop", tmp_path / "nop", import_path=docker):
        assert result.reward_valid and result.verifier_result.rewards == {"reward": 0.0}, _explain(result)
