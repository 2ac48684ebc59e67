"""Task environments for bwrap: one root file system per distinct `environment/`, built once and cached.

`bwrap_environment(task, settings)` gives the root a task's sandboxes run on, with the image's working
directory, environment, user and what it starts (its ENTRYPOINT/CMD service, image_start.py). Three ways, chosen in
this order:
1. **As today's built-in tasks:** a Dockerfile that starts FROM `sandbox.base_image` (or, without Docker,
   a Debian stand-in) and only sets WORKDIR/ENV/ARG/CMD/ENTRYPOINT/HEALTHCHECK and COPYs files into the sandbox's
   writable paths runs on that base root itself (`sandbox.rootfs` for `tbexp-base:bookworm`); its files are copied in
   at start.
2. **Exported from Docker** (`sandbox.environment_source=docker`, or `auto` with an engine answering): the
   image docker_images.py builds for `sandbox=docker` is exported into `<cache>/environments/docker-<id>-b<v>/`.
   A prebuilt `docker_image` is exported the same way. Under `auto`, an engine that lacks the FROM image
   (nothing is pulled) falls through to 3, with a warning.
3. **Built without Docker** (`debootstrap`, or `auto` with no engine): the FROM image's stand-in (root_cache.py) is
   copied to `<cache>/environments/<hash>/` and the stage's instructions are applied to it (environment_build.py).
   A multi-stage Dockerfile builds every stage the last one needs (`FROM <stage>`, `COPY --from=<stage>`), each a root
   of its own; a `COPY --from=<image>` copies from that image's stand-in (uv's tool image, a Debian stand-in).
   `<hash>` covers the build context's contents, the stand-in, the stage and this builder's version.
Every environment built has tmux, python3 and bash (installed by apt-get where the base lacks them).

A task naming a prebuilt `docker_image` runs that image where it can be had (the base root, or an engine holding it);
where it cannot and the task ships the `environment/Dockerfile` it was built from (Terminal-Bench 2.0's tasks do), the
Dockerfile is built instead, as Harbor's `--force-build` does, and `PreparedEnvironment.source` says so. Without a
Dockerfile, the image is read as `FROM <docker_image>` (its stand-in). A multi-container task
(`environment/docker-compose.yaml`) is refused: a bwrap sandbox is one environment (sandbox=docker runs them).

Each distinct environment is built once per machine (a file lock serialises processes), looked up once per
process; a failure is remembered for the process, so every later episode of that task fails at once with
the same `EnvironmentBuildError`. `prepare_environments` builds them all up front and lists the tasks that
cannot run. `<cache>` is `tbexp.cache.cache_root()` (the job's cache_dir); clearing `<cache>/environments/` forces
rebuilds (debootstrap included).
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tbexp.cache import cache_root
from tbexp.sandboxes.base import EnvironmentBuildError, MissingImageError
from tbexp.sandboxes.debian_roots import stand_in
from tbexp.sandboxes.dockerfile import (
    IGNORED,
    START,
    Dockerfile,
    Stage,
    context_hash,
    parse_env,
    read_dockerfile,
    usable_image,
)
from tbexp.sandboxes.environment_build import ImageConfig, build_stage
from tbexp.sandboxes.image_start import apply_start
from tbexp.sandboxes.root_cache import (  # noqa: F401  (TOOLS, ENSURE_TOOLS, builds: read by the tests)
    BUILDER_VERSION,
    DEFAULT_BUILD_TIMEOUT_S,
    ENSURE_TOOLS,
    TOOLS,
    WRITABLE_ROOTS,
    PreparedEnvironment,
    base_config,
    builds,
    cached_root,
    stand_in_root,
)

log = logging.getLogger(__name__)

COMPOSE_FILE = "docker-compose.yaml"  # Harbor's name for a multi-container task's environment

_lock = threading.Lock()
_key_locks: dict[tuple, threading.Lock] = {}
_prepared: dict[tuple, PreparedEnvironment | EnvironmentBuildError] = {}


def bwrap_environment(task: Any, settings: Any) -> PreparedEnvironment:
    """The prepared environment of `task` for bwrap; EnvironmentBuildError (remembered) where there is none."""
    docker_image = getattr(task, "docker_image", "") or ""
    chosen = _chosen(settings)
    source = _source(chosen)
    dockerfile = task.environment_dir / "Dockerfile"
    key = (
        context_hash(task.environment_dir) if dockerfile.is_file() or not docker_image else "",
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
                refuse_compose(task)
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


def refuse_compose(task: Any) -> None:
    """A multi-container task cannot run in one bwrap sandbox: unrunnable, with that reason."""
    compose = task.environment_dir / COMPOSE_FILE
    if compose.is_file():
        raise EnvironmentBuildError(
            f"{compose}: a multi-container task (docker-compose services beside the main container) needs "
            "sandbox=docker; a bwrap sandbox is one environment with no network, so it is not run here"
        )


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
        return _from_docker(task, settings)  # docker_images chooses between the image and the Dockerfile
    image, note = usable_image(task, settings.base_image, _has_stand_in)
    dockerfile = _dockerfile(task, image)
    light = _light(dockerfile, task, settings, source)
    if light:
        return replace(light, source=_source_note(task, image, note))
    if source == "docker":
        return _from_docker(task, settings)
    return replace(_built(dockerfile, task, settings), source=_source_note(task, image, note))


def _has_stand_in(image: str) -> bool:
    found = stand_in(image)
    return found is not None and not found.tool


def _source_note(task: Any, image: str, note: str) -> str:
    if image:
        return f"docker_image {image}"
    return "environment/Dockerfile" + (f" ({note}; built from the Dockerfile beside it)" if note else "")


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
    if stage.base_image != settings.base_image:
        found = stand_in(stage.base_image)
        if source == "docker" or found is None or found.tool:
            return None
    base = Path(settings.rootfs) if stage.base_image == settings.base_image else stand_in_root(stage.base_image)
    config = base_config(base)  # a stand-in's own WORKDIR and ENV (Terminal-Bench's images set /app)
    copies: list[tuple[Path, str]] = []
    for step in stage.steps:
        if step.keyword in IGNORED:
            continue
        if step.keyword == "ENV":
            config.env.update(parse_env(step))
        elif step.keyword in START:
            apply_start(step, config.start, config.shell)
        elif step.keyword == "WORKDIR":
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
    return PreparedEnvironment(base, config.workdir, config.env, copies=tuple(copies), start=config.start)


# -- built without Docker ---------------------------------------------------------


def _built(dockerfile: Dockerfile, task: Any, settings: Any) -> PreparedEnvironment:
    """The last stage's root, built with every stage it needs (each its own cached root, in order)."""
    context = dockerfile.path.parent
    deadline = time.monotonic() + float(getattr(task, "build_timeout_s", 0) or DEFAULT_BUILD_TIMEOUT_S)
    built: dict[int, Path] = {}
    needed = _needed_stages(dockerfile)
    for index in needed:
        stage = dockerfile.stages[index]
        base = _stage_base(dockerfile, index, built, settings)
        base_key = "rootfs" if base == Path(settings.rootfs) else base.name
        digest = hashlib.sha256(
            f"{BUILDER_VERSION}\0{base_key}\0{context_hash(context)}\0{index}".encode()
        ).hexdigest()[:16]
        name = digest if index == needed[-1] else f"{digest}-stage{index}"

        def build(root: Path, log, stage=stage, base=base) -> ImageConfig:
            copy_from = lambda ref, where: _copy_from_root(dockerfile, ref, index, built, where)  # noqa: E731
            return build_stage(stage, context, root, base_config(base), log, deadline, copy_from)

        prepared = cached_root(cache_root() / "environments" / name, base, build)
        built[index] = prepared.root
    return prepared


def _needed_stages(dockerfile: Dockerfile) -> list[int]:
    """The stages the last one needs (through FROM <stage> and COPY --from=<stage>), in Dockerfile order."""
    names = {stage.name.lower(): i for i, stage in enumerate(dockerfile.stages) if stage.name}
    needed: set[int] = set()

    def visit(index: int) -> None:
        if index in needed:
            return
        needed.add(index)
        stage = dockerfile.stages[index]
        refs = [stage.base_image] + [s.flags["from"] for s in stage.steps if "from" in s.flags]
        for ref in refs:
            found = _stage_index(ref, names, index)
            if found is not None:
                visit(found)

    visit(len(dockerfile.stages) - 1)
    return sorted(needed)


def _stage_index(ref: str, names: dict[str, int], before: int) -> int | None:
    """The earlier stage `ref` names (by AS name or number), or None for an image."""
    if ref.lower() in names and names[ref.lower()] < before:
        return names[ref.lower()]
    if ref.isdigit() and int(ref) < before:
        return int(ref)
    return None


def _stage_base(dockerfile: Dockerfile, index: int, built: dict[int, Path], settings: Any) -> Path:
    stage = dockerfile.stages[index]
    names = {s.name.lower(): i for i, s in enumerate(dockerfile.stages) if s.name}
    earlier = _stage_index(stage.base_image, names, index)
    if earlier is not None:
        return built[earlier]
    if stage.base_image == settings.base_image:
        return Path(settings.rootfs)
    return stand_in_root(stage.base_image, f"{stage.where}: FROM")


def _copy_from_root(dockerfile: Dockerfile, ref: str, index: int, built: dict[int, Path], where: str) -> Path:
    """What `COPY --from=ref` copies from: an earlier stage's root, or the image's stand-in (uv's tool image, ...)."""
    names = {s.name.lower(): i for i, s in enumerate(dockerfile.stages) if s.name}
    earlier = _stage_index(ref, names, index)
    if earlier is not None:
        return built[earlier]
    return stand_in_root(ref, f"{where}: COPY --from")


# -- exported from Docker ---------------------------------------------------------


def _from_docker(task: Any, settings: Any) -> PreparedEnvironment:
    from tbexp.sandboxes.docker_images import _client, _ensure_image, export_image, image_config, image_source

    api = _client()
    image = _ensure_image(api, task, settings)
    image_id = api.inspect_image(image)["Id"].split(":")[-1][:16]
    root = cache_root() / "environments" / f"docker-{image_id}-b{BUILDER_VERSION}"  # what this builder keeps of it

    def export(partial: Path, log) -> ImageConfig:
        export_image(api, image, partial)
        return image_config(api, image)

    return replace(cached_root(root, None, export), source=image_source(image))


if __name__ == "__main__":  # python -m tbexp.sandboxes.environments [--name] IMAGE: its stand-in root's path (built)
    import sys  # or, with --name, the name that root has (nothing built)

    from tbexp.sandboxes.root_cache import stand_in_name

    print(stand_in_name(sys.argv[2]) if sys.argv[1] == "--name" else stand_in_root(sys.argv[1]))
