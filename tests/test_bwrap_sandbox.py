"""The bubblewrap sandbox: the interface, isolation, and the limits an abusive agent runs into."""

from __future__ import annotations

import os
import socket
import time

import pytest

from tbexp.sandboxes.base import OUTPUT_LIMIT_EXIT, TIMEOUT_EXIT, SandboxError
from tbexp.sandboxes.bwrap import BwrapSandbox
from tests.conftest import REPO, leftover_state

pytestmark = pytest.mark.sandbox


@pytest.fixture
def sandbox(sandbox_settings, demo_task):
    before = leftover_state()
    box = BwrapSandbox(sandbox_settings, demo_task)
    box.start()
    yield box
    box.stop()
    assert leftover_state() == before, "the sandbox left processes, directories or cgroups behind"


def test_exec_runs_in_the_workdir_with_the_task_files(sandbox):
    result = sandbox.exec("pwd; cat input.txt; id -u; exit 3")
    assert result.output == "/app\nhello\n0\n" and result.exit_code == 3 and not result.timed_out


def test_upload_and_download_round_trip(sandbox, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("payload")
    sandbox.upload(tmp_path / "d", "/tmp/up")
    assert sandbox.exec("cat /tmp/up/x.txt").output == "payload"
    sandbox.exec("mkdir -p /app/res && echo 42 > /app/res/n.txt")
    sandbox.download("/app/res", tmp_path / "back")
    assert (tmp_path / "back" / "n.txt").read_text() == "42\n"
    with pytest.raises(SandboxError):
        sandbox.upload(tmp_path / "d", "/etc/evil")
    with pytest.raises(FileNotFoundError):
        sandbox.download("/app/missing", tmp_path / "m")


def test_a_file_uploaded_to_a_directory_lands_inside_it(sandbox, tmp_path):
    (tmp_path / "notes.txt").write_text("note")
    sandbox.upload(tmp_path / "notes.txt", "/app/")  # COPY notes.txt /app/
    sandbox.upload(tmp_path / "notes.txt", "/tmp")  # an existing directory, no slash
    assert sandbox.exec("test -d /app && cat /app/notes.txt /tmp/notes.txt").output == "notenote"


def test_download_does_not_follow_a_symlink_out(sandbox, tmp_path):
    sandbox.exec("ln -s /etc/shadow /app/leak; mkdir /app/d; ln -s /etc /app/d/etc")
    with pytest.raises(FileNotFoundError):
        sandbox.download("/app/leak", tmp_path / "leak")
    sandbox.download("/app/d", tmp_path / "d")
    assert (tmp_path / "d" / "etc").is_symlink()  # copied as a link, never followed


def test_upload_does_not_follow_a_symlink_the_sandbox_planted(sandbox, tmp_path):
    # The host does the copy: a planted link must be replaced, or the write lands on the host file it names.
    host_file, host_dir = tmp_path / "host.txt", tmp_path / "host-dir"
    host_dir.mkdir()
    sandbox.exec(
        f"mkdir -p /tests && ln -s {host_file} /tests/test.sh && ln -s {host_dir} /tests/sub && ln -s {host_file} /tmp/one"
    )
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    (tmp_path / "tests" / "test.sh").write_text("echo real\n")
    (tmp_path / "tests" / "sub" / "x.py").write_text("x = 1\n")
    (tmp_path / "single.txt").write_text("one\n")
    sandbox.upload(tmp_path / "tests", "/tests")
    sandbox.upload(tmp_path / "single.txt", "/tmp/one")
    assert not host_file.exists() and not any(host_dir.iterdir())
    assert (
        sandbox.exec("cat /tests/test.sh /tests/sub/x.py /tmp/one; test -L /tests/sub || echo no-link").output
        == "echo real\nx = 1\none\nno-link\n"
    )


def test_root_is_read_only_and_host_files_are_invisible(sandbox):
    assert sandbox.exec("touch /usr/x").exit_code != 0
    result = sandbox.exec(f"ls {REPO} /work /root/.cache 2>&1; cat /etc/hostname")
    assert "No such file" in result.output and "pyproject" not in result.output


def test_rm_rf_root_hurts_only_the_sandbox(sandbox, tmp_path):
    marker = tmp_path / "host-marker"
    marker.write_text("still here")
    result = sandbox.exec("rm -rf / --no-preserve-root 2>/dev/null; ls -A /app | wc -l")
    assert result.exit_code == 0 and result.output.strip() == "0"
    assert marker.read_text() == "still here" and (REPO / "pyproject.toml").exists()
    assert sandbox.exec("echo alive").output == "alive\n"


def test_endless_loop_times_out(sandbox):
    started = time.monotonic()
    result = sandbox.exec("while true; do :; done", timeout_s=1.0)
    assert result.timed_out and result.exit_code == TIMEOUT_EXIT and time.monotonic() - started < 5


def test_output_flood_is_cut(sandbox, sandbox_settings):
    result = sandbox.exec("yes flood")
    assert result.output_truncated and result.exit_code == OUTPUT_LIMIT_EXIT
    assert len(result.output) <= sandbox_settings.output_limit_bytes


def test_fork_bomb_is_contained(sandbox):
    result = sandbox.exec(":(){ :|:& };:; sleep 2", timeout_s=4)
    assert result.exit_code in (0, TIMEOUT_EXIT, 254) or result.output  # a verdict, whichever comes first
    assert sandbox.exec("echo alive").output == "alive\n"
    pid = os.fork()  # the host can still fork
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0


def test_process_limit_holds(sandbox, sandbox_settings):
    result = sandbox.exec("for i in $(seq 200); do sleep 5 & done; echo spawned", timeout_s=3)
    assert "fork" in result.output, "200 background sleeps should hit pids_limit=64"


def test_memory_limit_holds(sandbox):
    result = sandbox.exec(
        'python3 -c \'x = bytearray(1024 * 2**20); x[::4096] = b"1" * len(x[::4096]); print("allocated")\''
    )
    assert "allocated" not in result.output and result.exit_code != 0


def test_filling_the_disk_stops_at_the_limit(sandbox):
    result = sandbox.exec("dd if=/dev/zero of=/app/fill bs=1M count=500 2>&1; du -sm /app | cut -f1")
    assert int(result.output.strip().splitlines()[-1]) <= 64
    assert sandbox.exec("rm /app/fill && echo freed").output == "freed\n"


def test_no_network_not_even_the_hosts_loopback(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(3)
    port = server.getsockname()[1]
    result = sandbox.exec(
        f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\" 2>&1"
    )
    assert "Connection refused" in result.output or "unreachable" in result.output
    with pytest.raises(TimeoutError):
        server.accept()  # nothing ever arrived
    server.close()


def test_kill_everything_kills_only_the_sandbox(sandbox):
    result = sandbox.exec("kill -9 -1; echo after")
    assert result.exit_code in (0, 137)
    assert os.getpid() and sandbox.exec("echo alive").output == "alive\n"


def test_background_processes_do_not_outlive_their_exec(sandbox):
    import subprocess

    assert sandbox.exec("sleep 3017 & echo started").output == "started\n"
    assert (
        sandbox.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' ' | grep -c 'sleep [3]017' || true").output.strip() == "0"
    )
    assert subprocess.run(["pgrep", "-f", "sleep 3017"], capture_output=True).returncode == 1  # not on the host either


def test_sandboxes_do_not_see_each_other(sandbox_settings, demo_task):
    with BwrapSandbox(sandbox_settings, demo_task) as a, BwrapSandbox(sandbox_settings, demo_task) as b:
        a.exec("echo a > /app/mine.txt; echo a > /tmp/t")
        assert b.exec("cat /app/mine.txt /tmp/t 2>&1").exit_code != 0


def test_missing_rootfs_is_a_clear_error(sandbox_settings, demo_task, tmp_path):
    sandbox_settings.rootfs = str(tmp_path / "nothing")
    box = BwrapSandbox(sandbox_settings, demo_task)
    with pytest.raises(SandboxError, match="build_rootfs"):
        box.start()
    box.stop()


def test_an_instruction_it_cannot_honour_is_refused_naming_the_line(sandbox_settings, demo_task):
    from tbexp.sandboxes.base import EnvironmentBuildError

    sandbox_settings.environment_source = "debootstrap"  # the builder without Docker (Docker would honour it)
    dockerfile = demo_task.environment_dir / "Dockerfile"
    dockerfile.write_text("FROM tbexp-base:bookworm\nRUN --mount=type=secret,id=key cat /run/secrets/key\n")
    with pytest.raises(EnvironmentBuildError, match="Dockerfile:2: RUN --mount=type=secret.*sandbox=docker"):
        BwrapSandbox(sandbox_settings, demo_task).start()


def test_start_reaps_what_a_dead_process_left(sandbox_settings, demo_task):
    import subprocess
    import sys

    from tbexp.sandboxes.bwrap import WORK_PARENT
    from tbexp.sandboxes.cgroup import leftover_cgroups

    code = (
        "import os, sys\nfrom tests.conftest import compose_config\nfrom tbexp.tasks import load_task\n"
        "from tbexp.sandboxes.bwrap import BwrapSandbox\n"
        f"box = BwrapSandbox(compose_config().sandbox, load_task({str(demo_task.path)!r}))\nbox.start()\n"
        "print(box.id, flush=True)\nos._exit(0)  # dies without stop()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    dead_id = out.stdout.strip()
    assert dead_id and (WORK_PARENT / dead_id).exists()
    import tbexp.sandboxes.bwrap as bwrap_module

    bwrap_module._reaped = False
    with BwrapSandbox(sandbox_settings, demo_task):
        pass
    assert not (WORK_PARENT / dead_id).exists()
    assert all(g.dirs[0].name != dead_id for g in leftover_cgroups())


def test_shell_session_keeps_cwd_and_exported_variables(sandbox):
    from tbexp.agents.base import ShellSession

    shell = ShellSession(sandbox, "/app")
    assert shell.run("mkdir -p d && cd d && export FOO=bar && LOCAL=x").exit_code == 0
    result = shell.run("pwd; echo $FOO; echo ${LOCAL:-unset}; exit 4")
    assert result.output == "/app/d\nbar\nunset\n" and result.exit_code == 4
