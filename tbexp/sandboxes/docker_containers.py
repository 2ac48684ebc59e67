"""Docker sandbox containers: made with limits, ended by their own timer, reaped when their owner dies.

The container has no network (the host's, where the task allows it), a CPU quota, memory (swap included) and
process-count limits, and its main process is a bash loop that sleeps until
`max_lifetime_s` has passed, reaping orphans meanwhile; it then exits and the
engine removes the container (auto-remove), so a dead tbexp leaves nothing
behind for long. (It is the container's entrypoint too: an image's own ENTRYPOINT
is started as its service by the sandbox, image_start.py, never as PID 1.) Two
more guards remove containers sooner: the first start in a process removes
labelled containers whose owner process (same host) is gone, and a detached
watchdog process, started once per process, removes the owner's containers as
soon as the owner dies, even by SIGKILL. Both remove the owner's labelled
networks too (a multi-container task's episode network, compose.py), and the
service containers on them, which carry the same labels but no timer of their own.

What is simplified: a container's writable layer is capped at `disk_mb` only
where the engine supports `--storage-opt size` (overlay2 on XFS with project
quotas); the first refusal is remembered and later containers are made
without it. On kernels without XFS quotas (this project's VMs) only the
engine's data root as a whole is bounded: scripts/start_dockerd.sh puts it on
a loop file system, so a sandbox that fills its disk can fail other
sandboxes' writes until it is stopped, but never fills the host's. Any one
file is capped at `disk_mb` (RLIMIT_FSIZE, set by docker.py's exec wrapper)
in either case.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import docker

from tbexp.sandboxes.base import Limits, SandboxError
from tbexp.sandboxes.docker_images import ENGINE_ERRORS

log = logging.getLogger(__name__)

LABEL = "tbexp.sandbox"
HOST = socket.gethostname()
# PID 1: sleep in a child so that `wait` reaps every orphan; a killed sleep is restarted.
KEEPER = "exec 2>/dev/null; end=$((SECONDS + {lifetime_s})); while ((SECONDS < end)); do sleep $((end - SECONDS)) & wait $!; done"
# Runs detached from its parent's session; removes the parent's containers once the parent is gone.
WATCHDOG = """
import os, sys, time
parent, host = int(sys.argv[1]), sys.argv[2]
while os.getppid() == parent:
    time.sleep(0.5)
import docker
api = docker.APIClient(version="auto", **docker.utils.kwargs_from_env())
labels = ["tbexp.sandbox=1", f"tbexp.owner_pid={parent}", f"tbexp.owner_host={host}"]
for container in api.containers(all=True, filters={"label": labels}):
    try:
        api.remove_container(container["Id"], force=True)
    except docker.errors.APIError:
        pass
for network in api.networks(filters={"label": labels}):
    try:
        api.remove_network(network["Id"])
    except docker.errors.APIError:
        pass
"""

_guard_lock = threading.Lock()  # guards _guarded_pid and _watchdog
_guarded_pid = 0  # the process whose leftovers were reaped and whose watchdog runs
_watchdog: subprocess.Popen | None = None
_storage_opt_ok: bool | None = None  # None until the engine has been asked


def _container_options(
    settings, task_name: str, workdir: str, env: dict[str, str], network: bool = False, limits: Limits | None = None
) -> dict:
    """`create_container` arguments for one episode's container; `host_config` and `disk_mb` as plain values.

    `limits`: the task's memory, disk and cpus (base.task_limits); None: the `sandbox` node's.

    `network`: the task allows it (network_mode "public"). The engine runs with no bridge, so that is the
    host's network; "allowlist" cannot be enforced here and gets none.
    """
    limits = limits or Limits(int(settings.memory_mb), int(settings.disk_mb), None)
    safe_name = re.sub(r"[^a-zA-Z0-9_.-]+", "-", task_name).strip("-.")[:40] or "task"
    return dict(
        entrypoint=["bash", "-c", KEEPER.format(lifetime_s=max(1, int(settings.max_lifetime_s)))],
        command=[],
        name=f"tbexp-{safe_name}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        working_dir=workdir,
        environment=env,
        labels={**owner_labels(), "tbexp.task": task_name},
        network_disabled=not network,
        host_config=dict(
            network_mode="host" if network else "none",
            nano_cpus=int((limits.cpus or settings.cpus) * 1e9),
            mem_limit=f"{limits.memory_mb}m",
            memswap_limit=f"{limits.memory_mb}m",
            pids_limit=settings.pids_limit,
            ulimits=[docker.types.Ulimit(name="core", soft=0, hard=0)],
            auto_remove=True,
        ),
        disk_mb=limits.disk_mb,
    )


def owner_labels() -> dict[str, str]:
    """What marks a container or network as this process's sandbox (the reaper and the watchdog read them)."""
    return {
        LABEL: "1",
        "tbexp.owner_pid": str(os.getpid()),
        "tbexp.owner_host": HOST,
        "tbexp.owner_start": _start_time(os.getpid()),
    }


def _create_container(api: docker.APIClient, image: str, options: dict) -> str:
    """Create the container, with a disk cap where the engine supports one."""
    global _storage_opt_ok
    options = dict(options)
    disk_mb, host = options.pop("disk_mb"), options.pop("host_config")
    if _storage_opt_ok is None:
        _storage_opt_ok = api.info().get("Driver") == "overlay2"  # other drivers count the image in `size`
    if _storage_opt_ok:
        try:
            config = api.create_host_config(**host, storage_opt={"size": f"{disk_mb}M"})
            return api.create_container(image, host_config=config, **options)["Id"]
        except docker.errors.APIError as err:
            if "storage-opt" not in str(err) and "quota" not in str(err):
                raise
            log.info("the engine cannot cap container disks (%s); the writable layer is unbounded", err.explanation)
            _storage_opt_ok = False
    return api.create_container(image, host_config=api.create_host_config(**host), **options)["Id"]


# -- leftovers ----------------------------------------------------------------


def _guard_process(api: docker.APIClient) -> None:
    """Once per process: remove dead owners' containers, and start this process's watchdog."""
    global _guarded_pid, _watchdog
    with _guard_lock:
        if _guarded_pid == os.getpid():
            return
        _guarded_pid = os.getpid()
        _watchdog = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, str(os.getpid()), HOST],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a signal to the owner's process group spares it
        )
    mine = {"label": [f"{LABEL}=1", f"tbexp.owner_host={HOST}"]}
    _reap(
        api, "containers", lambda: api.containers(all=True, filters=mine), lambda i: api.remove_container(i, force=True)
    )
    _reap(api, "networks", lambda: api.networks(filters=mine), api.remove_network)  # after their containers


def _reap(api: docker.APIClient, kind: str, listed, remove) -> None:
    """Remove each listed container or network whose owner process is gone."""
    try:
        leftovers = listed()
    except ENGINE_ERRORS as err:
        raise SandboxError(f"cannot list {kind}: {err}") from err
    for item in leftovers:
        labels = item.get("Labels") or {}
        owner = labels.get("tbexp.owner_pid", "")
        if owner.isdigit() and not _alive(int(owner), labels.get("tbexp.owner_start", "")):
            try:
                remove(item["Id"])
            except ENGINE_ERRORS:
                pass  # another process reaping at the same time (or a network still being emptied)


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' where /proc cannot tell)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name


def _alive(pid: int, start_time: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not start_time or _start_time(pid) in ("", start_time)  # a reused pid is not the owner
