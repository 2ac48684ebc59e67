"""The Docker engine client, and the task images built on it (for `sandbox=docker`, see docker.py).

The image is built from the task's `environment/Dockerfile` (context
`environment/`, legacy builder, the host's network so RUN steps reach the
package registries: the engine runs with `--bridge=none`, so host is the only
network a build can have) and tagged by a hash of that directory plus the ids
of the local images it starts FROM, so an environment shared by many tasks is
built once per engine; threads that need the same tag wait on one lock. A
second, one-line build adds tmux, python3 and bash where the image lacks them
(a no-op RUN where it has them). A prebuilt `docker_image` gets only that
second build; one the engine lacks is built from the task's `environment/Dockerfile`
where the task ships it (Terminal-Bench 2.0's tasks do: Harbor's `--force-build`),
and `image_source(tag)` says which was used. Nothing is ever pulled: a FROM image must exist locally
(scripts/build_base_image.sh makes `tbexp-base:bookworm`,
scripts/build_base_images.sh local stand-ins of published base images). A
failed build is an EnvironmentBuildError, remembered for the process.

The directory's hash is kept per process, keyed by each file's path, mtime
and size (dockerfile.context_hash), so a start does not re-read an unchanged
context; the FROM images' ids are asked of the engine every time.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path

import docker
import requests

from tbexp.sandboxes.base import EnvironmentBuildError, MissingImageError, SandboxError
from tbexp.sandboxes.dockerfile import context_hash, read_dockerfile, usable_image

ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException, OSError)

_lock = threading.Lock()  # guards _clients and _tag_locks
_clients: dict[int, docker.APIClient] = {}  # by pid: a forked child needs its own connections
_tag_locks: dict[str, threading.Lock] = {}
builds = {"docker": 0}  # environments this process built (tests count them)
_failed: dict[str, EnvironmentBuildError] = {}  # tag -> why its build failed, in this process
_sources: dict[str, str] = {}  # tag -> where the environment came from (image_source)
BUILD_VERSION = "2"  # part of every tag: bump when what a build adds changes (2: the tools layer)
DEFAULT_BUILD_TIMEOUT_S = 600.0  # Harbor's default build_timeout_sec
STAND_INS = "scripts/build_base_images.sh builds local stand-ins of the common Debian, Ubuntu and python images"
# Every environment tbexp builds has these (terminus-2 drives tmux; verifiers need python3).
TOOLS_CHECK = (
    "command -v tmux >/dev/null && command -v python3 >/dev/null && command -v bash >/dev/null || "
    "(apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends tmux python3 bash "
    "&& rm -rf /var/lib/apt/lists/*)"
)


def _client() -> docker.APIClient:
    pid = os.getpid()
    with _lock:
        if pid not in _clients:
            try:
                api = docker.APIClient(version="auto", max_pool_size=64, timeout=300, **docker.utils.kwargs_from_env())
                api.ping()
            except ENGINE_ERRORS as err:
                raise SandboxError(
                    f"cannot reach the Docker engine ({err}); start it with scripts/start_dockerd.sh"
                ) from err
            _clients[pid] = api
        return _clients[pid]


def _ensure_image(api: docker.APIClient, task, settings) -> str:
    """The tag of the task's image: built (or, for a prebuilt `docker_image`, completed) once per content.

    A build that fails is remembered for the process: every later start of that task fails at once with
    the same EnvironmentBuildError instead of building again. Where a `docker_image` the engine lacks is built
    from its Dockerfile instead and that fails too, the error says both.
    """
    prebuilt, note = usable_image(task, "", lambda image: has_image(api, image))
    try:
        return _ensure_tag(api, task, settings, prebuilt, note)
    except EnvironmentBuildError as err:
        if not note:
            raise
        dockerfile = task.environment_dir / "Dockerfile"
        raise type(err)(
            f"{task.path / 'task.toml'}: docker_image {task.docker_image} is not on this engine and no registry can "
            f"be reached, so {dockerfile} (what it was built from) was built instead, and failed: {err}"
        ) from err


def _ensure_tag(api: docker.APIClient, task, settings, prebuilt: str, note: str) -> str:
    env_dir = task.environment_dir
    dockerfile = env_dir / "Dockerfile"
    if not prebuilt and not dockerfile.is_file():
        raise EnvironmentBuildError(f"{dockerfile}: missing (sandbox=docker builds the task's environment from it)")
    tag = f"tbexp-task:{_prebuilt_hash(api, prebuilt, task) if prebuilt else _content_hash(api, env_dir, settings.base_image)}"
    _sources[tag] = (
        f"docker_image {prebuilt}"
        if prebuilt
        else "environment/Dockerfile" + (f" ({note}; built from the Dockerfile beside it)" if note else "")
    )
    with _lock:
        lock = _tag_locks.setdefault(tag, threading.Lock())
    with lock:
        if tag in _failed:
            raise _failed[tag]
        try:
            api.inspect_image(tag)
            return tag
        except docker.errors.ImageNotFound:
            pass
        except ENGINE_ERRORS as err:
            raise SandboxError(f"cannot reach the Docker engine: {err}") from err
        timeout_s = float(getattr(task, "build_timeout_s", 0) or DEFAULT_BUILD_TIMEOUT_S)
        try:
            base = prebuilt or f"{tag}-dockerfile"
            if not prebuilt:
                _build(api, dict(path=str(env_dir)), base, task.name, timeout_s, dockerfile)
            _build(
                api,
                dict(fileobj=_with_tools(base, api)),
                tag,
                task.name,
                timeout_s,
                f"{dockerfile} (adding tmux, python3, bash)",
            )
        except EnvironmentBuildError as err:
            _failed[tag] = err
            raise
        builds["docker"] += 1
    return tag


def image_source(tag: str) -> str:
    """Where the task image `tag` came from: `docker_image NAME`, or `environment/Dockerfile` (and why)."""
    return _sources.get(tag, "")


def has_image(api: docker.APIClient, image: str) -> bool:
    """Whether the engine holds `image` (nothing is pulled)."""
    try:
        api.inspect_image(image)
        return True
    except docker.errors.ImageNotFound:
        return False
    except ENGINE_ERRORS as err:
        raise SandboxError(f"cannot reach the Docker engine: {err}") from err


def _build(api: docker.APIClient, source: dict, tag: str, task_name: str, timeout_s: float, what) -> None:
    """One `docker build` with the host's network (the engine has no bridge), so steps reach the registries."""
    lines: list[str] = []
    try:
        # timeout: the engine's silence for longer than this ends the build
        events = api.build(
            **source,
            tag=tag,
            network_mode="host",
            rm=True,
            forcerm=True,
            decode=True,
            timeout=timeout_s,
            labels={"tbexp.task": task_name},
        )
        for event in events:
            lines += re.sub(r"\x1b\[[0-9;]*m", "", event.get("stream", "")).splitlines()  # no colour codes
            if "error" in event:
                tail = "\n".join([*lines[-20:], event["error"].strip()])
                raise EnvironmentBuildError(f"{what}: docker build failed:\n{tail}")
    except ENGINE_ERRORS as err:
        tail = "\n".join(lines[-20:])
        raise EnvironmentBuildError(f"{what}: docker build failed: {err}\n{tail}") from err


def _with_tools(base: str, api: docker.APIClient):
    """A Dockerfile on `base` that adds tmux, python3 and bash where the image lacks them, keeping its USER."""
    import io

    user = (api.inspect_image(base)["Config"] or {}).get("User") or "root"
    text = f"FROM {base}\nUSER root\nRUN {TOOLS_CHECK}\nUSER {user}\n"
    return io.BytesIO(text.encode())


def export_image(api: docker.APIClient, image: str, dest: Path) -> None:
    """Unpack `image`'s file system into `dest` (owners and modes kept), through a created, never started, container."""
    import subprocess

    dest.mkdir(parents=True, exist_ok=True)
    try:
        container = api.create_container(image, command=["true"], network_disabled=True, labels={"tbexp.export": "1"})[
            "Id"
        ]
    except ENGINE_ERRORS as err:
        raise EnvironmentBuildError(f"cannot export {image}: {err}") from err
    try:
        tar = subprocess.Popen(
            ["tar", "-x", "--numeric-owner", "-C", str(dest)], stdin=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for chunk in api.export(container):
            tar.stdin.write(chunk)
        tar.stdin.close()
        if tar.wait() != 0:
            raise EnvironmentBuildError(
                f"cannot export {image}: tar: {tar.stderr.read().decode(errors='replace')[-500:]}"
            )
    except ENGINE_ERRORS as err:
        raise EnvironmentBuildError(f"cannot export {image}: {err}") from err
    finally:
        try:
            api.remove_container(container, force=True)
        except ENGINE_ERRORS:
            pass


def image_config(api: docker.APIClient, image: str):
    """The image's working directory, environment, user and what it starts, as the bwrap builder keeps them."""
    from tbexp.sandboxes.environment_build import ImageConfig
    from tbexp.sandboxes.image_start import ImageStart

    config = api.inspect_image(image)["Config"] or {}
    env = dict(entry.partition("=")[::2] for entry in config.get("Env") or [])
    return ImageConfig(
        config.get("WorkingDir") or "/", env, config.get("User") or "", start=ImageStart.from_docker(config)
    )


def _prebuilt_hash(api: docker.APIClient, image: str, task) -> str:
    try:
        return "img-" + api.inspect_image(image)["Id"].split(":")[-1][:16]
    except docker.errors.ImageNotFound as err:
        raise MissingImageError(
            f"{task.path / 'task.toml'}: docker_image {image} is not on this engine and no registry can be reached; {STAND_INS}"
        ) from err
    except ENGINE_ERRORS as err:
        raise SandboxError(f"cannot reach the Docker engine: {err}") from err


def _content_hash(api: docker.APIClient, env_dir: Path, base_image: str) -> str:
    """sha256 of the build context (paths, modes, contents) and the ids of the local FROM images."""
    dockerfile = env_dir / "Dockerfile"
    h = hashlib.sha256(f"{BUILD_VERSION}\0{context_hash(env_dir)}".encode())
    try:
        stages = read_dockerfile(dockerfile).stages
        images, names = [s.base_image for s in stages], {s.name for s in stages if s.name}
    except EnvironmentBuildError:  # docker build reads it its own way, and says what is wrong
        images, names = re.findall(r"(?im)^\s*FROM\s+(?:--\S+\s+)*(\S+)", dockerfile.read_text()), set()
    for image in images:
        if image in names or image == "scratch":
            h.update(image.encode())
            continue
        try:
            h.update(api.inspect_image(image)["Id"].encode())
        except docker.errors.ImageNotFound as err:
            hint = "run scripts/build_base_image.sh" if image == base_image else STAND_INS
            raise MissingImageError(
                f"{dockerfile}: FROM {image}, which this engine lacks and no registry can give; {hint}"
            ) from err
        except ENGINE_ERRORS as err:
            raise SandboxError(f"cannot reach the Docker engine: {err}") from err
    return h.hexdigest()[:16]
