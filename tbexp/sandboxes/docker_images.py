"""The Docker engine client, and the task images built on it (for `sandbox=docker`, see docker.py).

The image is built from the task's `environment/Dockerfile` (context
`environment/`, `--network none`, legacy builder) and tagged by a hash of
that directory plus the ids of the local images it starts FROM, so an
unchanged task is built once per engine; threads that need the same tag wait
on one lock. Nothing is ever pulled: a FROM image must exist locally
(scripts/build_base_image.sh makes `tbexp-base:bookworm`).

The directory's hash is kept per process, keyed by each file's path, mtime
and size, so a start does not re-read an unchanged context; the FROM images'
ids are asked of the engine every time.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path

import docker
import requests

from tbexp.sandboxes.base import SandboxError

ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException, OSError)

_lock = threading.Lock()  # guards _clients and _tag_locks
_clients: dict[int, docker.APIClient] = {}  # by pid: a forked child needs its own connections
_tag_locks: dict[str, threading.Lock] = {}
_hashes: dict[tuple, str] = {}  # environment dir signature -> content hash


def _client() -> docker.APIClient:
    pid = os.getpid()
    with _lock:
        if pid not in _clients:
            try:
                api = docker.APIClient(version="auto", max_pool_size=64, timeout=300, **docker.utils.kwargs_from_env())
                api.ping()
            except ENGINE_ERRORS as err:
                raise SandboxError(f"cannot reach the Docker engine ({err}); start it with scripts/start_dockerd.sh") from err
            _clients[pid] = api
        return _clients[pid]


def _ensure_image(api: docker.APIClient, env_dir: Path, base_image: str, task_name: str) -> str:
    """The tag of the task's image, built unless an image with that content hash exists."""
    dockerfile = env_dir / "Dockerfile"
    if not dockerfile.is_file():
        raise SandboxError(f"{dockerfile}: missing (sandbox=docker builds the task's environment from it)")
    tag = f"tbexp-task:{_content_hash(api, env_dir, base_image)}"
    with _lock:
        lock = _tag_locks.setdefault(tag, threading.Lock())
    with lock:
        try:
            api.inspect_image(tag)
            return tag
        except docker.errors.ImageNotFound:
            pass
        except ENGINE_ERRORS as err:
            raise SandboxError(f"cannot reach the Docker engine: {err}") from err
        _build(api, env_dir, dockerfile, tag, task_name)
    return tag


def _build(api: docker.APIClient, env_dir: Path, dockerfile: Path, tag: str, task_name: str) -> None:
    lines: list[str] = []
    try:
        for event in api.build(path=str(env_dir), tag=tag, network_mode="none", rm=True, forcerm=True, decode=True, labels={"tbexp.task": task_name}):
            lines += event.get("stream", "").splitlines()
            if "error" in event:
                tail = "\n".join([*lines[-20:], event["error"].strip()])
                raise SandboxError(f"{dockerfile}: docker build failed:\n{tail}")
    except ENGINE_ERRORS as err:
        tail = "\n".join(lines[-20:])
        raise SandboxError(f"{dockerfile}: docker build failed: {err}\n{tail}") from err


def _content_hash(api: docker.APIClient, env_dir: Path, base_image: str) -> str:
    """sha256 of the build context (paths, modes, contents) and the ids of the local FROM images."""
    files = sorted(p for p in env_dir.rglob("*") if p.is_file() or p.is_symlink())
    signature = (str(env_dir.resolve()), *((str(p), p.lstat().st_mtime_ns, p.lstat().st_size) for p in files))
    digest = _hashes.get(signature)
    if digest is None:
        h = hashlib.sha256()
        for path in files:
            h.update(f"{path.relative_to(env_dir)}\0{path.lstat().st_mode:o}\0".encode())
            h.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
            h.update(b"\0")
        digest = _hashes[signature] = h.hexdigest()
    h = hashlib.sha256(digest.encode())
    for image in re.findall(r"(?im)^\s*FROM\s+(?:--\S+\s+)*(\S+)", (env_dir / "Dockerfile").read_text()):
        try:
            h.update(api.inspect_image(image)["Id"].encode())
        except docker.errors.ImageNotFound as err:
            if image == base_image:
                raise SandboxError(f"{env_dir / 'Dockerfile'}: FROM {image}, which this engine lacks: run scripts/build_base_image.sh") from err
            h.update(image.encode())  # a build stage's name, or an image the build will fail to find
        except ENGINE_ERRORS as err:
            raise SandboxError(f"cannot reach the Docker engine: {err}") from err
    return h.hexdigest()[:16]
