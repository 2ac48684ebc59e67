"""bubblewrap sandboxes: a read-only Debian root, private writable paths, no network.

Layout of one sandbox (all on one host tmpfs of `disk_mb`, so filling the
disk fills only that): /app, /tmp, /root, /logs, /tests, /solution (and a
non-root USER's home) are bound writable, holding at start what the image
holds there; the task's root file system is bound read-only. That root is
`sandbox.rootfs` (scripts/build_rootfs.sh) for tasks FROM the base image that
only copy files in, else the one environments.py builds from the task's
Dockerfile, once per distinct environment. Commands run as the image's USER
(root by default) of a user namespace that maps that one uid; a task whose
network_mode is "public" shares the host's network where `sandbox.allow_network`
lets it, every other has none. Every `exec` is a fresh `bwrap` with new user, PID, net,
IPC and UTS namespaces (~10 ms), so a command cannot reach the host's
loopback, see host processes, or outlive its exec: when the namespace's init
exits, the kernel kills everything left in it. Process count and memory (and
CPU, where the task names its cpus) are capped by a cgroup of the sandbox's
own, at the task's limits (base.task_limits); the tmpfs is the task's storage.
An exec runs as the sandbox's current user (`as_user`: task.toml's agent or
verifier user), looked up in the root's /etc/passwd. Shell state that a terminal would keep
between commands (cwd, exported variables) is carried by the agents'
`ShellSession`, not here. The one exception is `start_daemon` (terminus-2's
tmux server): its command runs in a bwrap of its own that stays up until
`stop`, in a child of the sandbox's cgroup that the per-exec clean-up spares;
later execs reach its processes only through the file system (the tmux
socket in /tmp), as each exec keeps its own PID and network namespaces.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from tbexp.sandboxes import agent_state, provision
from tbexp.sandboxes.base import (
    DEFAULT_PATH,
    OUTPUT_LIMIT_EXIT,
    TIMEOUT_EXIT,
    ExecResult,
    Sandbox,
    SandboxError,
    launcher_env,
    task_limits,
)
from tbexp.sandboxes.cgroup import Cgroup, leftover_cgroups
from tbexp.sandboxes.dockerfile import DockerfileError
from tbexp.sandboxes.environment_build import user_ids
from tbexp.sandboxes.environments import bwrap_environment
from tbexp.sandboxes.verifier_files import RUNTIME, RUNTIME_MOUNT

WRITABLE = ("/app", "/tmp", "/root", "/logs", "/tests", "/solution")
WORK_PARENT = Path(tempfile.gettempdir()) / "tbexp-sandboxes"
PATH = DEFAULT_PATH
_reaped = False
# $1 = the command, $2 = a marker: the command's output, then "<marker> <exit code>", then the bwrap stays up.
DAEMON_SCRIPT = (
    'bash -c "$1" </dev/null 2>&1; rc=$?; printf "\\n%s %d\\n" "$2" "$rc"; '
    "exec sleep infinity </dev/null >/dev/null 2>&1"
)


class BwrapSandbox(agent_state.BwrapAgentSide, Sandbox):
    writable = WRITABLE  # the sandbox's own paths; a non-root USER's home joins them at start
    keep_processes = False  # True (bwrap_session.py): what a command starts lives on until stop()

    @classmethod
    def prepare(cls, settings, task) -> None:
        bwrap_environment(task, settings)

    # The session sandbox (bwrap_session.py), a subclass of this one: named, as configs name a sandbox, not imported.
    SERVICE_SANDBOX = "tbexp.sandboxes.bwrap_session.BwrapSessionSandbox"

    @classmethod
    def for_task(cls, settings, task) -> BwrapSandbox:
        """A task whose image starts a service gets the session sandbox: its execs share the service's namespaces."""
        if cls is BwrapSandbox and _starts_service(task, settings):
            from hydra.utils import get_class

            return get_class(cls.SERVICE_SANDBOX)(settings, task)
        return cls(settings, task)

    def start(self) -> None:
        _reap_once()
        s = self.settings
        if shutil.which("bwrap") is None:
            raise SandboxError("bwrap not found: apt-get install bubblewrap (scripts/setup.sh does it)")
        self.env = bwrap_environment(self.task, s)
        self.environment_source = self.env.source
        self.rootfs = self.env.root
        if not (self.rootfs / "usr/bin/python3").exists():
            raise SandboxError(f"sandbox.rootfs={self.rootfs} holds no root file system: run scripts/build_rootfs.sh")
        self.id = f"{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.daemons: list[subprocess.Popen] = []  # start_daemon's bwraps, up until stop
        self.work = WORK_PARENT / self.id
        self.work.mkdir(parents=True)
        self.limits = task_limits(s, self.task)
        self.mounted = _mount_tmpfs(self.work, self.limits.disk_mb)
        self._users: dict[str | int | None, tuple[int, int, str]] = {None: (self.env.uid, self.env.gid, self.env.home)}
        homes = [self.env.home] if self.env.uid else []
        for user in (self.task.agent_user, self.task.verifier_user):  # task.toml's users: their homes are theirs
            if user is not None:
                uid, _, home = self._ids(user)
                homes += [home] if uid else []
        self.writable = WRITABLE
        for home in dict.fromkeys(os.path.normpath(h) for h in homes):
            if (self.rootfs / home.lstrip("/")).is_dir() and not any(
                home == w or home.startswith(w + "/") for w in self.writable
            ):
                self.writable = (*self.writable, home)  # a user's home is writable too, as in its container
        for path in self.writable:
            (self.work / path.lstrip("/")).mkdir(mode=0o755 if path != "/tmp" else 0o1777, parents=True)
            if self.env.seeded:
                _seed(self.rootfs / path.lstrip("/"), self.work / path.lstrip("/"))
        self.cgroup = Cgroup.create(self.id, s.pids_limit, self.limits.memory_mb * 2**20, self.limits.cpus)
        workdir = self.env.workdir if self.env.workdir != "/" else self.task.workdir
        self.workdir = workdir
        for source, dest in self.env.copies:
            self.upload(source, dest if dest.startswith("/") else f"{workdir}/{dest}")
        # What a TB2 test.sh would download (uv, its wheels), bound read-only: see provision.py.
        self.provision = provision.prepare(self.task)
        if self.provision:
            self.provision = self.provision.with_interpreters(provision.interpreters_in_root(self.rootfs))
        self.image_path = self.env.env.get("PATH", PATH)
        self.verifier_dirs = {
            "/tests": self.work / ".verifier" / "tests",
            "/logs/verifier": self.work / ".verifier" / "logs",
        }

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        timeout_s = self.settings.command_timeout_s if timeout_s is None else timeout_s
        argv = [*self._join_cgroup(), *self._rlimits(), *self._exec_argv(command)]
        started = time.monotonic()
        proc = _spawn(argv)
        output, timed_out, truncated = _read_capped(proc, timeout_s, self.settings.output_limit_bytes, self._kill)
        code = proc.wait()
        if self.cgroup and not self.keep_processes:
            self.cgroup.kill_all()  # nothing may outlive its exec
        if code == 1 and output.startswith(b"bwrap:"):
            raise SandboxError(f"bwrap failed: {output.decode(errors='replace').strip()}")
        if timed_out:
            code = TIMEOUT_EXIT
        elif truncated:
            code = OUTPUT_LIMIT_EXIT
        elif code < 0:
            code = 128 - code  # killed by a signal, reported as a shell would
        return ExecResult(output.decode(errors="replace"), code, timed_out, truncated, time.monotonic() - started)

    def start_daemon(self, command: str, timeout_s: float | None = None) -> ExecResult:
        timeout_s = self.settings.command_timeout_s if timeout_s is None else timeout_s
        marker = f"tbexp-daemon-{uuid.uuid4().hex}"
        group = self.cgroup.child("daemons") if self.cgroup else None
        argv = [*self._join_cgroup(group), *self._rlimits(), *self._bwrap_argv()]
        argv += ["bash", "-c", DAEMON_SCRIPT, "tbexp-daemon", command, marker]
        started = time.monotonic()
        proc = _spawn(argv)
        self.daemons.append(proc)
        output, code = _read_until_marker(proc, marker.encode(), timeout_s, self.settings.output_limit_bytes)
        if code is None and output.startswith(b"bwrap:"):
            raise SandboxError(f"bwrap failed: {output.decode(errors='replace').strip()}")
        timed_out = code is None
        if timed_out:  # the command never finished: nothing of it is kept
            _kill_daemon(proc, group)
        return ExecResult(
            output.decode(errors="replace"),
            TIMEOUT_EXIT if timed_out else code,
            timed_out,
            False,
            time.monotonic() - started,
        )

    def upload(self, local: Path, remote: str) -> None:
        host = self._host_path(remote)
        local = Path(local)
        if not local.is_dir():
            if remote.endswith("/") or (host.is_dir() and not host.is_symlink()):
                host = host / local.name  # a file into a directory (COPY notes.txt /app/), as cp and Docker do
            host.parent.mkdir(parents=True, exist_ok=True)
        _copy_in(local, host)

    def download(self, remote: str, local: Path) -> None:
        host = self._host_path(remote)
        if host.is_symlink() or not host.exists():
            raise FileNotFoundError(f"{remote}: not in the sandbox")
        if host.is_dir():
            shutil.copytree(host, local, dirs_exist_ok=True, symlinks=True)  # symlinks kept, never followed out
        else:
            Path(local).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(host, local)

    def stop(self) -> None:
        for proc in getattr(self, "daemons", []):
            _kill_daemon(proc, None)  # the cgroup's removal below ends what they started
        if getattr(self, "cgroup", None):
            self.cgroup.remove()
            self.cgroup = None
        if getattr(self, "work", None) and self.work.exists():
            _release_work(self.work, getattr(self, "mounted", False))

    def _end_daemon(self, proc: subprocess.Popen) -> None:
        _kill_daemon(proc, None)  # its PID namespace, and all the agent ran in it, ends with it

    # -- helpers --------------------------------------------------------------

    def _exec_argv(self, command: str) -> list[str]:
        """One exec: a fresh bwrap running `bash -c command`."""
        return [*self._bwrap_argv(), "bash", "-c", command]

    def _ids(self, user: str | int | None) -> tuple[int, int, str]:
        """(uid, gid, home) of `user` in this sandbox's root (None: the image's USER)."""
        if user not in self._users:
            try:
                self._users[user] = user_ids(self.rootfs, str(user), str(self.task.path / "task.toml"))
            except DockerfileError as err:  # the task names a user its image lacks: not the agent's doing
                raise SandboxError(str(err).replace("USER ", "user ", 1)) from err
        return self._users[user]

    def _bwrap_argv(self) -> list[str]:
        uid, gid, home = self._ids(self.user)
        argv = ["bwrap", "--ro-bind", str(self.rootfs), "/"]
        for path in self.writable:
            argv += ["--bind", str(self.work / path.lstrip("/")), path]
        for host, path in self.provision.mounts if self.provision else []:
            argv += ["--ro-bind", str(host), path]
        if self.verifying:  # after the agent's writable paths, so these lie over them
            for path, host in self.verifier_dirs.items():
                argv += ["--bind", str(host), path]
            argv += ["--ro-bind", str(RUNTIME), RUNTIME_MOUNT]
        argv += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--unshare-all",
            "--unshare-user",
            "--uid",
            str(uid),
            "--gid",
            str(gid),
        ]
        if self.task.network_mode == "public" and self.settings.allow_network:
            argv.append(
                "--share-net"
            )  # the task allows the network; "allowlist" cannot be enforced here, so it has none
        argv += ["--die-with-parent", "--new-session", "--chdir", self.workdir, "--clearenv"]
        env = {"PATH": PATH, "HOME": home, "LANG": "C.UTF-8", "TERM": "xterm", **self.env.env}
        for key, value in env.items():
            argv += ["--setenv", key, value]
        return argv

    def _join_cgroup(self, group: Cgroup | None = None) -> list[str]:
        """A tiny shell prefix that moves itself into the sandbox's cgroup (or `group`), then execs bwrap."""
        group = group or self.cgroup
        if not group:
            return []
        joins = "; ".join(f'echo $$ > "{f}"' for f in group.procs_files)
        return ["sh", "-c", f'{joins}; exec "$@"', "sh"]

    def _rlimits(self) -> list[str]:
        """prlimit(1) prefix: the cgroup is the real limit; these bound one file and core dumps."""
        disk = self.limits.disk_mb * 2**20
        argv = ["prlimit", f"--fsize={disk}", "--core=0"]
        if not self.cgroup:  # no cgroup: fall back to per-process memory limits
            argv.append(f"--as={self.limits.memory_mb * 2**20}")
        return [*argv, "--"]

    def _kill(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.cgroup and not self.keep_processes:
            self.cgroup.kill_all()

    def _host_path(self, remote: str) -> Path:
        """Map a sandbox path to the host, refusing anything outside the writable mounts."""
        norm = os.path.normpath(remote if remote.startswith("/") else f"{self.workdir}/{remote}")
        for path, host in self.verifier_dirs.items() if self.verifying else ():
            if norm == path or norm.startswith(path + "/"):
                return agent_state.inside(host / os.path.relpath(norm, path), host, remote)
        for root in self.writable:
            if norm == root or norm.startswith(root + "/"):
                host = self.work / norm.lstrip("/")
                real_root = (self.work / root.lstrip("/")).resolve()
                parent = host.parent.resolve()  # a symlink planted by the agent must not lead out
                if parent != real_root and real_root not in parent.parents and host != real_root:
                    raise SandboxError(f"{remote}: resolves outside the sandbox")
                return host
        raise SandboxError(f"{remote}: only {', '.join(self.writable)} are writable in a bwrap sandbox")


def _starts_service(task, settings) -> bool:
    """Whether the task's image starts a service (an environment that cannot be built starts none: start says why)."""
    from tbexp.sandboxes.base import EnvironmentBuildError

    try:
        start = bwrap_environment(task, settings).start
    except EnvironmentBuildError:
        return False
    return bool(start and start.service_argv())


def _read_capped(proc: subprocess.Popen, timeout_s: float, limit: int, kill) -> tuple[bytes, bool, bool]:
    """Read a process's output until it exits, killing it on time-out or past `limit` bytes."""
    chunks, size = [], 0
    timed_out = truncated = False
    deadline = time.monotonic() + timeout_s
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                kill(proc)
                break
            if not sel.select(remaining):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                truncated = True
                kill(proc)
                break
    proc.stdout.close()
    return b"".join(chunks)[:limit], timed_out, truncated


def _read_until_marker(proc: subprocess.Popen, marker: bytes, timeout_s: float, limit: int) -> tuple[bytes, int | None]:
    """A daemon command's output up to "<marker> <code>" and that exit code; None for the code on time-out.

    The pipe is closed once the marker is read: a daemon that kept it open gets EPIPE, never a host reader."""
    data = b""
    deadline = time.monotonic() + timeout_s
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while (remaining := deadline - time.monotonic()) > 0:
            if not sel.select(remaining):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # the bwrap ended before the marker: it failed to start
            data = (data + chunk)[-(limit + len(marker) + 32) :]
            head, found, tail = data.rpartition(b"\n" + marker + b" ")
            if found and tail.endswith(b"\n") and tail.strip().lstrip(b"-").isdigit():
                proc.stdout.close()
                return head[:limit], int(tail)
    proc.stdout.close()
    return data[:limit], None


def _kill_daemon(proc: subprocess.Popen, group: Cgroup | None) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if group:
        group.kill_all()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _copy_in(local: Path, host: Path) -> None:
    """Copy `local` onto `host` inside a sandbox's work dir, never through what the sandbox put there.

    The host does the copy, so a symlink the agent planted on the way (`/tests/test.sh -> /etc/passwd`)
    would lead the write out of the sandbox: it is removed, as is a file where a directory goes.
    """
    if host.is_symlink() or (host.exists() and host.is_dir() != local.is_dir()):
        shutil.rmtree(host) if host.is_dir() and not host.is_symlink() else host.unlink()
    if local.is_dir() and not local.is_symlink():
        host.mkdir(exist_ok=True)
        for child in local.iterdir():
            _copy_in(child, host / child.name)
    else:
        shutil.copy2(local, host, follow_symlinks=False)


def _seed(image_dir: Path, sandbox_dir: Path) -> None:
    """What the image holds in a writable path, copied in; owned by the sandbox's one mapped user, as the
    container's copy would be writable by the image's user (the owners the image gave are not kept)."""
    if image_dir.is_dir() and not image_dir.is_symlink() and any(image_dir.iterdir()):
        shutil.copytree(image_dir, sandbox_dir, symlinks=True, dirs_exist_ok=True)


def _mount_tmpfs(path: Path, size_mb: int) -> bool:
    """A private tmpfs so the sandbox's disk use is capped; plain directory when not root."""
    if os.geteuid() != 0:
        return False
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=755", "tbexp-sandbox", str(path)], capture_output=True
    )
    return result.returncode == 0


def _release_work(work: Path, mounted: bool) -> None:
    if mounted:
        subprocess.run(["umount", "-l", str(work)], capture_output=True)
    shutil.rmtree(work, ignore_errors=True)


def _reap_once() -> None:
    """Remove what sandboxes of dead tbexp processes left behind (mounts, dirs, cgroups)."""
    global _reaped
    if _reaped:
        return
    _reaped = True
    for cgroup in leftover_cgroups():
        owner = cgroup.dirs[0].name.split("-")[0]
        if owner.isdigit() and not _alive(int(owner)):
            cgroup.remove()
    if WORK_PARENT.is_dir():
        for work in WORK_PARENT.iterdir():
            owner = work.name.split("-")[0]
            if owner.isdigit() and not _alive(int(owner)):
                _release_work(work, os.path.ismount(work))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _spawn(argv: list[str]) -> subprocess.Popen:
    """Start a bwrap (its own session, so a kill reaches its whole process group), output and errors in one pipe."""
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=launcher_env(),
        )
    except OSError as err:
        raise SandboxError(f"cannot start bwrap: {err}") from err
