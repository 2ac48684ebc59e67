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
exits, the kernel kills everything left in it. Process count and memory are
capped by a cgroup of the sandbox's own. Shell state that a terminal would keep
between commands (cwd, exported variables) is carried by the agents'
`ShellSession`, not here.
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

from tbexp.sandboxes import provision
from tbexp.sandboxes.base import OUTPUT_LIMIT_EXIT, TIMEOUT_EXIT, ExecResult, Sandbox, SandboxError
from tbexp.sandboxes.cgroup import Cgroup, leftover_cgroups
from tbexp.sandboxes.environments import bwrap_environment

WRITABLE = ("/app", "/tmp", "/root", "/logs", "/tests", "/solution")
WORK_PARENT = Path(tempfile.gettempdir()) / "tbexp-sandboxes"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_reaped = False


class BwrapSandbox(Sandbox):
    writable = WRITABLE  # the sandbox's own paths; a non-root USER's home joins them at start

    @classmethod
    def prepare(cls, settings, task) -> None:
        bwrap_environment(task, settings)

    def start(self) -> None:
        _reap_once()
        s = self.settings
        if shutil.which("bwrap") is None:
            raise SandboxError("bwrap not found: apt-get install bubblewrap (scripts/setup.sh does it)")
        self.env = bwrap_environment(self.task, s)
        self.rootfs = self.env.root
        if not (self.rootfs / "usr/bin/python3").exists():
            raise SandboxError(f"sandbox.rootfs={self.rootfs} holds no root file system: run scripts/build_rootfs.sh")
        self.id = f"{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.work = WORK_PARENT / self.id
        self.work.mkdir(parents=True)
        self.mounted = _mount_tmpfs(self.work, s.disk_mb)
        self.writable = WRITABLE
        home = os.path.normpath(self.env.home)
        if (
            self.env.uid
            and (self.rootfs / home.lstrip("/")).is_dir()
            and not any(home == w or home.startswith(w + "/") for w in WRITABLE)
        ):
            self.writable = (*WRITABLE, home)  # a USER's home is writable too, as in its container
        for path in self.writable:
            (self.work / path.lstrip("/")).mkdir(mode=0o755 if path != "/tmp" else 0o1777, parents=True)
            if self.env.seeded:
                _seed(self.rootfs / path.lstrip("/"), self.work / path.lstrip("/"))
        self.cgroup = Cgroup.create(self.id, s.pids_limit, s.memory_mb * 2**20)
        workdir = self.env.workdir if self.env.workdir != "/" else self.task.workdir
        self.workdir = workdir
        for source, dest in self.env.copies:
            self.upload(source, dest if dest.startswith("/") else f"{workdir}/{dest}")
        # What a TB2 test.sh would download (uv, its wheels), bound read-only: see provision.py.
        self.provision = provision.prepare(self.task)
        if self.provision:
            self.provision = self.provision.with_interpreters(provision.interpreters_in_root(self.rootfs))

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        timeout_s = self.settings.command_timeout_s if timeout_s is None else timeout_s
        argv = [*self._join_cgroup(), *self._rlimits(), *self._bwrap_argv(), "bash", "-c", command]
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as err:
            raise SandboxError(f"cannot start bwrap: {err}") from err
        output, timed_out, truncated = _read_capped(proc, timeout_s, self.settings.output_limit_bytes, self._kill)
        code = proc.wait()
        if self.cgroup:
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
        if getattr(self, "cgroup", None):
            self.cgroup.remove()
            self.cgroup = None
        if getattr(self, "work", None) and self.work.exists():
            _release_work(self.work, getattr(self, "mounted", False))

    # -- helpers --------------------------------------------------------------

    def _bwrap_argv(self) -> list[str]:
        argv = ["bwrap", "--ro-bind", str(self.rootfs), "/"]
        for path in self.writable:
            argv += ["--bind", str(self.work / path.lstrip("/")), path]
        for host, path in self.provision.mounts if self.provision else []:
            argv += ["--ro-bind", str(host), path]
        argv += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--unshare-all",
            "--unshare-user",
            "--uid",
            str(self.env.uid),
            "--gid",
            str(self.env.gid),
        ]
        if self.task.network_mode == "public" and self.settings.allow_network:
            argv.append(
                "--share-net"
            )  # the task allows the network; "allowlist" cannot be enforced here, so it has none
        argv += ["--die-with-parent", "--new-session", "--chdir", self.workdir, "--clearenv"]
        env = {"PATH": PATH, "HOME": self.env.home, "LANG": "C.UTF-8", "TERM": "xterm", **self.env.env}
        for key, value in env.items():
            argv += ["--setenv", key, value]
        return argv

    def _join_cgroup(self) -> list[str]:
        """A tiny shell prefix that moves itself into the sandbox's cgroup, then execs bwrap."""
        if not self.cgroup:
            return []
        joins = "; ".join(f'echo $$ > "{f}"' for f in self.cgroup.procs_files)
        return ["sh", "-c", f'{joins}; exec "$@"', "sh"]

    def _rlimits(self) -> list[str]:
        """prlimit(1) prefix: the cgroup is the real limit; these bound one file and core dumps."""
        disk = self.settings.disk_mb * 2**20
        argv = ["prlimit", f"--fsize={disk}", "--core=0"]
        if not self.cgroup:  # no cgroup: fall back to per-process memory limits
            argv.append(f"--as={self.settings.memory_mb * 2**20}")
        return [*argv, "--"]

    def _kill(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.cgroup:
            self.cgroup.kill_all()

    def _host_path(self, remote: str) -> Path:
        """Map a sandbox path to the host, refusing anything outside the writable mounts."""
        norm = os.path.normpath(remote if remote.startswith("/") else f"{self.workdir}/{remote}")
        for root in self.writable:
            if norm == root or norm.startswith(root + "/"):
                host = self.work / norm.lstrip("/")
                real_root = (self.work / root.lstrip("/")).resolve()
                parent = host.parent.resolve()  # a symlink planted by the agent must not lead out
                if parent != real_root and real_root not in parent.parents and host != real_root:
                    raise SandboxError(f"{remote}: resolves outside the sandbox")
                return host
        raise SandboxError(f"{remote}: only {', '.join(self.writable)} are writable in a bwrap sandbox")


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
