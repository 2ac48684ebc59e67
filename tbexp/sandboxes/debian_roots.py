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
# (PEP 668) and has only `python3`, so the stand-in removes the marker and adds the alias.
PYTHON_FLAVOUR = (
    "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
    "python3-pip python3-venv python-is-python3 && rm -rf /var/lib/apt/lists/* "
    "&& rm -f /usr/lib/python3*/EXTERNALLY-MANAGED\n"
)


@dataclass(frozen=True)
class StandIn:
    image: str  # the FROM name as written
    suite: str  # the Debian suite that serves it
    flavour: str  # Dockerfile lines run on the suite root to make it look like the image's family
    why: str  # the table row that matched, for messages and docs


# (pattern on `name:tag`, suite, flavour, why): the first match wins. `{py}` rows map on the python version.
TABLE: tuple[tuple[str, str, str, str], ...] = (
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
    """
    name = re.sub(r"^(docker\.io/)?(library/)?", "", image.split("@")[0])
    for pattern, suite, flavour, why in TABLE:
        if re.fullmatch(pattern, name):
            return StandIn(image, suite, flavour, why)
    return None


def table_text() -> str:
    """The FROM -> suite table, one line a row, for refusals."""
    return "; ".join(f"{why}" for _, _, _, why in TABLE)


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
