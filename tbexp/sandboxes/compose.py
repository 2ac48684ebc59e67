"""Multi-container tasks in `sandbox=docker`: the services of `environment/docker-compose.yaml`, through the docker SDK.

Debian 12 packages only Compose 1.29 (Harbor shells out to v2), so tbexp reads the file itself (compose_file.py) and
runs its services with the engine's API, per episode:

1. `ComposeProject.up()` makes an **internal network of the episode's own** (a bridge with no IPv4 address on the
   host side and no gateway out: the containers reach each other and nothing else), then starts every service other
   than `main` in `depends_on` order (their images built once per content, or found: nothing is pulled), waiting for
   each condition (`service_started`, `service_healthy` by the engine's own healthcheck,
   `service_completed_successfully`);
2. the sandbox creates `main` on that network (alias `main`) with the compose file's `environment`, and starts its
   `command`/`entrypoint` as the image's service (image_start.py; `start_project` gives it all);
3. `down()` removes every container and the network when the sandbox stops.

Every container and the network carry the sandbox labels (`tbexp.sandbox`, the owner's pid and host), so the
watchdog and the reaper of docker_containers.py remove them when their owner dies, and the leak checks count them.
Simplified: a service gets the sandbox node's memory limit and at least 256 processes, not its compose `deploy`
limits; a task whose network_mode is "public" still runs on the internal network (no route out).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import tarfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import docker

from tbexp.sandboxes.base import MissingImageError, SandboxError
from tbexp.sandboxes.compose_file import MAIN, Service, compose_file, order, read_compose

log = logging.getLogger(__name__)

NETWORK_OPTIONS = {"com.docker.network.bridge.inhibit_ipv4": "true"}  # no host address on the bridge: no way out
READY_TIMEOUT_S = 300.0  # a dependency that is neither healthy nor failed by then fails the start


class ComposeProject:
    """One episode's services other than main, and their network; `up()` before main starts, `down()` after."""

    def __init__(self, api: docker.APIClient, task: Any, settings: Any, services: dict[str, Service], labels: dict):
        self.api, self.task, self.settings, self.services = api, task, settings, services
        self.labels = {**labels, "tbexp.compose": "1"}
        self.network = f"tbexp-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.containers: dict[str, str] = {}  # service -> container id
        self.network_id = ""

    def up(self) -> None:
        """The network, then every service but main in depends_on order, each dependency's condition met first."""
        self.network_id = self.api.create_network(
            self.network, driver="bridge", internal=True, options=NETWORK_OPTIONS, labels=self.labels
        )["Id"]
        for name in order(self.services):
            if name == MAIN:
                break
            self._wait_for(self.services[name].depends_on)
            self._start(self.services[name])
        self._wait_for(self.services[MAIN].depends_on)

    def main_options(self, options: dict) -> dict:
        """The main container's `create_container` options joined to the episode's network, with compose's env."""
        main = self.services[MAIN]
        options = dict(options, network_disabled=False, environment={**options["environment"], **main.environment})
        options["host_config"] = dict(options["host_config"], network_mode=self.network)
        options["networking_config"] = self.api.create_networking_config(
            {self.network: self.api.create_endpoint_config(aliases=[MAIN])}
        )
        options["hostname"] = main.hostname or MAIN
        return options

    def down(self) -> None:
        for cid in self.containers.values():
            try:
                self.api.remove_container(cid, force=True)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as err:
                log.warning("could not remove a service container %s: %s", cid[:12], err)
        self.containers.clear()
        if self.network_id:
            try:
                self.api.remove_network(self.network_id)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as err:
                log.warning("could not remove the episode network %s: %s", self.network, err)
            self.network_id = ""

    def _start(self, service: Service) -> None:
        healthcheck = None
        if service.healthcheck_disabled:
            healthcheck = {"test": ["NONE"]}
        elif service.healthcheck:
            h = service.healthcheck
            healthcheck = {
                "test": h.test,
                "interval": int(h.interval_s * 1e9),
                "timeout": int(h.timeout_s * 1e9),
                "retries": h.retries,
                "start_period": int(h.start_period_s * 1e9),
            }
        host_config = self.api.create_host_config(
            network_mode=self.network,
            mem_limit=f"{self.settings.memory_mb}m",
            pids_limit=max(int(self.settings.pids_limit), 256),  # a database needs more threads than an agent shell
            ulimits=[docker.types.Ulimit(name="core", soft=0, hard=0)],
        )
        cid = self.api.create_container(
            service.image,
            command=service.command,
            entrypoint=service.entrypoint,
            environment=service.environment,
            working_dir=service.working_dir or None,
            user=service.user or None,
            hostname=service.hostname or service.name,
            healthcheck=healthcheck,
            labels={**self.labels, "tbexp.service": service.name},
            name=f"{self.network}-{re.sub(r'[^a-zA-Z0-9_.-]+', '-', service.name)}",
            host_config=host_config,
            networking_config=self.api.create_networking_config(
                {self.network: self.api.create_endpoint_config(aliases=[service.name])}
            ),
        )["Id"]
        self.containers[service.name] = cid
        for local, target in service.copies:
            self.api.put_archive(cid, "/", _archive(local, target))
        self.api.start(cid)

    def _wait_for(self, depends_on: dict[str, str]) -> None:
        for name, condition in depends_on.items():
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                state = self.api.inspect_container(self.containers[name])["State"]
                health = (state.get("Health") or {}).get("Status")
                if condition == "service_started" and state.get("Running"):
                    break
                if condition == "service_healthy" and health == "healthy":
                    break
                if condition == "service_healthy" and not health:
                    raise SandboxError(f"service {name!r} has no healthcheck, so it can never be service_healthy")
                if condition == "service_completed_successfully" and not state.get("Running"):
                    if state.get("ExitCode") == 0:
                        break
                    raise SandboxError(f"service {name!r} exited {state.get('ExitCode')}: {self._logs(name)}")
                if health == "unhealthy" or (
                    not state.get("Running") and condition != "service_completed_successfully"
                ):
                    raise SandboxError(f"service {name!r} is {health or 'not running'}: {self._logs(name)}")
                if time.monotonic() > deadline:
                    raise SandboxError(f"service {name!r} was not {condition} after {READY_TIMEOUT_S:g} s")
                time.sleep(0.25)

    def _logs(self, name: str) -> str:
        try:
            return self.api.logs(self.containers[name], tail=20).decode(errors="replace")[-800:]
        except docker.errors.APIError:
            return ""


def _archive(local: Path, target: str) -> io.BytesIO:
    """A tar holding `local` (a file or folder of the task) at `target`, owned by root, for put_archive at '/'."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        tar.add(local, arcname=target.lstrip("/"), filter=lambda info: info.replace(uid=0, gid=0, uname="", gname=""))
    data.seek(0)
    return data


def start_project(api: docker.APIClient, task: Any, settings: Any, image: str, options: dict) -> tuple:
    """(the started project or None, main's container options, its ImageStart, its command) for DockerSandbox.start.

    For a task without a compose file: no project, the options as given, the image's own start and no command. The
    engine's own healthcheck of main is off: the sandbox waits for it itself, once it has started the service.
    """
    from tbexp.sandboxes.docker_containers import owner_labels
    from tbexp.sandboxes.image_start import ImageStart

    start = ImageStart.from_docker(api.inspect_image(image)["Config"] or {})
    options = dict(options, healthcheck={"test": ["NONE"]})
    if not compose_file(task):
        return None, options, start, None
    services = read_compose(task, image)
    ensure_service_images(api, services, task)
    project = ComposeProject(api, task, settings, services, owner_labels())
    try:
        project.up()
    except BaseException:
        project.down()
        raise
    main = services[MAIN]
    if main.entrypoint is not None:
        start.entrypoint = main.entrypoint or None
    if main.healthcheck or main.healthcheck_disabled:
        start.healthcheck = main.healthcheck
    return project, project.main_options(options), start, main.command


# -- images ----------------------------------------------------------------------------------------------------


def ensure_service_images(api: docker.APIClient, services: dict[str, Service], task: Any) -> None:
    """Build (once per content) or find every service's image but main's; nothing is pulled."""
    from tbexp.sandboxes.docker_images import DEFAULT_BUILD_TIMEOUT_S, _build, has_image

    timeout_s = float(getattr(task, "build_timeout_s", 0) or DEFAULT_BUILD_TIMEOUT_S)
    for service in services.values():
        if service.name == MAIN:
            continue
        if not service.build:
            if not has_image(api, service.image):
                raise MissingImageError(
                    f"{compose_file(task)}: services.{service.name}.image {service.image} is not on this engine and "
                    "no registry can be reached; build it locally, or give the service a `build`"
                )
            continue
        tag = f"tbexp-service:{_build_hash(api, service.build)}"
        with _build_lock(tag):  # episodes starting at once build a service's image once
            if not has_image(api, tag):
                source = dict(path=str(service.build["context"]), dockerfile=service.build["dockerfile"])
                if service.build["args"]:
                    source["buildargs"] = service.build["args"]
                if service.build["target"]:
                    source["target"] = service.build["target"]
                _build(api, source, tag, task.name, timeout_s, f"{compose_file(task)}: services.{service.name}.build")
        service.image = tag


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _build_lock(tag: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(tag, threading.Lock())


def _build_hash(api: docker.APIClient, build: dict[str, Any]) -> str:
    from tbexp.sandboxes.docker_images import BUILD_VERSION
    from tbexp.sandboxes.dockerfile import context_hash

    h = hashlib.sha256(f"{BUILD_VERSION}\0{context_hash(build['context'])}".encode())
    h.update(json.dumps({k: v for k, v in build.items() if k != "context"}, sort_keys=True).encode())
    dockerfile = build["context"] / build["dockerfile"]
    images = re.findall(r"(?im)^\s*FROM\s+(?:--\S+\s+)*(\S+)", dockerfile.read_text()) if dockerfile.is_file() else []
    for image in images:
        try:
            h.update(api.inspect_image(image)["Id"].encode())
        except docker.errors.ImageNotFound:
            h.update(image.encode())  # a stage name, or an image the build then reports missing
    return h.hexdigest()[:16]
