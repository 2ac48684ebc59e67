"""`sandbox=docker`: the task's own image, one container per episode, no network unless the task allows it.

`DockerSandbox.start` gets the task's image (built once per content,
docker_images.py), guards this process's containers against its death, and
starts a container with the task's limits (base.task_limits, docker_containers.py);
an exec runs as the sandbox's current user (`as_user`: task.toml's agent or
verifier user, checked at start). A multi-container task's other services
(`environment/docker-compose.yaml`) are started first, on an internal network of
the episode's own that the container joins, and removed at stop (compose.py); the
image's own service (ENTRYPOINT/CMD, or main's compose command) is started last,
before the agent, and from then on nothing an exec leaves running is killed,
as after `start_daemon` (image_start.py). This module
holds the sandbox itself: running commands in the container and copying files
in and out of it.

Each `exec` is one `docker exec` of a small bash wrapper: it runs the command
in a session of its own (so the command's `kill 0` spares the wrapper), with
stderr merged into stdout and RLIMIT_FSIZE at `disk_mb`, then `kill -9 -1`s
every process of the container except PID 1 and itself, and reports the
exit code as the last line of its own stderr (the command's goes to stdout,
so the wrapper's stderr holds nothing else but bash's job reports). The host reads the
multiplexed stream with a deadline and a byte budget; on time-out, on too
much output, or when the wrapper itself was killed, it runs a second exec,
`kill -9 -1` as root, which ends the command and everything it started. So
nothing outlives its exec; the kill is one kernel call that new forks cannot
race, and a sandboxed `kill -9 -1` cannot end the container (PID 1 ignores
signals from inside). The engine handles a container's exec exits in order,
and an exit waits until its output has been read, so the second exec is
started detached and the first one's stream read to its end before waiting
on it. Where the wrapper is killed while a background process still holds
the output pipe, the stream ends when the engine stops waiting for it (2 s).

What is simplified:
* Disk: see docker_containers.py (the writable layer is capped only where the
  engine can; any one file is capped at `disk_mb` by the wrapper).
* /tmp is part of the writable layer, not a tmpfs: the copy API
  (`put_archive`/`get_archive`) does not see tmpfs mounts and a tmpfs hides
  what the image put there.
* The wrapper's final `kill -9 -1` runs as the image's user, so with a
  non-root `USER` it spares root processes the command started through sudo.
* Execs in one sandbox are meant to run one at a time: each one's clean-up
  ends whatever else runs in the container, as bwrap's cgroup kill does.
* `start_daemon` (terminus-2's tmux server) turns that clean-up off for the
  rest of the sandbox's life: a container is one process space, so sparing
  the daemon's processes means sparing what any exec leaves running, as in
  Harbor's own containers. A time-out's or an output limit's kill still ends
  everything, daemons included.
"""

from __future__ import annotations

import logging
import select
import socket
import tarfile
import tempfile
import time
from pathlib import Path, PurePosixPath

import docker

from tbexp.sandboxes import base, docker_agent_state, provision
from tbexp.sandboxes.base import OUTPUT_LIMIT_EXIT, TIMEOUT_EXIT, ExecResult, Sandbox, SandboxError, task_limits
from tbexp.sandboxes.compose import ensure_service_images, start_project
from tbexp.sandboxes.compose_file import compose_file, read_compose
from tbexp.sandboxes.docker_containers import _container_options, _create_container, _guard_process
from tbexp.sandboxes.docker_images import ENGINE_ERRORS, _client, _ensure_image, image_source
from tbexp.sandboxes.image_start import start_service
from tbexp.sandboxes.verifier_files import RUNTIME, RUNTIME_MOUNT

log = logging.getLogger(__name__)

KILL_GRACE_S = 5.0  # after a kill, how long the stream may take to end
STATUS_TAIL_BYTES = 256  # kept of the wrapper's stderr, whose last line is the exit code
# $1 = the command, $2 = RLIMIT_FSIZE in KiB, $3 = "keep" once a daemon runs (no clean-up). stdout carries the command's output; the last line
# of stderr is the exit code, written only after the clean-up.
WRAPPER = r"""ulimit -f "$2" 2>/dev/null
if command -v setsid >/dev/null; then setsid bash -c "$1" </dev/null 2>&1; else bash -c "$1" </dev/null 2>&1; fi
code=$?
[ "$3" = keep ] || kill -9 -1 2>/dev/null
printf '\n%d' "$code" >&2
exit "$code"
"""
KILL_ALL = ["bash", "-c", "kill -9 -1"]


class DockerSandbox(docker_agent_state.DockerAgentSide, Sandbox):
    @classmethod
    def prepare(cls, settings, task) -> None:
        api = _client()
        image = _ensure_image(api, task, settings)
        if compose_file(task):  # the other services' images too: a build that fails makes the task unrunnable
            ensure_service_images(api, read_compose(task, image), task)

    def start(self) -> None:
        self.id = self.project = None
        self.api = _client()
        _guard_process(self.api)
        self.image = image = _ensure_image(self.api, self.task, self.settings)
        self.environment_source = image_source(image)
        try:
            config = self.api.inspect_image(image)["Config"] or {}
            image_workdir = config.get("WorkingDir") or "/"
            self.workdir = image_workdir if image_workdir != "/" else self.task.workdir  # as bwrap
            image_vars = dict(entry.partition("=")[::2] for entry in config.get("Env") or [])
            image_env = set(image_vars)
            self.image_path = image_vars.get("PATH", base.DEFAULT_PATH)
            env = {k: v for k, v in {"LANG": "C.UTF-8", "TERM": "xterm"}.items() if k not in image_env}
            network = self.task.network_mode == "public" and self.settings.allow_network  # else --network none
            self.limits = task_limits(self.settings, self.task)
            options = _container_options(self.settings, self.task.name, self.workdir, env, network, self.limits)
            # What a TB2 test.sh would download (uv, its wheels), bound read-only: see provision.py.
            self.provision = provision.prepare(self.task)
            mounts = [*(self.provision.mounts if self.provision else []), (RUNTIME, RUNTIME_MOUNT)]
            options["host_config"]["binds"] = [f"{host}:{path}:ro" for host, path in mounts]  # read-only to all
            self.project, options, start, command = start_project(self.api, self.task, self.settings, image, options)
            self.id = _create_container(self.api, image, options)
            self.api.start(self.id)
            self._check_users()
            if self.provision:  # listed before the agent runs, so deleting an interpreter cannot make it "missing"
                names = provision.interpreters_of_image(image, lambda: self.exec(provision.INTERPRETER_PROBE).output)
                self.provision = self.provision.with_interpreters(names)
            self.service = start_service(self, start, command)  # the image's own daemon, before the agent
        except ENGINE_ERRORS as err:
            self.stop()
            raise SandboxError(f"cannot start a container from {image} for {self.task.name}: {err}") from err
        except BaseException:
            self.stop()
            raise

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        timeout_s = self.settings.command_timeout_s if timeout_s is None else timeout_s
        if not getattr(self, "id", None):
            raise SandboxError("exec on a sandbox that is not running (start() it first)")
        limit = self.settings.output_limit_bytes
        started = time.monotonic()
        keep = "keep" if getattr(self, "keep_processes", False) else ""
        argv = ["bash", "-c", WRAPPER, "tbexp-exec", command, str(self.limits.disk_mb * 1024), keep]
        user = "" if self.user is None else str(self.user)  # "" = the image's USER
        try:
            exec_id = self.api.exec_create(self.id, argv, workdir=self.workdir, user=user)["Id"]
            sock = self.api.exec_start(exec_id, socket=True)
        except ENGINE_ERRORS as err:
            raise SandboxError(f"cannot exec in container {self.id}: {err}") from err
        kills: list[str | None] = []
        output, status, timed_out, truncated = _read_exec(
            sock, started + timeout_s, limit, lambda: kills.append(self._start_kill())
        )
        if timed_out:
            code = TIMEOUT_EXIT
        elif truncated:
            code = OUTPUT_LIMIT_EXIT
        elif status is not None:
            code = status
        else:  # the wrapper was killed before it could clean up and report
            code = self._wait_exec(exec_id)
            kills.append(self._start_kill())
        for kill_id in kills:  # the next exec must not start before the clean-up is done
            if kill_id:
                self._wait_exec(kill_id)
        return ExecResult(
            output[:limit].decode(errors="replace"), code, timed_out, truncated, time.monotonic() - started
        )

    def start_daemon(self, command: str, timeout_s: float | None = None) -> ExecResult:
        self.keep_processes = True  # from now on no exec cleans up after itself (module docstring)
        return self.exec(command, timeout_s)

    def upload(self, local: Path, remote: str) -> None:
        local = Path(local)
        dest = self._abspath(remote).lstrip("/")
        with tempfile.SpooledTemporaryFile(max_size=64 * 2**20) as archive:
            with tarfile.open(fileobj=archive, mode="w") as tar:
                if local.is_dir():
                    for child in sorted(local.iterdir()):
                        tar.add(child, arcname=f"{dest}/{child.name}".lstrip("/"), filter=_as_root)
                else:
                    tar.add(local, arcname=dest, filter=_as_root)  # FileNotFoundError if missing, as bwrap
            archive.seek(0)
            try:
                self.api.put_archive(self.id, "/", archive)
            except ENGINE_ERRORS as err:
                raise SandboxError(f"cannot upload {local} to {remote}: {err}") from err

    def download(self, remote: str, local: Path) -> None:
        path = self._abspath(remote)
        try:
            chunks, stat = self.api.get_archive(self.id, path)
            if stat.get("linkTarget"):  # a symlink: fetch what it points to (inside the container)
                chunks, stat = self.api.get_archive(self.id, stat["linkTarget"])
            with tempfile.SpooledTemporaryFile(max_size=64 * 2**20) as archive:
                for chunk in chunks:
                    archive.write(chunk)
                archive.seek(0)
                _extract(archive, Path(local), is_dir=bool(stat["mode"] & (1 << 31)))
        except docker.errors.NotFound as err:
            raise FileNotFoundError(f"{remote}: not in the sandbox") from err
        except ENGINE_ERRORS as err:
            raise SandboxError(f"cannot download {remote}: {err}") from err

    def stop(self) -> None:
        cid, self.id = getattr(self, "id", None), None
        project, self.project = getattr(self, "project", None), None
        if cid:
            try:
                self.api.remove_container(cid, force=True)
            except docker.errors.NotFound:
                pass
            except ENGINE_ERRORS as err:
                if "already in progress" not in str(err):  # auto-remove got there first
                    log.warning(
                        "could not remove container %s (it ends itself within max_lifetime_s): %s", cid[:12], err
                    )
        if project:
            project.down()  # the other services and the episode's network

    def run_as_root(self, argv: list[str]) -> str:
        """One exec as root without the wrapper (nothing is killed after it): its output."""
        try:
            exec_id = self.api.exec_create(self.id, argv, user="root")["Id"]
            return self.api.exec_start(exec_id).decode(errors="replace")
        except ENGINE_ERRORS as err:
            raise SandboxError(f"cannot exec in container {self.id}: {err}") from err

    # -- helpers --------------------------------------------------------------

    def _check_users(self) -> None:
        """task.toml's [agent] and [verifier] users exist in the image: else the task's fault, said at start."""
        for user in dict.fromkeys(u for u in (self.task.agent_user, self.task.verifier_user) if u is not None):
            with self.as_user(user):
                result = self.exec("true", timeout_s=30)
            if result.exit_code != 0:
                raise SandboxError(
                    f"{self.task.path / 'task.toml'}: user {user!r}: cannot run commands as it in {self.image} "
                    f"(exit {result.exit_code}): {result.output.strip()[-300:]}"
                )

    def _start_kill(self) -> str | None:
        """Start `kill -9 -1` as root (detached): every process in the container but PID 1 ends."""
        try:
            kill_id = self.api.exec_create(self.id, KILL_ALL, stdout=False, stderr=False, user="root")["Id"]
            self.api.exec_start(kill_id, detach=True)
            return kill_id
        except ENGINE_ERRORS as err:
            log.warning("could not kill the processes of container %s: %s", self.id[:12], err)
            return None

    def _wait_exec(self, exec_id: str) -> int:
        """Wait for an exec to end; its exit code."""
        deadline = time.monotonic() + KILL_GRACE_S
        while True:
            try:
                info = self.api.exec_inspect(exec_id)
            except ENGINE_ERRORS as err:
                raise SandboxError(f"cannot inspect an exec in container {self.id}: {err}") from err
            if not info["Running"] and info["ExitCode"] is not None:
                return info["ExitCode"]
            if time.monotonic() > deadline:
                raise SandboxError(f"an exec in container {self.id} did not end within {KILL_GRACE_S} s of its kill")
            time.sleep(0.01)

    def _abspath(self, remote: str) -> str:
        return str(PurePosixPath(self.workdir, remote)) if not remote.startswith("/") else str(PurePosixPath(remote))


def _read_exec(sock, deadline: float, limit: int, kill) -> tuple[bytes, int | None, bool, bool]:
    """Read an exec's multiplexed stream until it ends; `kill()` on time-out or past `limit` bytes.

    After a kill the stream is drained (and dropped) until it ends, at most KILL_GRACE_S.
    Returns (stdout bytes, exit code the wrapper reported or None, timed out, truncated).
    """
    raw = getattr(sock, "_sock", sock)
    out, status = bytearray(), bytearray()
    pending = b""
    timed_out = truncated = False
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if timed_out or truncated:
                    break  # killed, and the stream still did not end
                timed_out = True
                kill()
                deadline = time.monotonic() + KILL_GRACE_S
                continue
            if not select.select([raw], [], [], remaining)[0]:
                continue
            chunk = raw.recv(65536)
            if not chunk:
                break
            pending += chunk
            while len(pending) >= 8:  # frame: stream id, 3 zero bytes, 4-byte big-endian size
                size = int.from_bytes(pending[4:8], "big")
                if len(pending) < 8 + size:
                    break
                stream, payload, pending = pending[0], pending[8 : 8 + size], pending[8 + size :]
                if stream == 1 and not truncated:
                    out += payload
                elif stream == 2:  # bash's job reports ("Segmentation fault"), then the code
                    status = (status + payload)[-STATUS_TAIL_BYTES:]
            if len(out) > limit and not (truncated or timed_out):
                truncated = True
                kill()
                deadline = time.monotonic() + KILL_GRACE_S
    finally:
        _close(raw)
    last = status.rpartition(b"\n")[2]
    code = int(last) if last.isdigit() and not (timed_out or truncated) else None
    return bytes(out), code, timed_out, truncated


def _close(raw) -> None:
    try:
        raw.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    raw.close()


# -- copying ------------------------------------------------------------------


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _extract(archive, local: Path, is_dir: bool) -> None:
    """Unpack a get_archive tar: a directory's contents into `local`, or one file as `local`."""
    with tarfile.open(fileobj=archive, mode="r|") as tar:
        if is_dir:
            local.mkdir(parents=True, exist_ok=True)
            tar.extractall(local, filter=_inside_dir)
            return
        member = tar.next()
        if not member.isfile():
            raise SandboxError(f"{member.name}: neither a regular file nor a directory")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(tar.extractfile(member).read())


def _inside_dir(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """Drop the directory's own name from each member; skip what would land outside `dest`.

    Symlinks are kept as links (as bwrap's download does) and never followed: the
    `tar` filter refuses a member whose path would resolve through one to outside `dest`.
    """
    name = member.name.partition("/")[2]
    if not name:
        return None
    linkname = member.linkname.partition("/")[2] if member.islnk() else member.linkname
    member = member.replace(name=name, linkname=linkname, uid=None, gid=None, uname=None, gname=None, deep=False)
    try:
        return tarfile.tar_filter(member, dest)
    except tarfile.FilterError as err:
        log.warning("download skipped %s: %s", name, err)
        return None
