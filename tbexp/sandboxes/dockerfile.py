"""The part of a task's `environment/Dockerfile` a non-Docker sandbox can honour.

bubblewrap has no image builder, so it reads the Dockerfile itself and
accepts only what it can reproduce exactly: `FROM` the base image (whose root
file system it already has), `WORKDIR`, `ENV`, and `COPY`/`ADD` of local files
into writable paths. Anything else (`RUN`, `USER`, a foreign base image) is
refused with a message that points at `sandbox=docker`, rather than
silently giving the agent a different environment.
"""

from __future__ import annotations

from tbexp.errors import TbexpError
import shlex
from dataclasses import dataclass, field
from pathlib import Path


class DockerfileError(TbexpError, ValueError):
    """A Dockerfile this sandbox cannot reproduce; the message names the line."""


@dataclass
class Environment:
    base_image: str = ""
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    copies: list[tuple[Path, str]] = field(default_factory=list)  # (host source, sandbox destination)


def parse_dockerfile(path: Path, base_image: str) -> Environment:
    """Read `path`, allowing only instructions a plain root file system can reproduce."""
    env = Environment()
    lines = _logical_lines(path.read_text())
    for lineno, line in lines:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        where = f"{path}:{lineno}"
        if keyword == "FROM":
            env.base_image = rest.split()[0] if rest.split() else ""
            if env.base_image != base_image:
                raise DockerfileError(f"{where}: FROM {env.base_image}: this sandbox only has {base_image}; use sandbox=docker")
        elif keyword == "WORKDIR":
            env.workdir = rest.strip()
        elif keyword == "ENV":
            env.env.update(_parse_env(rest, where))
        elif keyword in ("COPY", "ADD"):
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            if len(parts) < 2:
                raise DockerfileError(f"{where}: {keyword} needs a source and a destination")
            *sources, dest = parts
            for source in sources:
                env.copies.append((path.parent / source, dest))
        else:
            raise DockerfileError(f"{where}: {keyword} is not supported by this sandbox; use sandbox=docker")
    if not env.base_image:
        raise DockerfileError(f"{path}: no FROM line")
    return env


def prebuilt_environment(image: str, base_image: str) -> Environment:
    """A task's `[environment] docker_image`: only the base image, whose root file system this sandbox has."""
    if image != base_image:
        why = f"this sandbox has only {base_image}; use sandbox=docker"
        raise DockerfileError(f"[environment] docker_image = {image!r}: {why}")
    return Environment(base_image=image)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash continuations, drop comments and blanks; keep the first line number."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if not pending:
            start = lineno
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((start, (pending + line).strip()))
        pending = ""
    if pending:
        out.append((start, pending.strip()))
    return out


def _parse_env(rest: str, where: str) -> dict[str, str]:
    parts = shlex.split(rest)
    if len(parts) >= 2 and "=" not in parts[0]:
        return {parts[0]: " ".join(parts[1:])}  # legacy form: ENV KEY value
    pairs = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep:
            raise DockerfileError(f"{where}: ENV expects KEY=value, got {part!r}")
        pairs[key] = value
    return pairs
