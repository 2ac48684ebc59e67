"""Debian roots that stand in for the images published Dockerfiles start FROM, where no image can be pulled.

`stand_in(image)` maps a FROM name (`python:3.13-slim-bookworm`, `ubuntu:24.04`, ...) to the nearest
Debian suite this host can debootstrap and to the Dockerfile lines that make a plain Debian root look like
that image's family (the python images' pip that installs system-wide, for instance). `suite_root(suite,
cache)` is one `debootstrap --variant=minbase` per suite, cached under `<cache>/environments/debootstrap-
<suite>/`, with tmux, python3 and bash (terminus-2 drives a tmux pane; the verifier needs python3).

What is simplified, and said in docs/environments.md:
* A python image's interpreter is the suite's own: bookworm has 3.11, trixie 3.13. A version the suites lack
  (3.8-3.10, 3.12, 3.14) maps to the nearest suite, and the difference is the task's to bear.
* Ubuntu images map to the Debian suite of about the same age; the root is Debian, not Ubuntu.
* Terminal-Bench's own base images (`ghcr.io/laude-institute/t-bench/python-3-13`, `.../ubuntu-24-04`) are their
  public Dockerfiles' contents on the same stand-ins: python:3.13-slim-bookworm, resp. ubuntu:24.04, plus tmux and
  asciinema (and curl in the python one), WORKDIR /app. Their `deveval` image (many toolchains) has none.
* uv's own image (`ghcr.io/astral-sh/uv:<version>`, what `COPY --from` takes uv from) is a *tool image*: a root with
  only /uv and /uvx, from PyPI's `uv` wheel of that version (`latest` is provision.DEFAULT_UV_VERSION).
* Anything else (alpine, node, a private image) has no stand-in: the environment is refused, or, where a
  Docker engine holds that image locally, the bwrap root is exported from it (environments.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Always in a suite root: what the sandboxes' agents and verifiers need (bash is in minbase already).
SUITE_PACKAGES = ("python3", "tmux", "ca-certificates", "procps")
DEBOOTSTRAP_TIMEOUT_S = 900
HOST_CAS = Path("/usr/local/share/ca-certificates")  # the host's own CAs (an egress proxy's, for one)
HOST_CAS_MARK = ".tbexp-host-cas"
# A python image installs with `pip install` system-wide and has `python`; Debian's python3 refuses
# (PEP 668) and has only `python3`, so the stand-in removes the marker and adds the alias. The image keeps its
# interpreter and pip in /usr/local/bin (`RUN /usr/local/bin/pip install`, `#!/usr/local/bin/python3`): links there.
PYTHON_FLAVOUR = (
    "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
    "python3-pip python3-venv python-is-python3 && rm -rf /var/lib/apt/lists/* "
    "&& rm -f /usr/lib/python3*/EXTERNALLY-MANAGED "
    '&& v=$(python3 -c "import sys; print(*sys.version_info[:2], sep=chr(46))") '
    "&& for f in python python3 python$v; do ln -sf /usr/bin/python3 /usr/local/bin/$f; done "
    "&& for f in pip pip3 pip$v; do ln -sf /usr/bin/pip3 /usr/local/bin/$f; done\n"
)
# Terminal-Bench's base images (their public Dockerfiles): the tools its harness drives, and /app.
TBENCH_PYTHON_FLAVOUR = (
    PYTHON_FLAVOUR
    + "RUN apt-get update && apt-get install -y tmux curl asciinema && rm -rf /var/lib/apt/lists/*\n"
    + "RUN echo 'debconf debconf/frontend select Noninteractive' | debconf-set-selections\n"
    + "WORKDIR /app\n"
)
TBENCH_UBUNTU_FLAVOUR = (
    "RUN apt-get update && apt-get install -y tmux asciinema && rm -rf /var/lib/apt/lists/*\nWORKDIR /app\n"
)
TBENCH = r"ghcr\.io/laude-institute/t-bench"
UV_IMAGE = re.compile(r"ghcr\.io/astral-sh/uv:(latest|\d+\.\d+\.\d+)")  # the distroless one: /uv and /uvx only


@dataclass(frozen=True)
class StandIn:
    image: str  # the FROM name as written
    suite: str  # the Debian suite that serves it
    flavour: str  # Dockerfile lines run on the suite root to make it look like the image's family
    why: str  # the table row that matched, for messages and docs
    tool: str = ""  # a tool image ("uv"): no suite, a root holding only the tool's files
    version: str = ""  # the tool's version


# (pattern on `name:tag`, suite, flavour, why): the first match wins. `{py}` rows map on the python version.
TABLE: tuple[tuple[str, str, str, str], ...] = (
    (TBENCH + r"/python-3-13(:.*)?", "trixie", TBENCH_PYTHON_FLAVOUR, "Terminal-Bench python-3-13: trixie's 3.13"),
    (TBENCH + r"/ubuntu-24-04(:.*)?", "trixie", TBENCH_UBUNTU_FLAVOUR, "Terminal-Bench ubuntu-24-04: trixie"),
    (r"debian:(bookworm|12)([-.].*)?", "bookworm", "", "debian bookworm"),
    (r"debian:(trixie|13|stable|latest)([-.].*)?|debian", "trixie", "", "debian trixie"),
    (r"python:3\.([0-9]|1[01])([-.].*)?", "bookworm", PYTHON_FLAVOUR, "python 3.11 and older: bookworm's 3.11"),
    (
        r"python:3\.(1[2-9])([-.].*)?|python:3|python(:latest)?",
        "trixie",
        PYTHON_FLAVOUR,
        "python 3.12 and newer: trixie's 3.13",
    ),
    (
        r"ubuntu:(2[4-9]\.\d\d|noble|oracular|plucky|questing|latest|rolling)",
        "trixie",
        "",
        "ubuntu 24.04 and newer: trixie",
    ),
    (r"ubuntu:(2[0-3]\.\d\d|focal|jammy|kinetic|lunar|mantic)", "bookworm", "", "ubuntu 20.04-23.10: bookworm"),
)


def stand_in(image: str) -> StandIn | None:
    """The Debian stand-in for a FROM image, or None where there is none.

    >>> stand_in("python:3.13-slim-bookworm").suite, stand_in("ubuntu:22.04").suite
    ('trixie', 'bookworm')
    >>> stand_in("docker.io/library/debian:bookworm-slim").suite
    'bookworm'
    >>> stand_in("alpine:3.20") is None
    True
    >>> stand_in("ghcr.io/astral-sh/uv:0.9.5").tool, stand_in("ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624").suite
    ('uv', 'trixie')
    """
    name = re.sub(r"^(docker\.io/)?(library/)?", "", image.split("@")[0])
    if found := UV_IMAGE.fullmatch(name):
        from tbexp.sandboxes.provision import DEFAULT_UV_VERSION

        version = DEFAULT_UV_VERSION if found.group(1) == "latest" else found.group(1)
        return StandIn(image, "", "", f"uv's image: /uv and /uvx of uv {version}", tool="uv", version=version)
    for pattern, suite, flavour, why in TABLE:
        if re.fullmatch(pattern, name):
            return StandIn(image, suite, flavour, why)
    return None


def table_text() -> str:
    """The FROM -> suite table, one line a row, for refusals."""
    return "; ".join([*(f"{why}" for _, _, _, why in TABLE), "ghcr.io/astral-sh/uv:<version>: uv's tool image"])


def suite_root(suite: str, cache: Path, log) -> Path:
    """`<cache>/environments/debootstrap-<suite>`, made by debootstrap once (needs root and Debian's mirror)."""
    root = cache / "environments" / f"debootstrap-{suite}"
    if (root / ".tbexp-complete").exists():
        if not (root / HOST_CAS_MARK).exists():
            add_host_cas(root)
        return root
    from tbexp.sandboxes.base import EnvironmentBuildError

    if shutil.which("debootstrap") is None:
        raise EnvironmentBuildError(
            "debootstrap not found (apt-get install debootstrap): it makes the Debian roots of bwrap environments"
        )
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    log(f"debootstrap {suite} into {root} (about a minute, once per suite)")
    argv = ["debootstrap", "--variant=minbase", f"--include={','.join(SUITE_PACKAGES)}", suite, str(partial)]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=DEBOOTSTRAP_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise EnvironmentBuildError(f"debootstrap {suite}: no result after {DEBOOTSTRAP_TIMEOUT_S} s") from err
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
        raise EnvironmentBuildError(f"debootstrap {suite} failed:\n{tail}")
    for path in ("app", "logs", "tests", "solution"):  # mount points bwrap binds over
        (partial / path).mkdir(exist_ok=True)
    shutil.rmtree(partial / "var/cache/apt/archives", ignore_errors=True)
    (partial / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
    add_host_cas(partial)
    (partial / ".tbexp-complete").touch()
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)
    return root


def add_host_cas(root: Path) -> None:
    """Trust what the host trusts beyond Debian's list, so builds reach the registries the host reaches.

    Where the host's traffic passes a TLS-inspecting proxy, pip and curl in a root without its CA fail
    every https download; the stand-ins are local anyway, so they carry the host's extra CAs.
    """
    cas = sorted(HOST_CAS.glob("*.crt")) if HOST_CAS.is_dir() else []
    if cas:
        dest = root / "usr/local/share/ca-certificates"
        dest.mkdir(parents=True, exist_ok=True)
        for ca in cas:
            shutil.copyfile(ca, dest / ca.name)
        result = subprocess.run(["chroot", str(root), "update-ca-certificates"], capture_output=True, text=True)
        if result.returncode != 0:
            from tbexp.sandboxes.base import EnvironmentBuildError

            raise EnvironmentBuildError(f"{root}: update-ca-certificates failed: {result.stderr.strip()[-300:]}")
    (root / HOST_CAS_MARK).touch()
