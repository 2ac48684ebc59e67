"""Task environments for bwrap: one root file system per distinct `environment/`, built once and cached.

`bwrap_environment(task, settings)` gives the root a task's sandboxes run on, with the image's working
directory, environment and user. Three ways, chosen in this order:
1. **As today's built-in tasks:** a Dockerfile that starts FROM `sandbox.base_image` (or, without Docker,
   a Debian stand-in) and only sets WORKDIR/ENV/ARG and COPYs files into the sandbox's writable paths runs
   on that base root itself (`sandbox.rootfs` for `tbexp-base:bookworm`); its files are copied in at start.
2. **Exported from Docker** (`sandbox.environment_source=docker`, or `auto` with an engine answering): the
   image docker_images.py builds for `sandbox=docker` is exported into `<cache>/environments/docker-<tag>/`.
   A prebuilt `docker_image` is exported the same way. Under `auto`, an engine that lacks the FROM image
   (nothing is pulled) falls through to 3, with a warning.
3. **Built without Docker** (`debootstrap`, or `auto` with no engine): the FROM image's Debian stand-in
   (debian_roots.py, a debootstrap per suite) is copied to `<cache>/environments/<hash>/` and the stage's
   instructions are applied to it (environment_build.py). `<hash>` covers the build context's contents,
   the stand-in and this builder's version. A prebuilt `docker_image` is read as `FROM <docker_image>`.
Every environment built has tmux, python3 and bash (installed by apt-get where the base lacks them).

Each distinct environment is built once per machine (a file lock serialises processes), looked up once per
process; a failure is remembered for the process, so every later episode of that task fails at once with
the same `EnvironmentBuildError`. `prepare_environments` builds them all up front and lists the tasks that
cannot run. `<cache>` is `tbexp.cache.cache_root()` (the job's cache_dir); clearing `<cache>/environments/` forces
rebuilds (debootstrap included).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import posixpath
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tbexp.cache import cache_root
from tbexp.sandboxes.base import EnvironmentBuildError, MissingImageError
from tbexp.sandboxes.debian_roots import stand_in, suite_root, table_text
from tbexp.sandboxes.dockerfile import (
    IGNORED,
    Dockerfile,
    DockerfileError,
    Stage,
    context_hash,
    parse_env,
    read_dockerfile,
)
from tbexp.sandboxes.environment_build import ImageConfig, build_stage, user_ids

log = logging.getLogger(__name__)

BUILDER_VERSION = "1"  # bump when a change to the builders changes what a cached root holds
WRITABLE_ROOTS = ("/app", "/tmp", "/root", "/logs", "/tests", "/solution")  # bwrap.WRITABLE
TOOLS = ("usr/bin/tmux", "usr/bin/python3", "bin/bash")
ENSURE_TOOLS = (
    "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
    "tmux python3 bash && rm -rf /var/lib/apt/lists/*\n"
)
DEFAULT_BUILD_TIMEOUT_S = 600.0  # Harbor's default build_timeout_sec


@dataclass(frozen=True)
class PreparedEnvironment:
    root: Path
    workdir: str = "/"  # "/" = the task's workdir (as docker.py does)
    env: dict[str, str] = field(default_factory=dict)
    uid: int = 0
    gid: int = 0
    home: str = "/root"
    copies: tuple[tuple[Path, str], ...] = ()  # (host file, sandbox path): copied into the sandbox at start
    seeded: bool = False  # the writable paths start with what the image holds there


_lock = threading.Lock()
_key_locks: dict[tuple, threading.Lock] = {}
_prepared: dict[tuple, PreparedEnvironment | EnvironmentBuildError] = {}
builds = {"bwrap": 0}  # roots built by this process (tests count them)


def bwrap_environment(task: Any, settings: Any) -> PreparedEnvironment:
    """The prepared environment of `task` for bwrap; EnvironmentBuildError (remembered) where there is none."""
    docker_image = getattr(task, "docker_image", "") or ""
    chosen = _chosen(settings)
    source = _source(chosen)
    key = (
        context_hash(task.environment_dir) if not docker_image else "",
        docker_image,
        source,
        chosen,  # auto may fall back from Docker where an explicit docker may not
        str(settings.rootfs),
        settings.base_image,
        str(cache_root()),  # the built roots live there: a process whose cache root changes builds afresh
    )
    with _lock:
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in _prepared:
            try:
                _prepared[key] = _prepare(task, settings, docker_image, source, fall_back=chosen == "auto")
            except EnvironmentBuildError as err:
                _prepared[key] = err
            except OSError as err:
                _prepared[key] = EnvironmentBuildError(
                    f"{task.environment_dir}: building the environment failed: {err}"
                )
        found = _prepared[key]
    if isinstance(found, EnvironmentBuildError):
        raise found
    return found


def prepare_environments(tasks: list, sandbox_settings: Any) -> dict[str, str]:
    """Build every distinct environment of `tasks` once, up front; {task name: why it cannot run}."""
    from hydra.utils import get_class
    from tqdm import tqdm

    sandbox_class = get_class(sandbox_settings._target_)
    groups: dict[tuple, list] = {}
    for task in tasks:
        docker_image = getattr(task, "docker_image", "") or ""
        try:
            key = (docker_image or context_hash(task.environment_dir),)
        except OSError as err:
            key = (f"unreadable: {err}",)
        groups.setdefault(key, []).append(task)
    unrunnable: dict[str, str] = {}
    for members in tqdm(groups.values(), desc="environments", unit="env", dynamic_ncols=True, disable=len(groups) < 2):
        try:
            sandbox_class.prepare(sandbox_settings, members[0])
        except EnvironmentBuildError as err:
            for task in members:
                unrunnable[task.name] = str(err)
    return unrunnable


# -- choosing the way -------------------------------------------------------------


def _prepare(task: Any, settings: Any, docker_image: str, source: str, fall_back: bool) -> PreparedEnvironment:
    try:
        return _prepare_from(task, settings, docker_image, source)
    except MissingImageError as missing:  # only the Docker way raises it
        if not fall_back:
            raise
        # `auto` meant "Docker if it can": an engine without the base image cannot, and pulls nothing
        log.warning("%s; sandbox.environment_source=auto builds this environment without Docker instead", missing)
        try:
            return _prepare_from(task, settings, docker_image, "debootstrap")
        except EnvironmentBuildError as err:
            raise EnvironmentBuildError(f"with Docker: {missing}; without Docker: {err}") from err


def _prepare_from(task: Any, settings: Any, docker_image: str, source: str) -> PreparedEnvironment:
    if docker_image and source == "docker":
        return _from_docker(task, settings)
    dockerfile = _dockerfile(task, docker_image)
    light = _light(dockerfile, task, settings, source)
    if light:
        return light
    if source == "docker":
        return _from_docker(task, settings)
    return _built(dockerfile, task, settings)


def _dockerfile(task: Any, docker_image: str) -> Dockerfile:
    if docker_image:
        return Dockerfile(task.path / "task.toml", [Stage(f"{task.path / 'task.toml'}: docker_image", docker_image)])
    path = task.environment_dir / "Dockerfile"
    if not path.is_file():
        raise EnvironmentBuildError(f"{path}: missing (the task's environment is built from it)")
    return read_dockerfile(path)


def _chosen(settings: Any) -> str:
    choice = getattr(settings, "environment_source", "auto") or "auto"
    if choice not in ("auto", "docker", "debootstrap"):
        raise EnvironmentBuildError(f"sandbox.environment_source={choice!r}: choose auto, docker or debootstrap")
    return choice


def _source(choice: str) -> str:
    if choice != "auto":
        return choice
    return "docker" if _engine_answers() else "debootstrap"


_engine: list[bool] = []


def _engine_answers() -> bool:
    """Whether a Docker engine answers here (asked once per process, two seconds at most)."""
    if not _engine:
        socket_there = bool(os.environ.get("DOCKER_HOST")) or Path("/var/run/docker.sock").exists()
        answers = False
        if socket_there:
            from tbexp.sandboxes.docker_images import ENGINE_ERRORS

            try:
                import docker

                docker.APIClient(version="auto", timeout=2, **docker.utils.kwargs_from_env()).ping()
                answers = True
            except ENGINE_ERRORS:  # no engine to build with
                answers = False
        _engine.append(answers)
    return _engine[0]


def _light(dockerfile: Dockerfile, task: Any, settings: Any, source: str) -> PreparedEnvironment | None:
    """The base root itself, with files copied in at start, where the stage adds nothing else."""
    stage = dockerfile.stages[-1]
    if len(dockerfile.stages) > 1:
        return None
    if stage.base_image != settings.base_image and (source == "docker" or stand_in(stage.base_image) is None):
        return None
    config = ImageConfig()
    copies: list[tuple[Path, str]] = []
    for step in stage.steps:
        if step.keyword in IGNORED or step.keyword == "ENV":
            continue
        if step.keyword == "WORKDIR":
            config.workdir = posixpath.normpath(posixpath.join(config.workdir, step.args.strip()))
        elif step.keyword in ("COPY", "ADD") and not step.flags:
            *sources, dest = step.words()
            dest = posixpath.normpath(posixpath.join(config.workdir, dest))
            if not any(dest == w or dest.startswith(w + "/") for w in WRITABLE_ROOTS):
                return None
            if any(c in "".join(sources) for c in "*?[") or "://" in "".join(sources):
                return None  # globs and URLs: the builder resolves them
            if step.keyword == "ADD" and any(s.endswith((".tar", ".gz", ".tgz", ".xz", ".bz2")) for s in sources):
                return None
            copies += [(task.environment_dir / s, dest) for s in sources]
        else:
            return None
    env = {k: v for step in stage.steps if step.keyword == "ENV" for k, v in parse_env(step).items()}
    root = Path(settings.rootfs) if stage.base_image == settings.base_image else _stand_in_root(stage, settings)
    return PreparedEnvironment(root, config.workdir, env, copies=tuple(copies))


# -- built without Docker ---------------------------------------------------------


def _built(dockerfile: Dockerfile, task: Any, settings: Any) -> PreparedEnvironment:
    if len(dockerfile.stages) > 1:
        raise DockerfileError(
            f"{dockerfile.stages[1].where}: a second FROM: multi-stage builds are not honoured by the bwrap builder; "
            "run a Docker engine (scripts/start_dockerd.sh), whose image bwrap then exports"
        )
    stage = dockerfile.stages[0]
    base = Path(settings.rootfs) if stage.base_image == settings.base_image else _stand_in_root(stage, settings)
    base_key = "rootfs" if base == Path(settings.rootfs) else base.name
    context = dockerfile.path.parent
    digest = hashlib.sha256(f"{BUILDER_VERSION}\0{base_key}\0{context_hash(context)}".encode()).hexdigest()[:16]
    timeout_s = float(getattr(task, "build_timeout_s", 0) or DEFAULT_BUILD_TIMEOUT_S)
    return _cached_root(
        cache_root() / "environments" / digest,
        base,
        lambda root, log: build_stage(stage, context, root, _base_config(base), log, time.monotonic() + timeout_s),
    )


def stand_in_root(image: str) -> Path:
    """The cached Debian root that stands in for `image` (scripts/build_base_images.sh imports it into Docker)."""
    return _stand_in_root(Stage(f"FROM {image}", image), None)


def _stand_in_root(stage: Stage, settings: Any) -> Path:
    """The Debian root that serves `stage`'s FROM image: a suite root, plus the image family's flavour."""
    found = stand_in(stage.base_image)
    if found is None:
        raise DockerfileError(
            f"{stage.where}: FROM {stage.base_image}: no Debian stand-in for this image ({table_text()}), and no "
            "Docker engine to build it with; start one (scripts/start_dockerd.sh) with the image loaded, "
            "or use another base"
        )
    suite = suite_root(found.suite, cache_root(), print)
    if not found.flavour:
        return suite
    digest = hashlib.sha256(f"{BUILDER_VERSION}\0{found.suite}\0{found.flavour}".encode()).hexdigest()[:12]
    flavour = read_flavour(found.flavour).stages[0]
    return _cached_root(
        cache_root() / "environments" / f"stand-in-{found.suite}-{digest}",
        suite,
        lambda root, log: build_stage(
            flavour, root, root, ImageConfig(), log, time.monotonic() + DEFAULT_BUILD_TIMEOUT_S
        ),
    ).root


def read_flavour(lines: str) -> Dockerfile:
    """Dockerfile lines tbexp itself adds (a stand-in's flavour, the tools), parsed as a stage."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "Dockerfile"
        path.write_text("FROM scratch\n" + lines)
        return read_dockerfile(path)


def _base_config(base: Path) -> ImageConfig:
    saved = base / ".tbexp-env.json"
    if saved.is_file():
        data = json.loads(saved.read_text())
        return ImageConfig(data["workdir"], data["env"], data["user"], data["shell"])
    return ImageConfig()


def _cached_root(root: Path, base: Path | None, build) -> PreparedEnvironment:
    """`root`, made once from a copy of `base` by `build(partial_root, log) -> ImageConfig`; file-locked."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same root: wait for it
        if not (root / ".tbexp-complete").exists():
            _build_root(root, base, build)
    return _load(root)


def _build_root(root: Path, base: Path | None, build) -> None:
    partial = root.with_name(root.name + ".partial")
    log_path = root.with_name(root.name + ".log")
    shutil.rmtree(partial, ignore_errors=True)
    if base is not None:
        _copy_tree(base, partial)
        (partial / ".tbexp-complete").unlink(missing_ok=True)
        (partial / ".tbexp-env.json").unlink(missing_ok=True)
    else:
        partial.mkdir(parents=True)
    with open(log_path, "w") as log_file:

        def log(text: str) -> None:
            log_file.write(text if text.endswith("\n") else text + "\n")
            log_file.flush()

        try:
            config = build(partial, log)
            if not all((partial / tool).exists() or (partial / tool).is_symlink() for tool in TOOLS):
                log("adding tmux, python3 and bash, which every tbexp environment has")
                tools = read_flavour(ENSURE_TOOLS)
                build_stage(
                    tools.stages[0],
                    partial,
                    partial,
                    ImageConfig(config.workdir, config.env),
                    log,
                    time.monotonic() + DEFAULT_BUILD_TIMEOUT_S,
                )
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    builds["bwrap"] += 1
    for path in WRITABLE_ROOTS:  # mount points the sandbox binds over; a read-only root cannot grow them
        (partial / path.lstrip("/")).mkdir(exist_ok=True)
    shutil.rmtree(partial / "root/.cache/pip", ignore_errors=True)  # pip's download cache: build-time only
    (partial / ".tbexp-env.json").write_text(json.dumps(config.as_json()))
    (partial / ".tbexp-complete").touch()
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)


def _load(root: Path) -> PreparedEnvironment:
    config = _base_config(root)
    uid, gid, home = user_ids(root, config.user, str(root))
    return PreparedEnvironment(root, config.workdir, config.env, uid, gid, home, seeded=True)


def _copy_tree(source: Path, dest: Path) -> None:
    """A full copy of a root (owners, modes, links, devices): cp -a, reflinked where the file system can."""
    result = subprocess.run(["cp", "-a", "--reflink=auto", str(source), str(dest)], capture_output=True, text=True)
    if result.returncode != 0:
        raise EnvironmentBuildError(f"cannot copy {source} to {dest}: {result.stderr.strip()[-500:]}")


# -- exported from Docker ---------------------------------------------------------


def _from_docker(task: Any, settings: Any) -> PreparedEnvironment:
    from tbexp.sandboxes.docker_images import _client, _ensure_image, export_image, image_config

    api = _client()
    image = _ensure_image(api, task, settings)
    image_id = api.inspect_image(image)["Id"].split(":")[-1][:16]
    root = cache_root() / "environments" / f"docker-{image_id}"

    def export(partial: Path, log) -> ImageConfig:
        export_image(api, image, partial)
        return image_config(api, image)

    return _cached_root(root, None, export)


if __name__ == "__main__":  # python -m tbexp.sandboxes.environments IMAGE: build its stand-in root, print its path
    import sys

    print(stand_in_root(sys.argv[1]))
