"""What task.toml asks of an episode, honoured by tbexp's own episodes in both sandboxes.

A separate verifier environment (tests/Dockerfile) gets only the artifacts Harbor hands over; `[agent] user` and
`[verifier] user` run the agent's commands and test.sh; the task's memory and storage limits are enforced;
a task asking for an allowlist runs offline and says so; every step of a multi-step episode is training data,
and a step's passing verifier fault gets the second look.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tbexp.agents.base import make_agent
from tbexp.episodes.advantages import grpo_datums
from tbexp.episodes.policies import SampledTokens, SampledTurn, make_policy
from tbexp.episodes.rollout import run_episode
from tbexp.episodes.scoring import summarize
from tbexp.sandboxes.base import make_sandbox
from tbexp.tasks import load_task
from tests.conftest import compose_config, make_task

SANDBOXES = ["bwrap", pytest.param("docker", marks=pytest.mark.docker)]


@pytest.fixture(params=SANDBOXES)
def settings(request, rootfs):
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    return compose_config(
        f"sandbox={request.param}",
        "sandbox.command_timeout_s=20",
        "sandbox.disk_mb=64",
        "sandbox.memory_mb=256",
        "sandbox.pids_limit=64",
    )


def _episode(task_dir: Path, settings, policy: str = "oracle"):
    agent = make_agent(settings.agent)
    return run_episode(load_task(task_dir), 0, agent, lambda t, a: make_policy(policy, t, a), settings.sandbox, 6)


def _toml(task_dir: Path, before: str = "", **sections: str) -> None:
    """task.toml with `before` at the top and extra lines appended to the named sections."""
    text = (task_dir / "task.toml").read_text()
    for section, lines in sections.items():
        text = text.replace(f"[{section}]\n", f"[{section}]\n{lines}\n", 1)
    (task_dir / "task.toml").write_text(before + "\n" + text)


SEPARATE_TESTS = """
    import os
    from pathlib import Path
    def test_in_the_verifier_environment():
        assert os.environ.get("SIDE") == "verifier" and not Path("/app/input.txt").exists()
        assert not Path("/app/scratch.txt").exists()
    def test_artifact():
        assert Path("/app/out.txt").read_text().strip() == "done"
    def test_convention_dir():
        assert Path("/logs/artifacts/note.txt").read_text().strip() == "hi"
"""


def test_a_separate_verifier_sees_only_the_artifacts_in_its_own_environment(settings, tmp_path):
    task_dir = make_task(
        tmp_path,
        tests=SEPARATE_TESTS,
        solution="echo scratch > /app/scratch.txt\necho done > /app/out.txt\necho hi > /logs/artifacts/note.txt\n",
    )
    _toml(task_dir, 'artifacts = ["/app/out.txt"]', verifier='environment_mode = "separate"')
    (task_dir / "tests" / "Dockerfile").write_text(
        "FROM tbexp-base:bookworm\nENV SIDE=verifier\nWORKDIR /app\nCOPY . /tests/\n"
    )
    task = load_task(task_dir)
    assert task.separate_verifier.bundled_tests and task.artifacts == ("/app/out.txt",)
    solved, idle = _episode(task_dir, settings), _episode(task_dir, settings, "nop")
    assert not solved.invalid and solved.report.n_total == 3 and solved.report.strict, solved.invalid
    assert not idle.invalid and (idle.report.n_passed, idle.report.n_total) == (1, 3)


def test_a_separate_verifier_without_its_own_dockerfile_is_a_fresh_copy_of_the_environment(settings, tmp_path):
    tests = """
        from pathlib import Path
        def test_fresh_copy():
            assert Path("/app/input.txt").read_text() == "hello\\n" and not Path("/app/scratch.txt").exists()
        def test_artifact():
            assert Path("/app/out.txt").read_text().strip() == "done"
    """
    task_dir = make_task(tmp_path, tests=tests, solution="echo x > /app/scratch.txt\necho done > /app/out.txt\n")
    _toml(task_dir, 'artifacts = ["/app/out.txt"]', verifier='environment_mode = "separate"')
    episode = _episode(task_dir, settings)
    assert not load_task(task_dir).separate_verifier.bundled_tests  # the tests are uploaded, as in shared mode
    assert not episode.invalid and episode.report.strict and episode.report.n_total == 2, episode.invalid


def test_a_directory_artifacts_exclude_patterns_leave_out_what_they_match(settings, tmp_path):
    tests = """
        from pathlib import Path
        def test_kept():
            assert Path("/app/out/keep.txt").read_text().strip() == "kept"
            assert Path("/app/out/sub/deep.txt").read_text().strip() == "deep"
        def test_left_out():
            assert not Path("/app/out/scratch.tmp").exists() and not Path("/app/out/sub/other.tmp").exists()
            assert not Path("/app/out/cache").exists()
    """
    solution = (
        "mkdir -p /app/out/sub /app/out/cache && echo kept > /app/out/keep.txt && echo deep > /app/out/sub/deep.txt\n"
        "echo x > /app/out/scratch.tmp && echo x > /app/out/sub/other.tmp && echo x > /app/out/cache/blob\n"
    )
    task_dir = make_task(tmp_path, tests=tests, solution=solution)
    artifact = 'artifacts = [{ source = "/app/out", exclude = ["*.tmp", "cache"] }]'
    _toml(task_dir, artifact, verifier='environment_mode = "separate"')
    assert load_task(task_dir).artifact_excludes == (("/app/out", ("*.tmp", "cache")),)
    episode = _episode(task_dir, settings)
    assert not episode.invalid and episode.report.strict and episode.report.n_total == 2, episode.report.log_tail


def test_the_agent_and_the_verifier_run_as_their_task_users(settings, tmp_path):
    tests = """
        import os, pwd
        from pathlib import Path
        def test_users():
            assert Path("/tmp/agent-user.txt").read_text().strip() == "nobody"
            assert pwd.getpwuid(os.getuid()).pw_name == "daemon"
    """
    task_dir = make_task(tmp_path, tests=tests, solution="id -un > /tmp/agent-user.txt\n")
    _toml(task_dir, agent='user = "nobody"', verifier='user = "daemon"')
    episode = _episode(task_dir, settings)
    assert not episode.invalid and episode.report.strict, episode.invalid or episode.report.log_tail


def test_a_task_user_the_image_lacks_makes_the_episode_invalid(settings, tmp_path):
    task_dir = make_task(tmp_path)
    _toml(task_dir, agent='user = "no-such-user"')
    episode = _episode(task_dir, settings)
    assert episode.report is None and "no-such-user" in episode.invalid


ALLOCATE_150_MB = "python3 -c \"b = bytearray(150 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('allocated')\""


def test_the_tasks_memory_and_storage_limits_are_enforced(settings, tmp_path):
    # The node allows 256 MB and 64 MB of disk; the task asks for 64 MB of memory and 16 MB of storage.
    roomy = load_task(make_task(tmp_path, "roomy"))
    tight_dir = make_task(tmp_path, "tight")
    _toml(tight_dir, environment="memory_mb = 64\nstorage_mb = 16")
    tight = load_task(tight_dir)
    assert (tight.memory_mb, tight.storage_mb) == (64, 16)
    results = {}
    for task in (roomy, tight):
        sandbox = make_sandbox(settings.sandbox, task)
        try:
            sandbox.start()
            memory = sandbox.exec(ALLOCATE_150_MB)
            disk = sandbox.exec("head -c 40M /dev/zero > /app/big && echo written")
        finally:
            sandbox.stop()
        results[task.name] = (memory.exit_code == 0 and "allocated" in memory.output, "written" in disk.output)
    assert results == {"test/roomy": (True, True), "test/tight": (False, False)}


def test_an_allowlist_task_runs_offline_and_the_episode_says_so(settings, tmp_path):
    task_dir = make_task(tmp_path)
    _toml(task_dir, environment='network_mode = "allowlist"\nallowed_hosts = ["pypi.org"]')
    episode = _episode(task_dir, settings)
    assert not episode.invalid and episode.report.strict
    assert "allowlist" in episode.network and "pypi.org" in episode.network and "no network" in episode.network
    offline = make_task(tmp_path, "offline")
    _toml(offline, environment='network_mode = "no-network"')
    plain = _episode(offline, settings)
    assert plain.network == ""
    both = [episode, plain]
    assert summarize(both, {id(ep): 1.0 for ep in both})["eval/offline_episodes"] == 1.0


# ---------------------------------------------------------------- multi-step episodes


def _two_steps(root: Path, first_test_sh: str | None = None) -> Path:
    test = "from pathlib import Path\ndef test_file():\n    assert Path('/app/log.txt').read_text().split() == {!r}\n"
    test_sh = (
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        "python3 -m pytest -q -p no:cacheprovider --junitxml=/logs/verifier/junit.xml /tests/test_step.py\n"
        "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
    )
    files = {
        "task.toml": '[task]\nname = "acme/two"\n[environment]\nnetwork_mode = "no-network"\n'
        '[[steps]]\nname = "first"\n[[steps]]\nname = "second"\n',
        "environment/Dockerfile": "FROM tbexp-base:bookworm\nWORKDIR /app\n",
        "steps/first/instruction.md": "Write alpha into /app/log.txt.\n",
        "steps/first/solution/solve.sh": "echo alpha > /app/log.txt\n",
        "steps/first/tests/test.sh": first_test_sh or test_sh,
        "steps/first/tests/test_step.py": test.format(["alpha"]),
        "steps/second/instruction.md": "Append beta to /app/log.txt.\n",
        "steps/second/solution/solve.sh": "echo beta >> /app/log.txt\n",
        "steps/second/tests/test.sh": test_sh,
        "steps/second/tests/test_step.py": test.format(["alpha", "beta"]),
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


class SampledOracle:
    """The oracle, with made-up sampled tokens: what a model policy carries, one sequence per conversation."""

    def __init__(self, task, agent):
        self.inner = make_policy("oracle", task, agent)
        self.uploads = self.inner.uploads
        self.sampled = SampledTokens()

    def act(self, messages):
        reply = self.inner.act(messages)
        offset = len(self.sampled.tokens) + 1
        self.sampled.tokens += [1, 2]
        self.sampled.turns.append(SampledTurn(offset, [2], [-0.5]))
        return reply


def test_every_step_of_a_multi_step_episode_is_training_data(rootfs, tmp_path):
    settings = compose_config("sandbox.command_timeout_s=20")
    agent, task = make_agent(settings.agent), load_task(_two_steps(tmp_path / "two"))
    solved = run_episode(task, 0, agent, SampledOracle, settings.sandbox, 6)
    idle = run_episode(task, 1, agent, lambda t, a: make_policy("nop", t, a), settings.sandbox, 6)
    assert not solved.invalid and solved.report.strict and len(solved.step_sampled) == 2
    assert solved.sequences == solved.step_sampled and solved.sampled is solved.step_sampled[-1]
    idle.step_sampled = [SampledTokens([1, 2], [SampledTurn(1, [2], [-0.5])])]  # as a model that gave up would
    datums, counts = grpo_datums(
        [solved, idle], {id(solved): 1.0, id(idle): 0.0}, scale_by_std=False, reference=None, kl_coef=0.0
    )
    n_solved = sum(seq.n_sampled for seq in solved.step_sampled)
    assert counts["datums"] == 3 and counts["sampled_tokens"] == n_solved + 1  # both of its steps, and idle's one


def test_a_multi_step_verifier_fault_that_passes_gets_the_second_look(rootfs, tmp_path):
    # Step one's test.sh writes nothing the first time it runs (a passing fault), then verifies.
    flaky = (
        "#!/bin/bash\nif [ ! -e /tmp/ran-once ]; then touch /tmp/ran-once; exit 0; fi\nmkdir -p /logs/verifier\n"
        "python3 -m pytest -q -p no:cacheprovider --junitxml=/logs/verifier/junit.xml /tests/test_step.py\n"
        "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
    )
    settings = compose_config("sandbox.command_timeout_s=20")
    agent, task = make_agent(settings.agent), load_task(_two_steps(tmp_path / "two", flaky))
    episode = run_episode(task, 0, agent, lambda t, a: make_policy("oracle", t, a), settings.sandbox, 6)
    assert not episode.invalid and episode.report.strict and set(episode.step_reports) == {"first", "second"}
