"""What a Terminal-Bench test.sh would have downloaded, provisioned read-only so it verifies offline.

Published Terminal-Bench 2 test.sh files bootstrap their own test runner from
the network: `apt-get install curl`, `curl -LsSf https://astral.sh/uv/X/install.sh | sh`,
`source $HOME/.local/bin/env`, then `uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest
--ctrf ...` or `uv init` / `uv add pytest==...` / `uv run pytest ...`. tbexp's
sandboxes have no network, so this module gives them, before test.sh runs:

* `uv` and `uvx` (the static musl build from PyPI's `uv` wheel, of the version
  the installer URL names) and an `env` file that puts `$HOME/.local/bin` on
  PATH, as the installer leaves them; bound read-only at `/root/.local/bin`;
* a wheel folder with every `name==version` the script asks uv or pip for
  (pytest and pytest-json-ctrf at their TB2 pins when not pinned), resolved on
  the host by that uv for every Python from 3.9 and every platform (`uv add`
  locks universally, so Windows-only dependencies such as colorama must be
  there too) and fetched with `pip download`; bound read-only at WHEELS_MOUNT;
* environment variables for the verifier's exec (VERIFIER_ENV): uv offline,
  no index, find-links to the wheel folder, no Python downloads, only the
  environment's own interpreters, no config files and a fresh cache (the agent
  used this sandbox before the tests); pip the same; and an apt.conf (APT_CONFIG,
  bound at ETC_MOUNT) that makes the bootstrap's `apt-get update` fail at once
  rather than after seconds of retries.

Both folders are built once per uv version and requirement set under
`<cache>/provision/` (`tbexp.cache.cache_root()`: the job's cache_dir), with a file lock and a
rename so concurrent episodes build it once, and reused by every later
episode without touching the network. A task opts out with
`[verifier.env] TBEXP_PROVISION = "0"` in task.toml; a test.sh that never
mentions uv, uvx or pip gets nothing.

What is simplified: no interpreter is provisioned; a test.sh that asks for a
Python the environment lacks fails, and `missing_python` turns that into a
clear infrastructure failure. Only wheels are fetched (a requirement with no
wheel for a platform is left out of it, with a warning), only for
CPython on manylinux (not musl) of the host's architecture. Requirements read
from files (`-r`, `--with-requirements`) are not provisioned. HOME is taken to
be /root, as it is in both sandboxes.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

from packaging.markers import InvalidMarker
from packaging.requirements import InvalidRequirement, Requirement

from tbexp.cache import cache_root
from tbexp.sandboxes.base import SandboxError

log = logging.getLogger(__name__)

BIN_MOUNT = "/root/.local/bin"  # where the uv installer puts uv, uvx and env ($HOME/.local/bin, HOME=/root)
WHEELS_MOUNT = "/root/.local/share/tbexp-provision/wheels"
ETC_MOUNT = "/root/.local/share/tbexp-provision/etc"
APT_CONF = 'Acquire::Retries "0";\n'  # offline, test.sh's apt-get update fails at once instead of retrying
DEFAULT_UV_VERSION = "0.9.5"  # what TB2's test.sh files install; used when the installer URL names no version
DEFAULT_PINS = {"pytest": "8.4.1", "pytest-json-ctrf": "0.3.5"}  # TB2's pins, for a test.sh that pins neither
PYTHONS = ("3.9", "3.10", "3.11", "3.12", "3.13", "3.14")  # wheels are fetched for each; uv init's floor is the first
OPT_OUT_KEY = "TBEXP_PROVISION"  # [verifier.env] TBEXP_PROVISION = "0" turns provisioning off for a task
PIP_TIMEOUT_S = 600.0
VERIFIER_ENV = {
    "UV_OFFLINE": "1",
    "UV_NO_INDEX": "1",
    "UV_FIND_LINKS": WHEELS_MOUNT,
    "UV_PYTHON_DOWNLOADS": "never",
    "UV_PYTHON_PREFERENCE": "only-system",
    "UV_CONCURRENT_INSTALLS": "4",  # threads count against the sandbox's pids limit; uv's default is one per core
    "UV_CONCURRENT_DOWNLOADS": "4",
    "UV_NO_PROGRESS": "1",
    "UV_LINK_MODE": "copy",  # the uv cache (/tmp) and a project (/tests, /app) are on different mounts
    "UV_NO_CONFIG": "1",  # a uv.toml the agent left in its home or above the project must not steer the tests
    "PIP_CONFIG_FILE": os.devnull,  # the same for pip.conf
    "PIP_NO_INDEX": "1",
    "PIP_FIND_LINKS": WHEELS_MOUNT,
    "APT_CONFIG": f"{ETC_MOUNT}/apt.conf",
}
ENV_FILE = """#!/bin/sh
# Put $HOME/.local/bin first on PATH, once (what the uv installer's env file does).
case ":$PATH:" in
  *":$HOME/.local/bin:"*) ;;
  *) export PATH="$HOME/.local/bin:$PATH" ;;
esac
"""

_UV_COMMAND = re.compile(r"(^|[\s;&|(`$])(uvx|uv|pip3?)(\s|$)", re.MULTILINE)
_INSTALLER_VERSION = re.compile(r"astral\.sh/uv/(\d+(?:\.\d+)+)/install\.sh")
_PYTHON_REQUEST = re.compile(r"(?:^|\s)(?:-p|--python)(?:\s+|=)[\"']?(?:python|cpython)?-?(3\.\d+)")
# options of uv/uvx/pip that take a value which is not a requirement
_VALUE_OPTIONS = set(
    "-p --python -r --requirement --with-requirements --from -c --constraint --index-url -i --extra-index-url"
    " --find-links -f --directory --project --cache-dir --target -t --prefix --group --extra --package --name"
    " --build-constraint --python-platform --index --default-index --optional --dev".split()
)
_FETCHER = re.compile(r"(^|[\s;&|(`$])(curl|wget|git\s+clone|git\s+fetch)\s")
_URL = re.compile(r"((?:https?|ftp)://([^/\s\"':]+)[^\s\"']*)")
LOCAL_HOSTS = {"localhost", "127.0.0.1", "0.0.0.0", "[::1]"}  # what the sandbox itself may serve
_WITH_OPTIONS = {"-w", "--with", "--with-editable"}


class ProvisionError(SandboxError):
    """What a task's test.sh needs could not be provisioned (an infrastructure failure, not the agent's)."""


@dataclass(frozen=True)
class Provision:
    uv_version: str
    requirements: tuple[str, ...]  # what was provisioned, as written for pip
    pythons: tuple[str, ...]  # the versions test.sh asks uv for (`-p 3.13`, `--python 3.12`)
    bin_dir: Path  # host folder bound at BIN_MOUNT
    wheels_dir: Path  # host folder bound at WHEELS_MOUNT
    etc_dir: Path  # host folder bound at ETC_MOUNT: apt.conf
    interpreters: tuple[str, ...] | None = None  # python3.X the environment has, set by the sandbox at start

    @property
    def mounts(self) -> list[tuple[Path, str]]:
        """(host path, sandbox path) pairs to bind read-only."""
        return [(self.bin_dir, BIN_MOUNT), (self.wheels_dir, WHEELS_MOUNT), (self.etc_dir, ETC_MOUNT)]

    def with_interpreters(self, names: list[str]) -> Provision:
        versions = sorted({m.group(1) for n in names if (m := re.fullmatch(r"python(3\.\d+)", n))}, key=_version_key)
        return replace(self, interpreters=tuple(versions))


@dataclass(frozen=True)
class Needs:
    """What a test.sh asks for, read from its text."""

    uv_version: str
    requirements: tuple[str, ...]
    pythons: tuple[str, ...]


def _test_scripts(task) -> list[Path]:
    """Every test.sh the task's verifier may run: the task's, and each step's of a multi-step task."""
    dirs = [task.tests_dir, *(d for step in getattr(task, "steps", []) for d in step.tests_dirs)]
    return [d / "test.sh" for d in dict.fromkeys(dirs) if (d / "test.sh").is_file()]


def prepare(task) -> Provision | None:
    """The provision for a task's tests (built on first use), or None when it needs or wants none.

    A test.sh that fetches something from the network besides the uv installer
    is refused here, before the agent runs: offline, its verdict could not be trusted.
    """
    scripts = _test_scripts(task)
    if not scripts:
        return None  # nothing runs a test.sh here
    test_sh = ", ".join(map(str, scripts))
    script = "\n".join(path.read_text(errors="replace") for path in scripts)
    urls = network_fetches(script)
    if urls:
        raise ProvisionError(
            f"{test_sh} fetches {', '.join(urls)}; tbexp's sandboxes have no network, so this task's "
            "verdicts could not be trusted and it is not run (only the uv bootstrap is provisioned)"
        )
    if opted_out(task):
        return None
    needs = read_needs(script)
    if needs is None:
        return None
    root = cache_root() / "provision"
    bin_dir = _ensure(
        root / f"uv-{needs.uv_version}-{platform.machine()}", lambda tmp: _build_uv(tmp, needs.uv_version)
    )
    digest = hashlib.sha256("\n".join(needs.requirements).encode()).hexdigest()[:16]
    wheels = _ensure(root / f"wheels-{digest}", lambda tmp: _build_wheels(tmp, needs.requirements, bin_dir / "uv"))
    etc = _ensure(
        root / f"etc-{hashlib.sha256(APT_CONF.encode()).hexdigest()[:8]}",
        lambda tmp: (tmp / "apt.conf").write_text(APT_CONF),
    )
    return Provision(needs.uv_version, needs.requirements, needs.pythons, bin_dir, wheels, etc)


def opted_out(task) -> bool:
    value = (task.config.get("verifier", {}).get("env") or {}).get(OPT_OUT_KEY)
    if value is None:
        return False
    if str(value).strip().lower() in ("0", "false", "no", "off"):
        return True
    if str(value).strip().lower() in ("1", "true", "yes", "on"):
        return False
    raise ProvisionError(f"{task.path / 'task.toml'}: [verifier.env] {OPT_OUT_KEY} must be 0 or 1, got {value!r}")


def read_needs(script: str) -> Needs | None:
    """The uv version, requirements and Python versions a test.sh asks for; None when it uses neither uv nor pip.

    >>> n = read_needs("curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh\\nuvx -p 3.13 -w pytest==8.4.1 pytest")
    >>> n.uv_version, n.requirements, n.pythons
    ('0.7.13', ('pytest-json-ctrf==0.3.5', 'pytest==8.4.1'), ('3.13',))
    """
    text = re.sub(r"\\\n", " ", script)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    if not _UV_COMMAND.search(text) and not _INSTALLER_VERSION.search(text):
        return None
    found = _INSTALLER_VERSION.search(text)
    pins: dict[str, str] = {}
    for command in re.split(r"&&|\|\||[;|\n]", text):
        for spec in _requirements_in(command):
            try:
                req = Requirement(spec)
            except InvalidRequirement:
                continue  # a path, a URL or shell syntax: nothing to fetch
            name = re.sub(r"[-_.]+", "-", req.name).lower()
            pins[name] = str(req.specifier) if req.specifier else pins.get(name, "")
    for name, version in DEFAULT_PINS.items():
        if not pins.get(name):
            pins[name] = f"=={version}"
    requirements = tuple(sorted(f"{name}{spec}" for name, spec in pins.items()))
    pythons = tuple(sorted(set(_PYTHON_REQUEST.findall(text)), key=_version_key))
    return Needs(found.group(1) if found else DEFAULT_UV_VERSION, requirements, pythons)


def network_fetches(script: str) -> list[str]:
    """URLs a test.sh downloads with curl, wget or git clone, other than the uv installer and local hosts.

    >>> network_fetches("curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh\\nwget -q http://example.com/a.json")
    ['http://example.com/a.json']
    """
    urls = []
    text = re.sub(r"\\\n", " ", script)
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not _FETCHER.search(line):
            continue
        for url, host in _URL.findall(line):
            installer = _INSTALLER_VERSION.search(url) or "astral.sh/uv/install" in url
            if host.lower() not in LOCAL_HOSTS and not installer:
                urls.append(url)
    return urls


def missing_python(provision: Provision | None) -> str:
    """Why tests that did not run could not have run for want of an interpreter, or '' when that is not why.

    Only a version the environment itself lacks counts: the interpreters were
    listed before the agent ran, so one the agent deleted is the agent's doing.
    """
    if provision is None or provision.interpreters is None:
        return ""
    lacking = [v for v in provision.pythons if v not in provision.interpreters]
    if not lacking:
        return ""
    has = ", ".join(f"python{v}" for v in provision.interpreters) or "no python3.X"
    return (
        f"test.sh asks uv for Python {', '.join(lacking)}, which this environment does not have (it has {has}); "
        "tbexp provisions uv and the test packages offline but no interpreter, and downloads none"
    )


def verifier_command(provision: Provision | None, command: str) -> str:
    """`command` with VERIFIER_ENV assigned before it (unchanged without a provision)."""
    if provision is None:
        return command
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in VERIFIER_ENV.items())
    # a fresh uv cache: one the agent filled (say, with a fake pytest) must not be what the tests run on
    return f'{assignments} UV_CACHE_DIR="$(mktemp -d /tmp/tbexp-uv-cache.XXXXXX)" {command}'


INTERPRETER_PROBE = "ls /usr/local/bin /usr/bin /bin 2>/dev/null"  # what a sandbox runs to list its python3.X
_probed: dict[str, list[str]] = {}  # image id -> names INTERPRETER_PROBE printed there, before any agent ran


def interpreters_of_image(image_id: str, probe) -> list[str]:
    """The names `probe()` lists in an image's bin folders, asked once per image and process."""
    if image_id not in _probed:
        _probed[image_id] = probe().split()
    return _probed[image_id]


def interpreters_in_root(root: Path) -> list[str]:
    """The names in a root file system's bin folders (where PATH would find python3.X)."""
    return [p.name for d in ("usr/local/bin", "usr/bin", "bin") if (root / d).is_dir() for p in (root / d).iterdir()]


# -- parsing --------------------------------------------------------------------


def _requirements_in(command: str) -> list[str]:
    """Requirement strings of one shell command that runs uv, uvx or pip."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return []
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # FOO=bar uv ...
        words.pop(0)
    if not words:
        return []
    tool = Path(words[0]).name
    rest = words[1:]
    if tool in ("python", "python3") and rest[:2] == ["-m", "pip"]:
        tool, rest = "pip", rest[2:]
    if tool == "uv" and rest[:2] in (["tool", "run"], ["pip", "install"]):
        tool, rest = ("uvx" if rest[0] == "tool" else "pip"), rest[2:]
    elif tool == "uv" and rest[:1] in (["add"], ["run"], ["sync"], ["init"]):
        tool, rest = f"uv {rest[0]}", rest[1:]
    elif tool in ("pip", "pip3") and rest[:1] == ["install"]:
        tool, rest = "pip", rest[1:]
    elif tool != "uvx":
        return []
    found, positional = [], []
    i = 0
    while i < len(rest):
        word = rest[i]
        option, eq, value = word.partition("=")
        if option in _WITH_OPTIONS:
            if eq:
                found.append(value)
            elif i + 1 < len(rest):
                found.append(rest[i + 1])
                i += 1
        elif option == "--from" and tool == "uvx":
            found.append(value if eq else (rest[i + 1] if i + 1 < len(rest) else ""))
            i += 0 if eq else 1
        elif option in _VALUE_OPTIONS:
            i += 0 if eq else 1
        elif word.startswith("-"):
            pass
        elif tool == "uvx":  # the tool, then its own arguments
            found.append(word.split("@")[0] if "@" not in word else word.replace("@", "=="))
            break
        elif tool == "uv run":
            break  # the command uv runs
        else:
            positional.append(word)
        i += 1
    if tool in ("uv add", "pip"):
        found += positional
    return [f for f in found if f and not f.startswith((".", "/", "-"))]


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


# -- building -------------------------------------------------------------------

_ready: set[Path] = set()  # folders this process already found complete


def _ensure(folder: Path, build) -> Path:
    """`folder`, built by `build(tmp)` unless complete already; one builder at a time, across processes."""
    if folder in _ready or (folder / ".complete").exists():
        _ready.add(folder)
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".complete").exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
            tmp.chmod(0o755)  # readable by a sandbox's non-root user too
            try:
                build(tmp)
                (tmp / ".complete").touch()
                shutil.rmtree(folder, ignore_errors=True)  # an incomplete one from a killed build
                tmp.rename(folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    _ready.add(folder)
    return folder


def _build_uv(out: Path, version: str) -> None:
    """uv, uvx and env from PyPI's static musl `uv` wheel (it runs on glibc and musl alike)."""
    machine = platform.machine()
    with tempfile.TemporaryDirectory() as tmp:
        _pip(
            [
                "download",
                "--no-deps",
                "--only-binary=:all:",
                f"--platform=musllinux_1_1_{machine}",
                "--dest",
                tmp,
                f"uv=={version}",
            ],
            f"uv {version}",
        )
        wheels = list(Path(tmp).glob("uv-*.whl"))
        if not wheels:
            raise ProvisionError(f"pip download uv=={version} for musllinux_1_1_{machine} gave no wheel")
        with zipfile.ZipFile(wheels[0]) as whl:
            for member in whl.namelist():
                if re.fullmatch(r"uv-[^/]+\.data/scripts/(uv|uvx)", member):
                    target = out / Path(member).name
                    target.write_bytes(whl.read(member))
                    target.chmod(0o755)
    if not (out / "uv").exists() or not (out / "uvx").exists():
        raise ProvisionError(f"the uv {version} wheel holds no uv and uvx binaries")
    (out / "env").write_text(ENV_FILE)
    (out / "env").chmod(0o644)


def _build_wheels(out: Path, requirements: tuple[str, ...], uv: Path) -> None:
    """Every distribution `requirements` can need on any Python of PYTHONS and any platform, as wheels."""
    (out / "requirements.in").write_text("\n".join(requirements) + "\n")
    locked, floor = _compile(out / "requirements.in", uv)
    (out / "requirements.txt").write_text("\n".join(locked) + "\n")
    lines = [Requirement(line) for line in locked]
    machine = platform.machine()
    linux_tags = [f"--platform=manylinux_2_{m}_{machine}" for m in (28, 17, 12, 5)] + [f"--platform=linux_{machine}"]
    fetched: set[str] = set()
    for python in PYTHONS[PYTHONS.index(floor) :]:
        marker_env = {
            "python_version": python,
            "python_full_version": f"{python}.0",
            "sys_platform": "linux",
            "platform_system": "Linux",
            "os_name": "posix",
            "platform_machine": machine,
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
        }
        wanted = [str(_pinned(r)) for r in lines if r.marker is None or _evaluate(r, marker_env)]
        fetched |= set(wanted)
        _download(out, wanted, [f"--python-version={python}", *linux_tags])
    elsewhere = [_pinned(r) for r in lines if _pinned(r) not in fetched]  # e.g. colorama on win32: metadata for uv lock
    _download(out, elsewhere, ["--python-version=3.13", "--platform=win_amd64", "--platform=macosx_11_0_arm64"])
    if not list(out.glob("*.whl")):
        raise ProvisionError(f"no wheel could be fetched for {', '.join(requirements)}")


def _compile(requirements_in: Path, uv: Path) -> tuple[list[str], str]:
    """`uv pip compile --universal` from the lowest Python of PYTHONS it can resolve for: (pinned lines, floor)."""
    errors = []
    for python in PYTHONS:
        result = subprocess.run(
            [
                str(uv),
                "pip",
                "compile",
                "--universal",
                f"--python-version={python}",
                "--no-header",
                "--no-annotate",
                "--quiet",
                str(requirements_in),
            ],
            capture_output=True,
            text=True,
            timeout=PIP_TIMEOUT_S,
            env={k: v for k, v in os.environ.items() if k not in VERIFIER_ENV},  # the host's uv may go online
        )
        if result.returncode == 0:
            return [line for line in result.stdout.splitlines() if line.strip() and not line.startswith("#")], python
        errors.append(f"python {python}: {result.stderr.strip()[-300:]}")
    raise ProvisionError("cannot resolve " + ", ".join(requirements_in.read_text().split()) + ":\n" + errors[-1])


def _pinned(req: Requirement) -> str:
    return f"{req.name}{req.specifier}"


def _evaluate(req: Requirement, env: dict[str, str]) -> bool:
    try:
        return req.marker.evaluate(env)
    except InvalidMarker:
        return True


def _download(out: Path, specs: list[str], target: list[str]) -> None:
    """`pip download` the wheels of `specs` for `target`; one at a time when together they fail."""
    if not specs:
        return
    base = ["download", "--no-deps", "--only-binary=:all:", "--dest", str(out), *target]
    try:
        _pip([*base, *specs], ", ".join(specs))
        return
    except ProvisionError:
        pass
    for spec in specs:
        try:
            _pip([*base, spec], spec)
        except ProvisionError as err:  # e.g. no wheel for this Python yet; uv then finds none either
            log.warning("no wheel of %s for %s: %s", spec, " ".join(target), str(err).splitlines()[-1])


def _pip(args: list[str], what: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--quiet", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
    )
    if result.returncode != 0:
        tail = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("WARNING"))[-500:]
        raise ProvisionError(f"pip download of {what} failed (tbexp fetches it once, on the host):\n{tail}")
