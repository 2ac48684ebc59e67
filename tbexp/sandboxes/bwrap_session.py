"""A bubblewrap sandbox whose processes live on between execs, as a container's do.

`BwrapSandbox` gives every exec a fresh bwrap and kills what it leaves, so a
background process (terminus-2's tmux server) cannot survive to the next
command. Here `start` launches one long-lived bwrap (its init just sleeps)
that holds the sandbox's namespaces, and each `exec` enters them with
`nsenter` (user, mount, PID, network, IPC, UTS; the init's root; the
sandbox's working directory, user and environment) instead of starting a new
bwrap. What a command starts stays in the sandbox's PID namespace until
`stop`, which kills the init and with it everything else in the namespace,
then the cgroup. Limits are the same cgroup and prlimit as BwrapSandbox's.
A task whose image starts a service (ENTRYPOINT/CMD, image_start.py) runs in this sandbox whatever `sandbox._target_`
says (`BwrapSandbox.for_task`): the service is started at `start`, before the agent, and its network, processes and
files are the later execs' own, as in the image's container.

The verifier's execs (`begin_verification`, after every agent process is gone) are not entered into the shared
namespaces: each is a fresh bwrap of its own (BwrapSandbox's), joined only to the sandbox's network namespace, so
a mount the agent made there (it is root of that user namespace) is not under the tests.

Simplified: a command run as another user than the sandbox's (`as_user`) gets a bwrap of its own over the
same root, since the holder's user namespace maps one user; a command that times out or prints too much has its own process
group killed, not the whole sandbox (what it started in a new session, like a
daemon, lives on, as in a container); the sandbox's environment variables
are set per exec, as `bwrap --setenv` sets them.
"""

from __future__ import annotations

import json
import os
import selectors
import shlex
import shutil
import signal
import subprocess

from tbexp.sandboxes.base import SandboxError, launcher_env
from tbexp.sandboxes.bwrap import PATH, BwrapSandbox
from tbexp.sandboxes.image_start import start_service

HOLDER_START_TIMEOUT_S = 10.0  # how long the holding bwrap may take to report its init's pid


class BwrapSessionSandbox(BwrapSandbox):
    """`sandbox._target_=tbexp.sandboxes.bwrap_session.BwrapSessionSandbox`: bwrap with processes kept."""

    keep_processes = True

    def start(self) -> None:
        super().start()
        if shutil.which("nsenter") is None:
            raise SandboxError("nsenter not found: apt-get install util-linux")
        read_fd, write_fd = os.pipe()
        argv = [*self._join_cgroup(), *self._rlimits(), *self._bwrap_argv()]
        argv[argv.index("bwrap") + 1 : argv.index("bwrap") + 1] = ["--info-fd", str(write_fd)]
        try:
            self.holder = subprocess.Popen(  # says "ready" once bwrap has set the sandbox up and run it
                [*argv, "bash", "-c", "echo ready; exec sleep infinity"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                start_new_session=True,
                env=launcher_env(),
            )
        finally:
            os.close(write_fd)
        self.init_pid = _read_child_pid(read_fd, self.holder)
        # bwrap reports the pid before it has mounted the sandbox's file systems: an exec entering the namespaces
        # earlier would see them half built.
        if not _wait_ready(self.holder):
            self.holder.kill()
            output = self.holder.communicate()[0].decode(errors="replace")
            raise SandboxError(f"the sandbox's init did not start: {output[-500:]}")
        self.service = start_service(self, self.env.start)  # the image's own daemon, before anything else runs

    def start_daemon(self, command: str, timeout_s: float | None = None):
        return self.exec(command, timeout_s)  # what an exec starts lives on here anyway

    def _exec_argv(self, command: str) -> list[str]:
        if self.verifying:
            # The verifier gets a fresh bwrap: a mount namespace of its own (nothing the agent mounted in the
            # shared one), in the sandbox's network namespace (the environment's services still answer).
            argv = super()._exec_argv(command)
            at = argv.index("--unshare-all") + 1
            argv[at:at] = [] if "--share-net" in argv else ["--share-net"]
            return ["nsenter", f"--net=/proc/{self.init_pid}/ns/net", "--", *argv]
        uid, gid, home = self._ids(self.user)  # the current user (as_user), as bwrap's own execs take it
        if (uid, gid) != self._ids(None)[:2]:
            # The holder's user namespace maps the sandbox's one user; another user's command gets a bwrap of its
            # own over the same root (what it starts in the background does not outlive that command).
            return super()._exec_argv(command)
        env = {"PATH": PATH, "HOME": home, "LANG": "C.UTF-8", "TERM": "xterm", **self.env.env}
        enter = ["nsenter", "-t", str(self.init_pid), "-U", "-m", "-p", "-n", "-i", "-u", "-r"]  # the init's root
        enter += ["-S", str(uid), "-G", str(gid)]
        # bwrap's init keeps the host's cwd. On the command's first line, so bash reports its line numbers as bwrap's.
        script = f"cd -- {shlex.quote(self.workdir)} || exit 1; {command}"
        return [*enter, "env", "-i", *(f"{k}={v}" for k, v in env.items()), "bash", "-c", script]

    def _inits(self) -> set[int]:
        return {self.init_pid}  # an agent's daemon reparented to the sandbox's init is still the agent's

    def stop(self) -> None:
        holder = getattr(self, "holder", None)
        if holder is not None:
            try:
                os.killpg(holder.pid, signal.SIGKILL)  # the init goes, and the kernel ends its namespace with it
            except ProcessLookupError:
                pass
            holder.wait()
            holder.stdout.close()
            self.holder = None
        if getattr(self, "cgroup", None):
            self.cgroup.kill_all()
        super().stop()


def _wait_ready(holder: subprocess.Popen) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(holder.stdout, selectors.EVENT_READ)
        return bool(sel.select(HOLDER_START_TIMEOUT_S)) and holder.stdout.readline() == b"ready\n"


def _read_child_pid(read_fd: int, holder: subprocess.Popen) -> int:
    """bwrap's --info-fd JSON names the host pid of the sandbox's first process."""
    chunks = []
    with selectors.DefaultSelector() as sel, os.fdopen(read_fd, "rb") as info:
        sel.register(info, selectors.EVENT_READ)
        while b"}" not in b"".join(chunks):
            if not sel.select(HOLDER_START_TIMEOUT_S):
                break
            chunk = info.read1(4096)
            if not chunk:
                break
            chunks.append(chunk)
    try:
        return int(json.loads(b"".join(chunks))["child-pid"])
    except (ValueError, KeyError) as err:
        holder.kill()
        output = holder.communicate()[0].decode(errors="replace")
        raise SandboxError(f"bwrap did not start the sandbox's init: {output[-500:]}") from err
