"""The Docker sandbox: the interface, isolation, limits, and clean-up after a killed tbexp.

Needs the Docker engine (tests/docker_service.py starts it, or skips).
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

import tbexp.sandboxes.docker_containers as docker_containers
import tbexp.sandboxes.docker_images as docker_images
from tbexp.sandboxes.base import OUTPUT_LIMIT_EXIT, TIMEOUT_EXIT, SandboxError
from tbexp.sandboxes.docker import DockerSandbox
from tbexp.tasks import load_task
from tests.conftest import REPO, compose_config, make_task

pytestmark = pytest.mark.docker

# Lists every process of the sandbox without ps (the base image has none).
PROCS = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done"


@pytest.fixture
def settings(docker_engine):
    return compose_config(
        "sandbox=docker",
        "sandbox.command_timeout_s=10",
        "sandbox.output_limit_bytes=4096",
        "sandbox.disk_mb=64",
        "sandbox.memory_mb=256",
        "sandbox.pids_limit=64",
        "sandbox.max_lifetime_s=600",
    ).sandbox


@pytest.fixture
def task(tmp_path):
    return load_task(make_task(tmp_path))


@pytest.fixture
def sandbox(settings, task, docker_engine):
    box = DockerSandbox(settings, task)
    box.start()
    yield box
    box_id = box.id
    box.stop()
    assert not _containers(docker_engine, box_id)


def _containers(api, box_id: str | None = None, owner: int | None = None) -> list[dict]:
    labels = ["tbexp.sandbox=1"] + ([f"tbexp.owner_pid={owner}"] if owner else [])
    found = api.containers(all=True, filters={"label": labels})
    return [c for c in found if c["Id"] == box_id] if box_id else found


def _wait_gone(api, box_id: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _containers(api, box_id):
            return True
        time.sleep(0.2)
    return False


def test_exec_output_exit_code_and_workdir(sandbox):
    result = sandbox.exec("pwd; cat input.txt; echo to-stderr >&2; id -u; exit 3")
    assert result.output == "/app\nhello\nto-stderr\n0\n"
    assert result.exit_code == 3 and not result.timed_out and not result.output_truncated
    assert sandbox.exec("cd /; pwd").output == "/\n"
    assert sandbox.exec("pwd").output == "/app\n"  # every exec starts fresh in the workdir
    assert sandbox.exec("kill -SEGV $$").exit_code == 128 + signal.SIGSEGV


def test_upload_and_download_round_trip(sandbox, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "x.txt").write_text("payload")
    (src / "sub" / "y.txt").write_text("nested")
    (src / "run.sh").write_text("#!/bin/bash\necho ran\n")
    (src / "run.sh").chmod(0o755)
    sandbox.upload(src, "/tmp/up/deeper")  # parents are created
    sandbox.upload(src / "x.txt", "rel/one.txt")  # relative to the workdir
    result = sandbox.exec(
        "cat /tmp/up/deeper/x.txt /tmp/up/deeper/sub/y.txt /app/rel/one.txt; /tmp/up/deeper/run.sh; stat -c %U /tmp/up/deeper/x.txt"
    )
    assert result.output == "payloadnestedpayloadran\nroot\n"

    sandbox.exec(
        "mkdir -p /app/res/inner && echo 42 > /app/res/n.txt && echo 7 > /app/res/inner/m.txt && ln -s /etc /app/res/etc"
    )
    sandbox.download("/app/res", tmp_path / "back")
    assert (tmp_path / "back" / "n.txt").read_text() == "42\n"
    assert (tmp_path / "back" / "inner" / "m.txt").read_text() == "7\n"
    assert (tmp_path / "back" / "etc").is_symlink()  # kept as a link, never followed on the host
    sandbox.download("/app/input.txt", tmp_path / "one" / "input.txt")
    assert (tmp_path / "one" / "input.txt").read_text() == "hello\n"
    with pytest.raises(FileNotFoundError):
        sandbox.download("/app/missing", tmp_path / "m")


def test_endless_command_times_out(sandbox):
    started = time.monotonic()
    result = sandbox.exec("echo before; sleep 3001", timeout_s=1.0)
    assert result.timed_out and result.exit_code == TIMEOUT_EXIT and result.output == "before\n"
    assert time.monotonic() - started < 4
    assert "sleep 3001" not in sandbox.exec(PROCS).output  # killed, not left running


def test_output_flood_is_cut_and_killed(sandbox, settings):
    started = time.monotonic()
    result = sandbox.exec("yes flood", timeout_s=30)
    assert result.output_truncated and result.exit_code == OUTPUT_LIMIT_EXIT and not result.timed_out
    assert len(result.output) == settings.output_limit_bytes and result.output.startswith("flood\nflood\n")
    assert time.monotonic() - started < 10
    assert "yes flood" not in sandbox.exec(PROCS).output


def test_background_processes_do_not_outlive_their_exec(sandbox):
    started = sandbox.exec("sleep 3017 & setsid sleep 3018 & nohup sleep 3019 >/dev/null 2>&1 & echo started")
    assert started.output == "started\n" and started.exit_code == 0
    left = sandbox.exec(PROCS).output
    assert not any(f"sleep 301{i}" in left for i in (7, 8, 9)), left
    assert (
        subprocess.run(["pgrep", "-f", "sleep 301[789]"], capture_output=True).returncode == 1
    )  # not on the host either


def test_no_network_not_even_the_hosts_loopback(sandbox, docker_engine):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(3)
    port = server.getsockname()[1]
    result = sandbox.exec(
        f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\" 2>&1; ls /sys/class/net"
    )
    assert "Connection refused" in result.output or "unreachable" in result.output
    assert result.output.strip().splitlines()[-1] == "lo"  # no interface but loopback
    with pytest.raises(TimeoutError):
        server.accept()  # nothing ever arrived
    server.close()
    assert docker_engine.inspect_container(sandbox.id)["HostConfig"]["NetworkMode"] == "none"


def test_host_files_are_invisible(sandbox, tmp_path):
    marker = tmp_path / "host-file"
    marker.write_text("s3cr3t-content")
    result = sandbox.exec(f"cat {marker} 2>&1; ls {REPO} /root/.cache 2>&1; ls /work 2>&1")
    assert "s3cr3t" not in result.output and result.output.count("No such file") == 4
    # The error lines echo the paths asked for, which contain the checkout's name (often "tbexp"): only what
    # was listed counts, and it must hold nothing of the host's (the repo's files, the cache's folders).
    listed = [line for line in result.output.splitlines() if "No such file" not in line]
    assert not [line for line in listed if any(name in line for name in ("pyproject", "conftest", "tbexp"))], listed


def test_rm_rf_root_hurts_only_the_sandbox(sandbox, tmp_path):
    marker = tmp_path / "host-marker"
    marker.write_text("still here")
    result = sandbox.exec("rm -rf / --no-preserve-root 2>/dev/null; echo done", timeout_s=60)
    assert result.output.endswith("done\n") and not result.timed_out
    assert marker.read_text() == "still here" and (REPO / "pyproject.toml").exists()
    assert sandbox.exec("echo alive").exit_code in (0, 126, 127)  # bash itself may be gone: a result, not a hang


def test_fork_bomb_is_contained(sandbox):
    started = time.monotonic()
    result = sandbox.exec(":(){ :|:& };:", timeout_s=10)
    assert result.exit_code is not None and time.monotonic() - started < 15
    assert sandbox.exec("echo alive").output == "alive\n"
    assert sandbox.exec("ls -d /proc/[0-9]* | wc -l").output.strip() in {
        str(n) for n in range(3, 9)
    }  # bomb gone, zombies reaped
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_process_and_memory_limits_hold(sandbox):
    result = sandbox.exec("for i in $(seq 200); do sleep 5 & done; echo spawned", timeout_s=5)
    assert "fork" in result.output, "200 background sleeps should hit pids_limit=64"
    result = sandbox.exec("python3 -c 'x = bytearray(1024 * 2**20); print(\"allocated\")'")
    assert "allocated" not in result.output and result.exit_code != 0
    assert sandbox.exec("echo alive").output == "alive\n"


def test_filling_the_disk_is_bounded_or_harmless(sandbox, docker_engine, settings):
    result = sandbox.exec("dd if=/dev/zero of=/big bs=1M count=200 2>&1; stat -c %s /big", timeout_s=60)
    assert "File size limit exceeded" in result.output or "File too large" in result.output
    assert int(result.output.split()[-1]) <= settings.disk_mb * 2**20  # one file: RLIMIT_FSIZE
    if docker_containers._storage_opt_ok:  # the engine caps the whole writable layer
        result = sandbox.exec(
            "for i in 1 2 3; do dd if=/dev/zero of=/f$i bs=1M count=40 2>&1; done; du -smc /big /f? | tail -1",
            timeout_s=60,
        )
        assert int(result.output.split()[-2]) <= settings.disk_mb + 1
    else:  # only the engine's data root bounds it: it must not be the host's root file system
        data_root = docker_engine.info()["DockerRootDir"]
        assert os.stat(data_root).st_dev != os.stat("/").st_dev, (
            f"{data_root} shares the host's disk: run scripts/start_dockerd.sh"
        )
    assert sandbox.exec("rm -f /big /f? && echo freed").output == "freed\n"


def test_kill_everything_inside_ends_with_a_result(sandbox):
    started = time.monotonic()
    result = sandbox.exec("kill -9 -1; sleep 3021 & echo after", timeout_s=10)  # kills the exec's wrapper too
    assert not result.timed_out and result.exit_code == 137 and time.monotonic() - started < 8
    assert "sleep 3021" not in sandbox.exec(PROCS).output  # cleaned up without the wrapper
    assert sandbox.exec("echo alive").output == "alive\n"  # PID 1 ignores signals from inside


def test_stop_removes_the_container_and_is_idempotent(settings, task, docker_engine):
    box = DockerSandbox(settings, task)
    box.start()
    labels = docker_engine.inspect_container(box.id)["Config"]["Labels"]
    assert labels["tbexp.owner_pid"] == str(os.getpid()) and labels["tbexp.sandbox"] == "1"
    box_id = box.id
    box.stop()
    box.stop()
    assert not _containers(docker_engine, box_id)
    with pytest.raises(SandboxError):
        box.exec("true")


def test_container_ends_itself_after_max_lifetime(settings, task, docker_engine):
    settings.max_lifetime_s = 2
    box = DockerSandbox(settings, task)
    box.start()
    assert _wait_gone(docker_engine, box.id, within_s=15)
    box.stop()


def _start_in_child(task) -> tuple[subprocess.Popen, str, int]:
    """A child process that starts a sandbox, reports (container id, watchdog pid) and sleeps."""
    code = (
        "import sys, time\nfrom tests.conftest import compose_config\nfrom tbexp.tasks import load_task\n"
        "import tbexp.sandboxes.docker as d, tbexp.sandboxes.docker_containers as c\n"
        f"box = d.DockerSandbox(compose_config('sandbox=docker').sandbox, load_task({str(task.path)!r}))\n"
        "box.start()\nprint(box.id, c._watchdog.pid, flush=True)\ntime.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    box_id, watchdog_pid = child.stdout.readline().split()
    return child, box_id, int(watchdog_pid)


def test_sigkilled_owner_leaves_no_container(task, docker_engine):
    child, box_id, _ = _start_in_child(task)
    assert _containers(docker_engine, box_id)
    child.kill()
    child.wait()
    assert _wait_gone(docker_engine, box_id, within_s=10), "the watchdog did not remove the dead owner's container"


def test_next_start_reaps_what_a_dead_owner_left(task, docker_engine):
    child, box_id, watchdog_pid = _start_in_child(task)
    os.kill(watchdog_pid, signal.SIGKILL)  # no watchdog either: only the reaper is left
    child.kill()
    child.wait()
    time.sleep(1)
    assert _containers(docker_engine, box_id), "the container went away without the reaper"
    reaper = "from tbexp.sandboxes.docker import _client, _guard_process\n_guard_process(_client())\n"
    subprocess.run([sys.executable, "-c", reaper], cwd=REPO, check=True, timeout=60)
    assert _wait_gone(docker_engine, box_id, within_s=5)


def test_two_sandboxes_are_independent(settings, task):
    with DockerSandbox(settings, task) as a, DockerSandbox(settings, task) as b:
        a.exec("echo a > /app/mine.txt; echo a > /tmp/t")
        assert b.exec("cat /app/mine.txt /tmp/t 2>&1").exit_code != 0
        with ThreadPoolExecutor(2) as pool:
            slow = pool.submit(a.exec, "sleep 2; cat /app/mine.txt")
            time.sleep(0.5)
            killer = pool.submit(b.exec, "kill -9 -1")
            assert slow.result().output == "a\n" and slow.result().exit_code == 0
            assert not killer.result().timed_out


def test_bad_environments_are_clear_errors(settings, tmp_path):
    task = load_task(make_task(tmp_path, "nodockerfile"))
    (task.environment_dir / "Dockerfile").unlink()
    box = DockerSandbox(settings, task)
    with pytest.raises(SandboxError, match=r"environment/Dockerfile: missing"):
        box.start()
    box.stop()

    task = load_task(make_task(tmp_path, "broken"))
    (task.environment_dir / "Dockerfile").write_text(
        f"FROM tbexp-base:bookworm\nRUN echo about-to-fail-{uuid.uuid4().hex} && exit 3\n"
    )
    with pytest.raises(
        SandboxError, match=r"(?s)broken/environment/Dockerfile: docker build failed.*about-to-fail.*non-zero code: 3"
    ):
        DockerSandbox(settings, task).start()


def test_image_is_built_once_per_content(settings, tmp_path, docker_engine):
    task = load_task(make_task(tmp_path, "cached", files={"input.txt": uuid.uuid4().hex}))
    before = docker_images.builds["docker"]
    boxes = [DockerSandbox(settings, task) for _ in range(3)]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda box: box.start(), boxes))
    images = {docker_engine.inspect_container(box.id)["Image"] for box in boxes}
    tags = {box.image for box in boxes}
    for box in boxes:
        box.stop()
    assert docker_images.builds["docker"] == before + 1 and len(images) == 1
    (task.environment_dir / "app" / "input.txt").write_text("changed")
    with DockerSandbox(settings, task) as box:
        assert box.exec("cat input.txt").output == "changed"
        tags.add(box.image)
    assert docker_images.builds["docker"] == before + 2
    for tag in tags:
        for name in (tag, f"{tag}-dockerfile"):
            docker_engine.remove_image(name, force=True)


@pytest.mark.benchmark
def test_figures(settings, tmp_path, docker_engine):
    """Prints build, start and exec times, and oracle-like episodes per second (4 threads)."""
    task = load_task(make_task(tmp_path, "bench", files={"input.txt": uuid.uuid4().hex}))
    started = time.monotonic()
    with DockerSandbox(settings, task) as box:
        first_build_s = time.monotonic() - started
        image = box.image
    starts, execs = [], []
    for _ in range(10):
        box = DockerSandbox(settings, task)
        t0 = time.monotonic()
        box.start()
        starts.append(time.monotonic() - t0)
        for _ in range(5):
            t0 = time.monotonic()
            box.exec("echo ok")
            execs.append(time.monotonic() - t0)
        box.stop()
    (tmp_path / "solve.sh").write_text("echo done > /app/out.txt\n")

    def episode(_):
        with DockerSandbox(settings, task) as box:
            box.upload(tmp_path / "solve.sh", "/solution/solve.sh")
            box.exec("bash /solution/solve.sh")
            box.exec("cat /app/out.txt")

    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(episode, range(24)))
    per_s = 24 / (time.monotonic() - t0)
    print(
        f"\nfirst start incl. build {first_build_s:.2f} s; cached start p50 {statistics.median(starts) * 1000:.0f} ms; "
        f"exec p50 {statistics.median(execs) * 1000:.0f} ms; episodes (start, upload, 2 execs, stop) {per_s:.1f}/s with 4 threads"
    )
    assert not _containers(docker_engine, owner=os.getpid())
    docker_engine.remove_image(image, force=True)
