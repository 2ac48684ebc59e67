"""Root file systems bwrap runs on, built once and cached: task environments, stand-ins, tool images.

`cached_root(root, base, build)` makes `root` once from a copy of `base` (file-locked across processes, built under
`<name>.partial` and renamed when complete, with its build log beside it) and loads its image config
(`.tbexp-env.json`: working directory, environment, user, shell, what it starts). Every root built has tmux, python3
and bash (apt-get adds them where the base lacks them), except a tool image's, which holds only the tool.

`stand_in_root(image)` is the root that serves a FROM (or `COPY --from`) image no registry can give here:
a Debian suite root (debian_roots.py) plus the image family's flavour, or a tool image's files (uv's /uv and /uvx,
from PyPI's `uv` wheel, as provision.py fetches it).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tbexp.cache import cache_root
from tbexp.sandboxes.base import EnvironmentBuildError
from tbexp.sandboxes.debian_roots import StandIn, stand_in, suite_root, table_text
from tbexp.sandboxes.dockerfile import Dockerfile, DockerfileError, read_dockerfile
from tbexp.sandboxes.environment_build import ImageConfig, build_stage, user_ids

BUILDER_VERSION = "2"  # bump when a change to the builders changes what a cached root holds (2: the start config)
WRITABLE_ROOTS = ("/app", "/tmp", "/root", "/logs", "/tests", "/solution")  # bwrap.WRITABLE
TOOLS = ("usr/bin/tmux", "usr/bin/python3", "bin/bash")
ENSURE_TOOLS = (
    "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
    "tmux python3 bash && rm -rf /var/lib/apt/lists/*\n"
)
DEFAULT_BUILD_TIMEOUT_S = 600.0  # Harbor's default build_timeout_sec
TOOL_MARK = ".tbexp-tool-image"  # in a tool image's root: it gets no tools and no sandbox mount points
builds = {"bwrap": 0}  # roots built by this process (tests count them)


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
    start: object = None  # image_start.ImageStart: what the image starts (its service), None for nothing
    source: str = ""  # where the environment came from, for the episode record


def cached_root(root: Path, base: Path | None, build) -> PreparedEnvironment:
    """`root`, made once from a copy of `base` by `build(partial_root, log) -> ImageConfig`; file-locked."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same root: wait for it
        if not (root / ".tbexp-complete").exists():
            _build_root(root, base, build)
    return load_root(root)


def _build_root(root: Path, base: Path | None, build) -> None:
    partial = root.with_name(root.name + ".partial")
    log_path = root.with_name(root.name + ".log")
    shutil.rmtree(partial, ignore_errors=True)
    if base is not None:
        copy_tree(base, partial)
        for mark in (".tbexp-complete", ".tbexp-env.json"):
            (partial / mark).unlink(missing_ok=True)
    else:
        partial.mkdir(parents=True)
    with open(log_path, "w") as log_file:

        def log(text: str) -> None:
            log_file.write(text if text.endswith("\n") else text + "\n")
            log_file.flush()

        try:
            config = build(partial, log)
            tool_image = (partial / TOOL_MARK).exists()
            if not tool_image and not all((partial / t).exists() or (partial / t).is_symlink() for t in TOOLS):
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
    for path in WRITABLE_ROOTS if not tool_image else ():  # mount points the sandbox binds over
        (partial / path.lstrip("/")).mkdir(exist_ok=True)
    shutil.rmtree(partial / "root/.cache/pip", ignore_errors=True)  # pip's download cache: build-time only
    (partial / ".tbexp-env.json").write_text(json.dumps(config.as_json()))
    (partial / ".tbexp-complete").touch()
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)


def base_config(base: Path) -> ImageConfig:
    """The image config saved with a root (a fresh one for a root without: a plain suite root)."""
    saved = base / ".tbexp-env.json"
    return ImageConfig.from_json(json.loads(saved.read_text())) if saved.is_file() else ImageConfig()


def load_root(root: Path) -> PreparedEnvironment:
    config = base_config(root)
    if (root / TOOL_MARK).exists():
        return PreparedEnvironment(root, seeded=True)
    uid, gid, home = user_ids(root, config.user, str(root))
    return PreparedEnvironment(root, config.workdir, config.env, uid, gid, home, seeded=True, start=config.start)


def copy_tree(source: Path, dest: Path) -> None:
    """A full copy of a root (owners, modes, links, devices): cp -a, reflinked where the file system can."""
    result = subprocess.run(["cp", "-a", "--reflink=auto", str(source), str(dest)], capture_output=True, text=True)
    if result.returncode != 0:
        raise EnvironmentBuildError(f"cannot copy {source} to {dest}: {result.stderr.strip()[-500:]}")


def read_flavour(lines: str) -> Dockerfile:
    """Dockerfile lines tbexp itself adds (a stand-in's flavour, the tools), parsed as a stage."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "Dockerfile"
        path.write_text("FROM scratch\n" + lines)
        return read_dockerfile(path)


# -- stand-ins ----------------------------------------------------------------------------------------------------


def stand_in_root(image: str, where: str = "") -> Path:
    """The cached root that stands in for `image` (scripts/build_base_images.sh imports it into Docker)."""
    found = _found(image, where)
    if found.tool:
        return _tool_root(found)
    suite = suite_root(found.suite, cache_root(), print)
    if not found.flavour:
        return suite
    flavour = read_flavour(found.flavour).stages[0]
    return cached_root(
        cache_root() / "environments" / stand_in_name(image),
        suite,
        lambda root, log: build_stage(
            flavour, root, root, ImageConfig(), log, time.monotonic() + DEFAULT_BUILD_TIMEOUT_S
        ),
    ).root


def stand_in_name(image: str) -> str:
    """The name of `image`'s stand-in root under <cache>/environments/, without building it (a definition's id)."""
    found = _found(image, "")
    if found.tool:
        return f"tool-{found.tool}-{found.version}"
    if not found.flavour:
        return f"debootstrap-{found.suite}"
    digest = hashlib.sha256(f"{BUILDER_VERSION}\0{found.suite}\0{found.flavour}".encode()).hexdigest()[:12]
    return f"stand-in-{found.suite}-{digest}"


def _found(image: str, where: str) -> StandIn:
    found = stand_in(image)
    if found is None:
        raise DockerfileError(
            f"{where or 'FROM'}: {image}: no Debian stand-in for this image ({table_text()}), and no Docker engine to "
            "build it with; start one (scripts/start_dockerd.sh) with the image loaded, or use another base"
        )
    return found


def _tool_root(found: StandIn) -> Path:
    """uv's image: a root holding /uv and /uvx (nothing else), from PyPI's wheel of that version."""
    from tbexp.sandboxes.provision import _build_uv

    def build(root: Path, log) -> ImageConfig:
        log(f"uv {found.version} from PyPI's wheel: /uv and /uvx")
        with tempfile.TemporaryDirectory() as tmp:
            _build_uv(Path(tmp), found.version)
            for name in ("uv", "uvx"):
                shutil.copy2(Path(tmp) / name, root / name)
        (root / TOOL_MARK).touch()
        return ImageConfig()

    return cached_root(cache_root() / "environments" / stand_in_name(found.image), None, build).root
