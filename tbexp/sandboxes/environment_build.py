"""Build a root file system from one Dockerfile stage without Docker: what bwrap runs on when no engine is there.

`build_stage(stage, context, root, ...)` applies a stage's instructions, in order, to `root` (a copy of the
base image's root made by the caller), and returns the image's config (working directory, environment,
user). Honoured:
* `RUN` runs in a bubblewrap sandbox whose `/` is `root` itself, read-write, as root (real root where tbexp
  runs as root, so apt-get and dpkg can chown files and drop to `_apt`) or as the `USER` in force (through
  setpriv), with the host's network so apt-get and pip reach the registries, and the stage's ARG and ENV
  values in its environment; the shell is `/bin/sh -c` or what `SHELL` set; exec form (`RUN ["a", "b"]`)
  runs without a shell. `--mount=type=cache` is ignored (the step just runs without a cache).
* `COPY` / `ADD` of files from the build context, with globs, `--chown` and `--chmod`; `ADD` of a local tar
  archive unpacks it, as Docker does. Destinations are resolved inside `root` (a symlink in the image never
  leads out to the host).
* `WORKDIR` (made if missing), `ENV`, `ARG` (read by dockerfile.py), `USER`, `SHELL`.
* `ENTRYPOINT`, `CMD`, `HEALTHCHECK` are kept in the image's config (image_start.py: what the sandbox starts as the
  image's service before the agent).
* `COPY --from=<stage or image>`: the caller's `copy_from(name, where)` gives the root to copy from (an earlier stage's
  built root, or an image's stand-in, such as uv's tool image); sources are paths in that root.
* EXPOSE, LABEL, STOPSIGNAL, VOLUME, MAINTAINER are ignored, each for its reason in dockerfile.IGNORED.
Refused, naming the line: `ADD` of a URL or a git repository, `RUN --mount` other than a cache, `ONBUILD`, any other
flag. `.dockerignore` is not read: the whole context is there to copy.
"""

from __future__ import annotations

import glob
import os
import posixpath
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tbexp.sandboxes.base import launcher_env
from tbexp.sandboxes.dockerfile import START, DockerfileError, Instruction, Stage, parse_env
from tbexp.sandboxes.image_start import ImageStart, apply_start

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
COPY_FLAGS = {"chown", "chmod", "link", "from"}  # --link only changes how BuildKit layers the copy
# A RUN reaches the registries the host reaches, trusting what the host trusts (where a TLS-inspecting
# proxy sits between, the image's own CA list would fail every https download): the host's bundle is
# bound here for the step, and the usual variables point at it. The empty mount point is removed after.
HOST_CA = "/.tbexp-host-ca.crt"
CA_VARIABLES = (
    "SSL_CERT_FILE",
    "PIP_CERT",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
    "NODE_EXTRA_CA_CERTS",
)


@dataclass
class ImageConfig:
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    user: str = ""  # "" = root; as written in USER (name, uid, name:group, uid:gid)
    shell: list[str] = field(default_factory=lambda: ["/bin/sh", "-c"])
    start: ImageStart = field(default_factory=ImageStart)  # ENTRYPOINT, CMD, HEALTHCHECK

    def as_json(self) -> dict:
        return {
            "workdir": self.workdir,
            "env": self.env,
            "user": self.user,
            "shell": self.shell,
            "start": self.start.as_json(),
        }

    @classmethod
    def from_json(cls, data: dict) -> ImageConfig:
        return cls(data["workdir"], data["env"], data["user"], data["shell"], ImageStart.from_json(data.get("start")))


def build_stage(
    stage: Stage, context: Path, root: Path, config: ImageConfig, log, deadline: float, copy_from=None
) -> ImageConfig:
    """Apply `stage`'s instructions to `root`, starting from the base image's `config`; the image's config.

    `copy_from(name, where) -> Path`: the root a `COPY --from=name` copies from (None: such a COPY is refused)."""
    config.start.cmd_set = False  # a CMD the base image set is reset by this build's ENTRYPOINT
    for step in stage.steps:
        log(f"{step.where}: {step.keyword} {step.args}"[:300])
        if step.keyword == "RUN":
            _run(step, root, config, log, deadline)
        elif step.keyword in ("COPY", "ADD") and "from" in step.flags:
            _copy(step, _from_root(step, copy_from), root, config, from_image=True)
        elif step.keyword in ("COPY", "ADD"):
            _copy(step, context, root, config)
        elif step.keyword in START:
            apply_start(step, config.start, config.shell)
        elif step.keyword == "WORKDIR":
            config.workdir = posixpath.normpath(posixpath.join(config.workdir, step.args.strip() or "."))
            inside(root, config.workdir).mkdir(parents=True, exist_ok=True)
        elif step.keyword == "ENV":
            config.env.update(parse_env(step))
        elif step.keyword == "USER":
            config.user = step.args.strip()
            user_ids(root, config.user, step.where)  # an unknown user is refused here, not at run time
        elif step.keyword == "SHELL":
            words = step.words()
            if not step.args.startswith("[") or not words:
                raise DockerfileError(f"{step.where}: SHELL expects a JSON array, as Docker does")
            config.shell = words
    return config


def user_ids(root: Path, user: str, where: str = "") -> tuple[int, int, str]:
    """(uid, gid, home) of a USER value, looked up in the image's /etc/passwd and /etc/group."""
    if not user or user in ("root", "0", "root:root", "0:0"):
        return 0, 0, "/root"
    name, _, group = user.partition(":")
    passwd = _table(root / "etc/passwd")
    entry = next((e for e in passwd if e[0] == name or (name.isdigit() and e[2] == name)), None)
    if entry is None and not name.isdigit():
        raise DockerfileError(f"{where}: USER {user}: no such user in the image's /etc/passwd")
    uid = int(entry[2]) if entry else int(name)
    gid = int(entry[3]) if entry else uid
    home = entry[5] if entry and len(entry) > 5 else "/"
    if group:
        groups = _table(root / "etc/group")
        found = next((e for e in groups if e[0] == group or (group.isdigit() and e[2] == group)), None)
        if found is None and not group.isdigit():
            raise DockerfileError(f"{where}: USER {user}: no such group in the image's /etc/group")
        gid = int(found[2]) if found else int(group)
    return uid, gid, home


def inside(root: Path, path: str) -> Path:
    """`path` of the image, on the host, with every symlink resolved inside `root` (never out of it)."""
    current = Path(root)
    parts = [p for p in path.split("/") if p and p != "."]
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            current = current.parent if current != Path(root) else current
            continue
        candidate = current / part
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise OSError(f"{path}: too many symlinks in the image")
            target = os.readlink(candidate)
            parts = [p for p in target.split("/") if p and p != "."] + parts
            current = Path(root) if target.startswith("/") else current
            continue
        current = candidate
    return current


def _run(step: Instruction, root: Path, config: ImageConfig, log, deadline: float) -> None:
    mount = step.flags.get("mount", "")
    for name in step.flags:
        if name == "mount" and "type=cache" in mount:
            continue  # a cache only speeds up a rebuild; the step runs the same without it
        if name != "network":  # builds have the host's network whatever the flag asks
            raise DockerfileError(
                f"{step.where}: RUN --{name}={step.flags[name]}: not honoured by the bwrap builder; use sandbox=docker"
            )
    argv = step.words() if step.args.startswith("[") else [*config.shell, step.args]
    uid, gid, home = user_ids(root, config.user, step.where)
    env = {"PATH": PATH, "HOME": home, **step.build_args, **config.env}
    _resolv_conf(root)
    inside(root, config.workdir).mkdir(parents=True, exist_ok=True)
    bwrap = ["bwrap", "--bind", str(root), "/", "--proc", "/proc", "--dev", "/dev", "--unshare-pid", "--unshare-ipc"]
    bwrap += ["--unshare-uts", "--die-with-parent", "--chdir", config.workdir, "--clearenv"]
    if os.geteuid() == 0:
        bwrap += ["--cap-add", "ALL"]  # real root: apt and dpkg need chown, setuid and the rest
    else:
        bwrap += ["--unshare-user", "--uid", "0", "--gid", "0"]
    host_ca = _host_ca_bundle()
    if host_ca:  # the host's trust for this step only (see HOST_CA); the image keeps its own
        bwrap += ["--ro-bind", host_ca, HOST_CA]
        env.update({name: HOST_CA for name in CA_VARIABLES})
    for key, value in env.items():
        bwrap += ["--setenv", key, value]
    if uid:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv]
    remaining_s = deadline - time.monotonic()
    if remaining_s <= 0:
        raise DockerfileError(f"{step.where}: the build's time (build_timeout_s) ran out before this RUN")
    try:
        result = subprocess.run(
            [*bwrap, *argv], stdin=subprocess.DEVNULL, capture_output=True, timeout=remaining_s, env=launcher_env()
        )
    except subprocess.TimeoutExpired as err:
        raise DockerfileError(f"{step.where}: RUN did not finish within the build's time (build_timeout_s)") from err
    (root / HOST_CA.lstrip("/")).unlink(missing_ok=True)
    output = (result.stdout + result.stderr).decode(errors="replace")
    log(output)
    if result.returncode != 0:
        tail = "\n".join(output.splitlines()[-20:])
        raise DockerfileError(f"{step.where}: RUN {step.args[:200]} failed (exit {result.returncode}):\n{tail}")


def _from_root(step: Instruction, copy_from) -> Path:
    if copy_from is None:
        raise DockerfileError(f"{step.where}: {step.keyword} --from={step.flags['from']}: nothing to copy from here")
    return copy_from(step.flags["from"], step.where)


def _copy(step: Instruction, context: Path, root: Path, config: ImageConfig, from_image: bool = False) -> None:
    """COPY/ADD from the build context, or (`from_image`) from another stage's or image's root at `context`."""
    for name in step.flags:
        if name not in COPY_FLAGS:
            raise DockerfileError(f"{step.where}: {step.keyword} --{name}: not honoured by the bwrap builder")
    words = step.words()
    if len(words) < 2:
        raise DockerfileError(f"{step.where}: {step.keyword} needs a source and a destination")
    *patterns, dest = words
    sources = _sources_in_image(step, context, patterns) if from_image else _sources(step, context, patterns)
    dest_path = posixpath.join(config.workdir, dest)
    as_dir = dest.endswith("/") or len(sources) > 1
    owner = user_ids(root, step.flags["chown"], step.where)[:2] if step.flags.get("chown") else None
    for source in sources:
        if step.keyword == "ADD" and not from_image and source.is_file() and tarfile.is_tarfile(source):
            target = inside(root, dest_path)
            target.mkdir(parents=True, exist_ok=True)
            with tarfile.open(source) as tar:
                tar.extractall(target, filter="tar")
            written = [target]
        elif source.is_dir():
            target = inside(root, dest_path)
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
            written = [target]
        else:
            target = inside(root, posixpath.join(dest_path, source.name) if as_dir else dest_path)
            if target.is_dir():
                target = target / source.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target, follow_symlinks=False)
            written = [target]
        for path in written:
            _set_owner_mode(path, owner, step.flags.get("chmod", ""), step.where)


def _sources(step: Instruction, context: Path, patterns: list[str]) -> list[Path]:
    context = context.resolve()
    sources: list[Path] = []
    for pattern in patterns:
        if "://" in pattern or pattern.startswith("git@"):
            raise DockerfileError(
                f"{step.where}: {step.keyword} {pattern}: fetching URLs is not honoured by the bwrap builder; "
                "download in a RUN step instead"
            )
        matches = sorted(glob.glob(str(context / pattern.lstrip("/")))) or []
        if not matches:
            raise DockerfileError(
                f"{step.where}: {step.keyword} {pattern}: no such file in the build context {context}"
            )
        for match in matches:
            path = Path(match)
            if context not in path.resolve().parents and path.resolve() != context:
                raise DockerfileError(f"{step.where}: {step.keyword} {pattern}: outside the build context")
            sources.append(path)
    return sources


def _sources_in_image(step: Instruction, image_root: Path, patterns: list[str]) -> list[Path]:
    """COPY --from sources: absolute paths (globs allowed) in another stage's or image's root, symlinks resolved in it."""
    sources: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(str(image_root / pattern.lstrip("/")))) if any(c in pattern for c in "*?[") else []
        found = [inside(image_root, str(Path(m).relative_to(image_root))) for m in matches] or [
            inside(image_root, pattern)
        ]
        found = [p for p in found if p.exists() or p.is_symlink()]
        if not found:
            raise DockerfileError(
                f"{step.where}: {step.keyword} --from={step.flags['from']} {pattern}: not in that image"
            )
        sources += found
    return sources


def _set_owner_mode(path: Path, owner: tuple[int, int] | None, chmod: str, where: str) -> None:
    if chmod and not all(c in "01234567" for c in chmod):
        raise DockerfileError(f"{where}: --chmod={chmod}: only octal modes are honoured")
    for current in [path, *(path.rglob("*") if path.is_dir() else [])]:
        if owner:
            os.chown(current, *owner, follow_symlinks=False)
        if chmod and not current.is_symlink():
            current.chmod(int(chmod, 8))


def _host_ca_bundle() -> str:
    for candidate in (os.environ.get("SSL_CERT_FILE", ""), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return candidate
    return ""


def _resolv_conf(root: Path) -> None:
    """The host's resolver, so a RUN can reach the registries by name (Docker puts its own there too)."""
    target = root / "etc/resolv.conf"
    if target.is_symlink() or target.exists():
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copyfile("/etc/resolv.conf", target)
    except OSError:
        target.write_text("")


def _table(path: Path) -> list[list[str]]:
    try:
        return [line.split(":") for line in path.read_text().splitlines() if line and not line.startswith("#")]
    except OSError:
        return []
