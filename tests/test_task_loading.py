"""Loading tasks through Harbor's own task model: every schema Harbor reads, Terminal-Bench 1 directories
through Harbor's mapper, unloadable tasks listed (or fatal with tasks.strict), family from metadata or name,
and multi-step tasks run step by step in one sandbox. Every task here is written by the test itself."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from tbexp.tasks import TaskError, TaskSet, load_task, load_task_set, load_tasks
from tests.conftest import compose_config, compose_job, make_task

STEP_TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
python3 -m pytest -q -p no:cacheprovider --junitxml=/logs/verifier/junit.xml /tests/test_step.py
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
SHARED_TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
python3 -m pytest -q -p no:cacheprovider --junitxml=/logs/verifier/junit.xml /tests/test_step.py
echo '{"reward": 0.5, "style": 1}' > /logs/verifier/reward.json
"""


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text).lstrip())
    return root


def _harbor_task(root: Path, toml: str, **extra: str) -> Path:
    files = {
        "task.toml": toml,
        "instruction.md": "Do it.\n",
        "environment/Dockerfile": "FROM tbexp-base:bookworm\n",
        "tests/test.sh": "exit 0\n",
    }
    return _write(root, {**files, **extra})


def _digest(directory: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(directory.rglob("*")):
        h.update(str(p.relative_to(directory)).encode() + (p.read_bytes() if p.is_file() else b"/"))
    return h.hexdigest()


def test_a_plain_harbor_task_loads_with_harbor_defaults(tmp_path):
    task = load_task(
        _harbor_task(tmp_path / "plain", '[task]\nname = "acme/plain-task"\n[verifier]\ntimeout_sec = 42\n')
    )
    assert task.name == "acme/plain-task" and task.instruction == "Do it.\n" and task.workdir == "/app"
    assert task.verifier_timeout_s == 42.0 and task.agent_timeout_s == 600.0  # Harbor: no agent limit; tbexp: 600 s
    assert task.network_mode == "public" and task.docker_image == "" and task.build_timeout_s == 600.0
    assert (task.cpus, task.memory_mb, task.storage_mb) == (None, None, None)
    assert type(task.harbor).__name__ == "TaskConfig" and task.harbor.verifier.timeout_sec == 42.0
    assert task.config == {"task": {"name": "acme/plain-task"}, "verifier": {"timeout_sec": 42}}
    assert [(s.name, s.instruction) for s in task.steps] == [("main", "Do it.\n")]
    assert (
        task.tests_dir == task.path / "tests" and task.solution_script is None and task.verifier_environment_dir is None
    )


def test_a_prebuilt_docker_image_needs_no_environment_dir(tmp_path):
    root = _harbor_task(
        tmp_path / "image", '[environment]\ndocker_image = "tbexp-base:bookworm"\nworkdir = "/srv"\ncpus = 2\n'
    )
    (root / "environment" / "Dockerfile").unlink()
    (root / "environment").rmdir()
    task = load_task(root)
    assert task.docker_image == "tbexp-base:bookworm" and task.workdir == "/srv" and task.cpus == 2.0
    root2 = _harbor_task(tmp_path / "neither", "")
    (root2 / "environment" / "Dockerfile").unlink()
    (root2 / "environment").rmdir()
    with pytest.raises(
        TaskError, match=r"neither/environment: missing \(and task.toml names no \[environment\].docker_image\)"
    ):
        load_task(root2)


def test_legacy_memory_and_allow_internet_are_migrated_as_harbor_does(tmp_path):
    toml = '[environment]\nmemory = "2G"\nstorage = "512M"\nallow_internet = false\nbuild_timeout_sec = 90\n'
    task = load_task(_harbor_task(tmp_path / "legacy", toml))
    assert (task.memory_mb, task.storage_mb, task.network_mode, task.build_timeout_s) == (2048, 512, "no-network", 90.0)
    current = load_task(
        _harbor_task(
            tmp_path / "current",
            '[environment]\nmemory_mb = 700\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org"]\n',
        )
    )
    assert (current.memory_mb, current.network_mode) == (700, "allowlist")


def test_a_separate_verifier_environment_and_verifier_settings_load(tmp_path):
    toml = '[verifier]\nenvironment_mode = "separate"\nuser = "tester"\nenv = { MODE = "strict", TOKEN = "${HOME}" }\n'
    task = load_task(_harbor_task(tmp_path / "separate", toml, **{"tests/Dockerfile": "FROM tbexp-base:bookworm\n"}))
    assert task.verifier_environment_dir == task.path / "tests"
    assert task.verifier_env == {"MODE": "strict", "TOKEN": "${HOME}"} and task.harbor.verifier.user == "tester"
    shared = load_task(
        _harbor_task(tmp_path / "shared", "[verifier]\nenv = { A = '1' }\n", **{"tests/Dockerfile": "FROM x\n"})
    )
    assert shared.verifier_environment_dir is None  # a Dockerfile in tests/ alone does not make the verifier separate


def _multistep(root: Path, strategy: str = "", min_reward: str = "") -> Path:
    """Two steps: write a file, then extend it; each step has its own tests, step one its own solution."""
    test = (
        "from pathlib import Path\ndef test_file():\n    assert Path('/app/log.txt').read_text().split() == {words!r}\n"
    )
    return _write(
        root,
        {
            "task.toml": f"""
            {strategy}
            [task]
            name = "acme/two-steps"
            [metadata]
            category = "editing"
            [agent]
            timeout_sec = 120
            [environment]
            network_mode = "no-network"
            [[steps]]
            name = "first"
            {min_reward}
            [[steps]]
            name = "second"
            [steps.agent]
            timeout_sec = 30
            [steps.verifier]
            timeout_sec = 20
        """,
            "environment/Dockerfile": "FROM tbexp-base:bookworm\nWORKDIR /app\n",
            "steps/first/instruction.md": "Write alpha into /app/log.txt.\n",
            "steps/first/solution/solve.sh": "echo alpha > /app/log.txt\n",
            "steps/first/tests/test.sh": STEP_TEST_SH,
            "steps/first/tests/test_step.py": test.format(words=["alpha"]),
            "steps/first/tests/first-only.txt": "step one's tests are cleared before step two\n",
            "steps/second/instruction.md": "<!-- canary GUID 1234 -->\nAppend beta to /app/log.txt.\n",
            "steps/second/workdir/setup.sh": "echo set-up > /app/setup-ran.txt\n",
            "steps/second/tests/test_step.py": test.format(words=["alpha", "beta"])
            + "def test_setup():\n    assert Path('/app/setup-ran.txt').exists()\n"
            "def test_step_one_tests_are_gone():\n    assert not Path('/tests/first-only.txt').exists()\n",
            "tests/test.sh": SHARED_TEST_SH,
            "solution/solve.sh": "echo beta >> /app/log.txt\n",
        },
    )


def test_a_multi_step_task_loads_its_steps_in_order(tmp_path):
    task = load_task(_multistep(tmp_path / "two"))
    first, second = task.steps
    assert (first.name, second.name) == ("first", "second") and task.family == "editing"
    assert task.instruction == first.instruction == "Write alpha into /app/log.txt.\n"
    assert second.instruction == "Append beta to /app/log.txt.\n"  # Harbor strips the canary line
    assert (
        first.tests_dirs == (task.path / "tests", task.path / "steps/first/tests")
        and second.tests_dirs[-1].name == "tests"
    )
    assert first.solution_script == task.path / "steps/first/solution/solve.sh"
    assert second.solution_script == task.path / "solution/solve.sh"  # no step solution: the task's, as Harbor's oracle
    assert (first.agent_timeout_s, second.agent_timeout_s, second.verifier_timeout_s) == (120.0, 30.0, 20.0)
    assert second.setup_script == task.path / "steps/second/workdir/setup.sh" and first.setup_script is None
    view = task.for_step(second)
    assert view.tests_dir == task.path / "steps/second/tests" and view.solution_script == second.solution_script
    assert view.agent_timeout_s == 30.0 and view.steps == [second]


@pytest.mark.parametrize(
    "strategy, reward, style", [("", 0.75, 0.5), ('multi_step_reward_strategy = "final"', 0.5, 1.0)]
)
def test_a_multi_step_task_runs_every_step_in_one_sandbox(rootfs, tmp_path, strategy, reward, style):
    from tbexp.agents.base import make_agent
    from tbexp.episodes.policies import make_policy
    from tbexp.episodes.rollout import run_episode

    settings = compose_config("sandbox.command_timeout_s=10")
    task = load_task(_multistep(tmp_path / "two", strategy))
    seen = []

    def oracle(step_task, agent):
        seen.append(step_task.instruction)
        return make_policy("oracle", step_task, agent)

    episode = run_episode(task, 0, make_agent(settings.agent), oracle, settings.sandbox, 5)
    assert not episode.invalid, episode.invalid
    assert seen == [s.instruction for s in task.steps]  # a fresh policy per step, on that step's instruction
    first, second = episode.step_reports["first"], episode.step_reports["second"]
    assert first.tests == {"test_step::test_file": "passed"} and first.rewards == {"reward": 1.0}
    # step two's tests see step one's file (one sandbox), its own test_step.py replaced step one's, its setup ran
    assert second.tests == {
        f"test_step::test_{name}": "passed" for name in ("file", "setup", "step_one_tests_are_gone")
    }
    assert second.rewards == {"reward": 0.5, "style": 1.0}
    # Harbor's trial reward: per-key means over the steps, a key a step lacks counting 0; "final" takes the last step
    assert episode.report.rewards == {"reward": pytest.approx(reward), "style": style}
    assert (
        len(episode.report.tests) == (3 if strategy else 4) and "second::test_step::test_setup" in episode.report.tests
    )
    assert [m["role"] for m in episode.messages].count("user") >= 2
    # every test passed, but the reward file says 0.75 (or 0.5): the reward file decides (#40), so not strict
    assert episode.report.n_passed == episode.report.n_total and not episode.report.strict


def test_min_reward_stops_the_remaining_steps(rootfs, tmp_path):
    from tbexp.agents.base import make_agent
    from tbexp.episodes.policies import make_policy
    from tbexp.episodes.rollout import run_episode

    settings = compose_config("sandbox.command_timeout_s=10")
    task = load_task(_multistep(tmp_path / "gated", min_reward="min_reward = { style = 1.0 }"))  # step one has no style
    episode = run_episode(
        task, 0, make_agent(settings.agent), lambda t, a: make_policy("oracle", t, a), settings.sandbox, 5
    )
    assert not episode.invalid and list(episode.step_reports) == ["first"]


TB1_TASK = {
    "task.yaml": """
        instruction: |-
          Create /app/hello.txt containing the word hello.
        author_name: tbexp
        difficulty: easy
        category: file-operations
        tags: [files]
        max_agent_timeout_sec: 120
        max_test_timeout_sec: 30
    """,
    "docker-compose.yaml": """
        services:
          client:
            build:
              dockerfile: Dockerfile
            image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
            container_name: ${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}
            command: [ "sh", "-c", "sleep infinity" ]
            environment:
              - TEST_DIR=${T_BENCH_TEST_DIR}
            volumes:
              - ${T_BENCH_TASK_LOGS_PATH}:${T_BENCH_CONTAINER_LOGS_PATH}
              - ${T_BENCH_TASK_AGENT_LOGS_PATH}:${T_BENCH_CONTAINER_AGENT_LOGS_PATH}
    """,
    "Dockerfile": "FROM tbexp-base:bookworm\nWORKDIR /app\n",
    "run-tests.sh": "#!/bin/bash\nmkdir -p /logs/verifier\npython3 -m pytest -q --junitxml=/logs/verifier/junit.xml $TEST_DIR/test_outputs.py -rA\n",
    "solution.sh": "#!/bin/bash\necho hello > /app/hello.txt\n",
    "tests/test_outputs.py": "from pathlib import Path\ndef test_hello():\n    assert Path('/app/hello.txt').read_text().strip() == 'hello'\n",
}


def test_a_terminal_bench_1_directory_is_converted_once_by_harbors_mapper(tmp_path, monkeypatch):
    from harbor.mappers.terminal_bench import TerminalBenchMapper

    conversions = []
    original = TerminalBenchMapper._map_task
    monkeypatch.setattr(
        TerminalBenchMapper, "_map_task", lambda self, src, dst: conversions.append(src) or original(self, src, dst)
    )
    source = _write(tmp_path / "tb1" / "hello-file", TB1_TASK)
    before = _digest(source)
    migrated = tmp_path / "cache" / "migrated"
    task = load_task(source, migrated)
    assert _digest(source) == before  # never edited in place
    assert task.path.parent.parent == migrated and task.path.name == "hello-file"
    assert task.instruction == "Create /app/hello.txt containing the word hello.\n"
    assert (task.agent_timeout_s, task.verifier_timeout_s, task.family) == (120.0, 30.0, "file-operations")
    test_sh = (task.tests_dir / "test.sh").read_text()
    assert "/tests/test_outputs.py" in test_sh and "reward.txt" in test_sh  # Harbor's mapper: $TEST_DIR and the reward
    assert "ENV TEST_DIR=/tests" in (task.environment_dir / "Dockerfile").read_text()
    assert task.solution_script.read_text() == TB1_TASK["solution.sh"]
    stamp = (task.path / "task.toml").stat().st_mtime_ns
    again = load_task(source, migrated)
    assert again.path == task.path and (again.path / "task.toml").stat().st_mtime_ns == stamp  # reused, not redone
    assert len(conversions) == 1
    (source / "solution.sh").write_text("#!/bin/bash\necho hello > /app/hello.txt  # edited\n")
    edited = load_task(source, migrated)
    assert edited.path != task.path and len(list(migrated.iterdir())) == 2  # changed content: a new conversion
    assert load_tasks(tmp_path / "tb1", migrated)[0].path == edited.path  # also as a member of a set
    assert len(conversions) == 2


def test_a_terminal_bench_1_directory_the_mapper_refuses_is_an_unloadable_task(tmp_path):
    source = _write(tmp_path / "tb1" / "no-instruction", {**TB1_TASK, "task.yaml": "author_name: tbexp\n"})
    with pytest.raises(TaskError, match=r"no-instruction/task.yaml: Harbor's Terminal-Bench mapper refused it"):
        load_task(source, tmp_path / "migrated")
    make_task(tmp_path / "tb1", "good")
    loaded = load_tasks(tmp_path / "tb1", tmp_path / "migrated")
    assert [t.name for t in loaded] == ["test/good"] and "mapper refused it" in loaded.unloadable[str(source)]


def test_an_unloadable_task_is_listed_and_the_rest_of_the_set_loads(tmp_path):
    tasks = tmp_path / "set"
    make_task(tasks, "good")
    broken = make_task(tasks, "no-tests")
    (broken / "tests" / "test.sh").unlink()
    bad_toml = make_task(tasks, "bad-toml")
    (bad_toml / "task.toml").write_text("[environment]\ncpus = 'many'\n")
    (tasks / "notes").mkdir()
    loaded = load_tasks(tasks)
    assert isinstance(loaded, TaskSet) and [t.name for t in loaded] == ["test/good"]
    assert (
        loaded.unloadable[str(broken)] == f"{broken}/tests/test.sh: missing (a task without tests cannot be verified)"
    )
    assert loaded.unloadable[str(bad_toml)].startswith(f"{bad_toml}/task.toml: environment.cpus")
    assert "task.toml: missing" in loaded.unloadable[str(tasks / "notes")]

    settings = compose_config("tasks=dir", f"tasks.path={tasks}").tasks
    assert load_task_set(settings).unloadable == loaded.unloadable
    settings.strict = True
    with pytest.raises(
        TaskError, match=r"(?s)tasks.strict=true and 3 task\(s\) cannot be loaded:.*no-tests/tests/test.sh: missing"
    ):
        load_task_set(settings)
    (tasks / "good" / "tests" / "test.sh").unlink()
    with pytest.raises(
        TaskError, match=r"(?s)none of its 4 task directories can be loaded:.*good/tests/test.sh: missing"
    ):
        load_tasks(tasks)


def test_family_comes_from_metadata_or_name_never_the_folder(tmp_path):
    def family(metadata: str, name: str = "acme/fix-parser-12") -> str:
        root = _harbor_task(
            tmp_path / "dataset-folder" / f"t{len(list(tmp_path.rglob('task.toml')))}",
            f'[task]\nname = "{name}"\n{metadata}',
        )
        return load_task(root).family

    assert family('[metadata]\nfamily = "parsing"\ncategory = "software"\n') == "parsing"
    assert family('[metadata]\ncategory = "software"\n') == "software"
    assert family("") == "fix-parser"
    assert family("", name="acme/hello_world") == "hello_world"


def test_builtin_families_are_the_generators(tmp_path):
    settings = SimpleNamespace(
        source="builtin",
        seed=0,
        train_per_family=8,
        heldout_per_family=2,
        split="heldout",
        cache_dir=str(tmp_path / "tasks"),
        rl_share=0.0,
        families=[],
        limit=0,
    )
    tasks = load_task_set(settings)
    assert tasks.unloadable == {} and all(t.family == t.metadata["family"] for t in tasks)
    assert all(t.family != "heldout" for t in tasks) and all(
        len(t.steps) == 1 and t.network_mode == "no-network" for t in tasks
    )


def test_the_eval_stage_lists_unloadable_tasks_and_counts_them(rootfs, tmp_path, monkeypatch):
    from tbexp.stages import eval as eval_stage

    tasks = tmp_path / "set"
    make_task(tasks, "good")
    broken = make_task(tasks, "broken")
    (broken / "instruction.md").unlink()
    monkeypatch.chdir(tmp_path)
    metrics = eval_stage.run(compose_job("tasks=dir", f"tasks.path={tasks}", "policy=oracle"))
    assert metrics["tasks/unloadable"] == 1.0 and metrics["eval/strict_success"] == 1.0
    assert json.loads((tmp_path / "unloadable_tasks.json").read_text()) == {
        str(broken): f"{broken}/instruction.md: missing (the agent's instruction)"
    }
    assert json.loads((tmp_path / "summary.json").read_text())["tasks/unloadable"] == 1.0


def test_a_loaded_task_is_cached_by_content_and_a_changed_file_is_read_again(tmp_path, monkeypatch):
    from tbexp.tasks import harbor_task, model_cache

    monkeypatch.setenv("TBEXP_CACHE", str(tmp_path / "cache"))
    toml = '[verifier]\ntimeout_sec = 42.0\n[environment]\nmemory_mb = 700\nnetwork_mode = "allowlist"\n'
    task_dir = _harbor_task(tmp_path / "t", toml)
    first = load_task(task_dir)
    assert len(list((tmp_path / "cache" / "task-models").glob("*.pkl"))) == 1
    harbor_task._loaded.clear()  # as a new process: only the disk cache is left
    monkeypatch.setattr(harbor_task, "_harbor_task", lambda *a: pytest.fail("Harbor's Task read a cached task again"))
    again = load_task(task_dir)
    assert again == first and isinstance(again.harbor_config, dict)  # Harbor's model is made on first use only
    assert type(again.harbor).__name__ == "TaskConfig" and again.harbor.verifier.timeout_sec == 42.0
    assert again.harbor.environment.model_fields_set == first.harbor.environment.model_fields_set
    before = model_cache.directory_digest(task_dir)
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    assert model_cache.directory_digest(task_dir) != before
    harbor_task._loaded.clear()
    with pytest.raises(pytest.fail.Exception, match="read a cached task again"):
        load_task(task_dir)
