"""Terminal-Bench 2 test.sh files, unmodified, verified with no network (tbexp/sandboxes/provision.py).

The tasks are written here: the uv bootstrap of TB2 (apt-get install curl, the astral.sh
installer piped to sh, `source $HOME/.local/bin/env`), then either `uvx ... pytest --ctrf` or
`uv init` / `uv add` / `uv run pytest --ctrf`. The first provision needs pip to reach the package
index (once per cache); without it the sandbox tests are skipped, saying so.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from tbexp.episodes.verifier import VerifierError, verify
from tbexp.sandboxes import provision
from tbexp.sandboxes.provision import ProvisionError, read_needs
from tbexp.tasks import load_task
from tests.conftest import compose_config, make_task

BOOTSTRAP = """#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
source $HOME/.local/bin/env
"""
UVX = (
    BOOTSTRAP
    + "uvx -p {python} -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA\n"
)
UV_PROJECT = BOOTSTRAP + textwrap.dedent("""\
    cd /tests
    set -e
    uv init
    uv add pytest==8.4.1 pytest-json-ctrf==0.3.5
    set +e
    uv run pytest \\
      --ctrf /logs/verifier/ctrf.json \\
      /tests/test_outputs.py \\
      -rA
    """)
REWARD = "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
VARIANTS = {"uvx": UVX.format(python="3.11") + REWARD, "uv-project": UV_PROJECT + REWARD}
VERIFY_TIMEOUT_S = 300.0
N_TESTS = 3  # make_task's default tests; test_input_untouched passes without any work
NOP_PASSES = {"test_outputs.py::test_input_untouched"}


def tb2_task(root: Path, test_sh: str, name: str = "tb2", verifier_env: str = "") -> Path:
    task = make_task(root, name)
    (task / "tests" / "test.sh").write_text(test_sh)
    toml = task / "task.toml"
    env = f"env = {{ {verifier_env} }}\n" if verifier_env else ""
    # a loaded machine's Docker exec of apt-get plus uv can pass make_task's 30 s
    toml.write_text(
        toml.read_text().replace(
            "[verifier]\ntimeout_sec = 30.0\n", f"[verifier]\ntimeout_sec = {VERIFY_TIMEOUT_S}\n{env}"
        )
    )
    return task


# -- reading test.sh ------------------------------------------------------------


def test_needs_are_read_from_both_variants():
    uvx = read_needs(UVX.format(python="3.13"))
    assert (uvx.uv_version, uvx.requirements, uvx.pythons) == (
        "0.9.5",
        ("pytest-json-ctrf==0.3.5", "pytest==8.4.1"),
        ("3.13",),
    )
    project = read_needs(UV_PROJECT.replace("uv add pytest==8.4.1", "uv add pytest==8.3.0 numpy==2.1.1"))
    assert (
        project.requirements == ("numpy==2.1.1", "pytest-json-ctrf==0.3.5", "pytest==8.3.0") and project.pythons == ()
    )


def test_unpinned_pytest_gets_the_tb2_pins_and_a_script_without_uv_needs_nothing():
    needs = read_needs("curl -LsSf https://astral.sh/uv/install.sh | sh\nuvx --with pytest-json-ctrf pytest /tests\n")
    assert needs.uv_version == provision.DEFAULT_UV_VERSION
    assert needs.requirements == ("pytest-json-ctrf==0.3.5", "pytest==8.4.1")
    assert read_needs("python3 -m pytest -q /tests/test_outputs.py  # plain pytest\n") is None


def test_downloads_other_than_the_uv_installer_are_found():
    script = BOOTSTRAP + "curl -fsSL https://example.com/data.csv -o /tmp/d.csv\ncurl -s http://localhost:8000/health\n"
    assert provision.network_fetches(script) == ["https://example.com/data.csv"]
    assert provision.network_fetches(VARIANTS["uvx"]) == []


def test_a_network_task_is_refused_naming_the_url(tmp_path):
    task = load_task(tb2_task(tmp_path, BOOTSTRAP + "wget -q https://example.com/answer.txt\n" + REWARD))
    with pytest.raises(
        ProvisionError, match=r"fetches https://example.com/answer.txt; tbexp's sandboxes have no network"
    ):
        provision.prepare(task)


def test_opt_out_and_a_bad_opt_out_value(tmp_path):
    assert provision.prepare(load_task(tb2_task(tmp_path, VARIANTS["uvx"], "off", 'TBEXP_PROVISION = "0"'))) is None
    bad = load_task(tb2_task(tmp_path, VARIANTS["uvx"], "bad", 'TBEXP_PROVISION = "maybe"'))
    with pytest.raises(ProvisionError, match=r"task.toml: \[verifier.env\] TBEXP_PROVISION must be 0 or 1"):
        provision.prepare(bad)


# -- in sandboxes ---------------------------------------------------------------


@pytest.fixture(scope="session")
def provisioned(tmp_path_factory):
    """The TB2 provision built (or found) in the cache, or a skip when pip cannot reach the index."""
    task = load_task(tb2_task(tmp_path_factory.mktemp("warm"), VARIANTS["uvx"]))
    try:
        return provision.prepare(task)
    except ProvisionError as err:
        pytest.skip(f"cannot build the provision (pip needs the package index once): {err}")


def _episode(sandbox_cls, settings, task_dir: Path, solve: bool, agent_also: str = ""):
    task = load_task(task_dir)
    sandbox = sandbox_cls(settings, task)
    try:
        sandbox.start()
        if solve:
            sandbox.upload(task.solution_script, "/solution/solve.sh")
            assert sandbox.exec("bash /solution/solve.sh").exit_code == 0
        if agent_also:
            assert sandbox.exec(agent_also).exit_code == 0
        return sandbox, verify(sandbox, task)
    finally:
        sandbox.stop()


def _bwrap():
    from tbexp.sandboxes.bwrap import BwrapSandbox

    return BwrapSandbox


@pytest.mark.sandbox
@pytest.mark.parametrize("variant", VARIANTS)
def test_oracle_passes_and_nop_fails_every_test_offline(variant, provisioned, sandbox_settings, tmp_path):
    task = tb2_task(tmp_path, VARIANTS[variant])
    _, solved = _episode(_bwrap(), sandbox_settings, task, solve=True)
    assert solved.n_total == N_TESTS and solved.n_passed == N_TESTS, solved.log_tail
    assert solved.rewards == {"reward": 1.0}
    _, nop = _episode(_bwrap(), sandbox_settings, task, solve=False)
    assert nop.n_total == N_TESTS and {t for t, s in nop.tests.items() if s == "passed"} == NOP_PASSES
    assert nop.rewards == {"reward": 0.0}


@pytest.mark.sandbox
def test_the_sandbox_has_no_network_and_uv_cannot_be_overwritten(provisioned, sandbox_settings, tmp_path):
    from tbexp.sandboxes.bwrap import BwrapSandbox

    sandbox = BwrapSandbox(sandbox_settings, load_task(tb2_task(tmp_path, VARIANTS["uvx"])))
    with sandbox:
        interfaces = sandbox.exec("python3 -c 'import socket; print([n for _, n in socket.if_nameindex()])'")
        assert interfaces.output.strip() == "['lo']"
        wrote = sandbox.exec("echo fake > /root/.local/bin/uv")
        assert wrote.exit_code != 0 and "Read-only file system" in wrote.output
        assert "uv 0.9.5" in sandbox.exec("/root/.local/bin/uv --version").output


@pytest.mark.sandbox
def test_uv_settings_the_agent_left_behind_do_not_steer_the_tests(provisioned, sandbox_settings, tmp_path):
    # a uv.toml that forbids wheels (so nothing could be installed) and a file where uv's cache should be
    plant = "mkdir -p /root/.config/uv /root/.cache && echo 'no-binary = true' > /root/.config/uv/uv.toml"
    plant += " && echo junk > /root/.cache/uv"
    _, report = _episode(_bwrap(), sandbox_settings, tb2_task(tmp_path, VARIANTS["uv-project"]), True, plant)
    assert report.n_passed == N_TESTS, report.log_tail


@pytest.mark.sandbox
def test_a_second_episode_downloads_nothing(provisioned, sandbox_settings, tmp_path, monkeypatch):
    def no_pip(args, what):
        raise AssertionError(f"pip was called for {what}: the cache should have been used")

    monkeypatch.setattr(provision, "_pip", no_pip)
    monkeypatch.setattr(provision, "_ready", set())  # as a fresh process would see it: only the disk
    started = time.monotonic()
    again = provision.prepare(load_task(tb2_task(tmp_path, VARIANTS["uv-project"])))
    assert time.monotonic() - started < 1.0
    assert again.wheels_dir == provisioned.wheels_dir and again.bin_dir == provisioned.bin_dir
    _, report = _episode(_bwrap(), sandbox_settings, tb2_task(tmp_path, VARIANTS["uvx"], "second"), solve=True)
    assert report.n_passed == N_TESTS


@pytest.mark.sandbox
def test_an_opted_out_task_gets_nothing(provisioned, sandbox_settings, tmp_path):
    task = tb2_task(tmp_path, VARIANTS["uvx"], "off", 'TBEXP_PROVISION = "0"')
    sandbox = _bwrap()(sandbox_settings, load_task(task))
    try:
        sandbox.start()
        assert sandbox.provision is None
        # uvx is not there, as for TB2 offline: no test ran, which is the verifier's failure, never a valid 0
        with pytest.raises(VerifierError, match=r"(?s)pytest ran none.*command uvx.*uvx: command not found"):
            verify(sandbox, sandbox.task)
    finally:
        sandbox.stop()


@pytest.mark.sandbox
def test_a_python_the_environment_lacks_is_a_clear_failure(provisioned, sandbox_settings, tmp_path):
    task = tb2_task(tmp_path, UVX.format(python="3.13") + REWARD)
    with pytest.raises(
        VerifierError, match=r"asks uv for Python 3.13, which this environment does not have \(it has python3.11\)"
    ):
        _episode(_bwrap(), sandbox_settings, task, solve=True)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_docker_oracle_passes_and_nop_fails_offline(variant, provisioned, docker_engine, tmp_path):
    from tbexp.sandboxes.docker import DockerSandbox

    settings = compose_config(
        "sandbox=docker", "sandbox.command_timeout_s=10", "sandbox.disk_mb=256", "sandbox.max_lifetime_s=600"
    ).sandbox
    task = tb2_task(tmp_path, VARIANTS[variant])
    sandbox, solved = _episode(DockerSandbox, settings, task, solve=True)
    assert solved.n_total == N_TESTS and solved.n_passed == N_TESTS, solved.log_tail
    assert "python3.11" in {f"python{v}" for v in sandbox.provision.interpreters}
    _, nop = _episode(DockerSandbox, settings, task, solve=False)
    assert nop.n_total == N_TESTS and {t for t, s in nop.tests.items() if s == "passed"} == NOP_PASSES
    with pytest.raises(VerifierError, match=r"Python 3.13, which this environment does not have"):
        _episode(DockerSandbox, settings, tb2_task(tmp_path, UVX.format(python="3.13") + REWARD, "py313"), solve=True)
