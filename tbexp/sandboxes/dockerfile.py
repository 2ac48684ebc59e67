"""A task's `environment/Dockerfile`, read as Docker reads it, for the sandboxes that build without Docker.

`read_dockerfile(path)` joins continuation lines, drops comments, splits each stage at `FROM [--platform=P]
IMAGE [AS NAME]`, and substitutes `$VAR`, `${VAR}`, `${VAR:-default}` and `${VAR:+alt}` from `ARG`
defaults and `ENV` values in the instructions Docker substitutes in (FROM, ENV, ARG, COPY, ADD, WORKDIR,
USER; not RUN, whose shell expands its own variables). It refuses only what no builder could read (an
unknown instruction, `ENV` without a value, a heredoc, a parser directive other than `syntax`), naming the
file and line; whether an instruction can be honoured is the builder's call (environment_build.py).

What is simplified: no `--build-arg` values exist (tbexp passes none, as Harbor passes none), so an `ARG`
is its default or empty; escapes inside substitutions (`\\$`) are kept literally.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tbexp.sandboxes.base import EnvironmentBuildError

SUBSTITUTED = {"FROM", "ENV", "ARG", "COPY", "ADD", "WORKDIR", "USER"}
HONOURED = {"RUN", "COPY", "ADD", "WORKDIR", "ENV", "ARG", "USER", "SHELL"}
# What a container of the image starts: kept in the image's config, started as its service (image_start.py).
START = {"ENTRYPOINT", "CMD", "HEALTHCHECK"}
# Instructions that shape how Docker starts a container, never what is in it: a sandbox starts its own.
IGNORED = {
    "EXPOSE": "sandboxes publish no ports",
    "LABEL": "metadata only",
    "MAINTAINER": "metadata only",
    "STOPSIGNAL": "a sandbox is stopped by killing all of it",
    "VOLUME": "the writable paths are the sandbox's own",
}


class DockerfileError(EnvironmentBuildError):
    """A Dockerfile that cannot be read or honoured; the message names the file and line."""


@dataclass(frozen=True)
class Instruction:
    where: str  # "path:line", for messages
    keyword: str  # upper case
    args: str  # substituted where Docker substitutes
    flags: dict[str, str] = field(default_factory=dict)  # --chown=..., --from=..., --mount=...
    build_args: dict[str, str] = field(default_factory=dict)  # RUN: the ARG values in scope, its environment

    def words(self) -> list[str]:
        """The arguments as a list: a JSON array as written, else split as a shell would."""
        if self.args.startswith("["):
            try:
                value = json.loads(self.args)
                if isinstance(value, list) and all(isinstance(v, str) for v in value):
                    return value
            except json.JSONDecodeError:
                pass
        try:
            return shlex.split(self.args)
        except ValueError as err:
            raise DockerfileError(f"{self.where}: {self.keyword} {self.args!r}: {err}") from err


@dataclass
class Stage:
    where: str
    base_image: str
    platform: str = ""
    name: str = ""
    steps: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: Path
    stages: list[Stage]

    @property
    def base_image(self) -> str:
        return self.stages[-1].base_image


def read_dockerfile(path: Path) -> Dockerfile:
    """Parse `path` into stages; DockerfileError naming the line for what no builder could read."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise DockerfileError(f"{path}: cannot be read ({err.strerror})") from err
    stages: list[Stage] = []
    global_args: dict[str, str] = {}  # ARGs before the first FROM: visible to FROM lines only
    values: dict[str, str] = {}  # ARG and ENV values in scope in the current stage
    stage_args: dict[str, str] = {}  # the ARG values alone: a RUN sees them, the image does not keep them
    for lineno, line in _logical_lines(text, path):
        where = f"{path}:{lineno}"
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if (
            "<<" in rest
            and re.search(r"<<-?\s*['\"]?[A-Za-z_]+['\"]?\s*$", rest.splitlines()[0])
            and keyword in ("RUN", "COPY")
        ):
            raise DockerfileError(f"{where}: heredocs (<<EOF) need BuildKit, which neither sandbox's builder has")
        if keyword not in HONOURED | START and keyword not in IGNORED and keyword != "FROM":
            raise DockerfileError(f"{where}: {keyword}: not a Dockerfile instruction tbexp can build")
        flags, rest = _flags(rest)
        if keyword in SUBSTITUTED:
            rest = substitute(rest, global_args if keyword == "FROM" or not stages else values)
        if keyword == "FROM":
            stages.append(_from(where, flags, rest))
            values, stage_args = {}, {}
            continue
        if keyword == "ARG":
            for name, default in _parse_arg(rest, where).items():
                value = default if default is not None else global_args.get(name, "")
                if stages:
                    values[name] = stage_args[name] = value
                else:
                    global_args[name] = value
            continue
        if not stages:
            raise DockerfileError(f"{where}: {keyword} before the first FROM")
        instruction = Instruction(where, keyword, rest, flags, dict(stage_args) if keyword == "RUN" else {})
        if keyword == "ENV":
            values.update(parse_env(instruction))
        stages[-1].steps.append(instruction)
    if not stages:
        raise DockerfileError(f"{path}: no FROM line")
    return Dockerfile(path, stages)


_hashes: dict[tuple, str] = {}  # build context signature -> content hash, kept per process


def context_hash(env_dir: Path) -> str:
    """sha256 of a build context (relative paths, modes, contents); re-read only when a file's mtime or size changes."""
    env_dir = Path(env_dir)
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
    return digest


def substitute(text: str, values: dict[str, str]) -> str:
    """Docker's variable substitution.

    >>> substitute("${A}/x ${B:-two} $C ${A:+set}", {"A": "1"})
    '1/x two  set'
    """

    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        op, word = match.group(3), match.group(4) or ""
        value = values.get(name)
        if op == ":-":
            return value if value else word
        if op == ":+":
            return word if value else ""
        return value or ""

    return re.sub(r"(?<!\\)\$(?:([A-Za-z_][A-Za-z0-9_]*)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:[-+])([^}]*))?\})", one, text)


def parse_env(instruction: Instruction) -> dict[str, str]:
    """ENV KEY=value ... (or the legacy ENV KEY value)."""
    parts = instruction.words()
    if len(parts) >= 2 and "=" not in parts[0]:
        return {parts[0]: " ".join(parts[1:])}
    pairs = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise DockerfileError(f"{instruction.where}: ENV expects KEY=value, got {part!r}")
        pairs[key] = value
    return pairs


def _from(where: str, flags: dict[str, str], rest: str) -> Stage:
    """FROM [--platform=P] IMAGE [AS NAME]."""
    words = rest.split()
    if not words or len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
        raise DockerfileError(f"{where}: FROM expects [--platform=P] IMAGE [AS NAME], got {rest!r}")
    unknown = set(flags) - {"platform"}
    if unknown:
        raise DockerfileError(f"{where}: FROM --{sorted(unknown)[0]}: not a FROM flag")
    return Stage(where, words[0], flags.get("platform", ""), words[2] if len(words) == 3 else "")


def _flags(rest: str) -> tuple[dict[str, str], str]:
    """Leading `--name=value` flags, and the rest of the line."""
    flags: dict[str, str] = {}
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        name, _, value = word[2:].partition("=")
        flags[name] = value
        rest = rest.lstrip()
    return flags, rest


def _parse_arg(rest: str, where: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for word in shlex.split(rest):
        name, sep, default = word.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise DockerfileError(f"{where}: ARG {word!r}: not a variable name")
        out[name] = default if sep else None
    if not out:
        raise DockerfileError(f"{where}: ARG needs a name")
    return out


def _logical_lines(text: str, path: Path) -> list[tuple[int, str]]:
    """Join backslash continuations, drop comments and blanks; keep the first line number."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if (
            not pending
            and not out
            and re.fullmatch(r"#\s*escape\s*=.*", line, re.I)
            and line.split("=", 1)[1].strip() != "\\"
        ):
            raise DockerfileError(f"{path}:{lineno}: only the default escape character (\\) is supported")
        if not line or line.startswith("#"):
            continue  # a comment inside a continuation is dropped, as Docker does
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


def usable_image(task: Any, base_image: str, has: Callable[[str], bool]) -> tuple[str, str]:
    """(the prebuilt image to run, '' to build environment/Dockerfile; why the image is not run, or '').

    The image runs where it can be had (the base image, or `has(image)`: an engine holding it, a stand-in for it),
    as Harbor runs a prebuilt image before it builds; where it cannot and the task ships the Dockerfile it was built
    from, the Dockerfile is built, as `harbor run --force-build` builds it. Without a Dockerfile the image is all
    there is (and an error names it).
    """
    image = getattr(task, "docker_image", "") or ""
    if not image or not (task.environment_dir / "Dockerfile").is_file():
        return image, ""
    if image == base_image or has(image):
        return image, ""
    return "", f"docker_image {image} cannot be had offline"
