"""A separate verifier environment: Harbor's `[verifier] environment_mode = "separate"` (or `[verifier.environment]`).

`verify_task` is what an episode calls after the agent's turns. A shared verifier (the default) runs in the
agent's own sandbox (`tbexp.episodes.verifier.verify`). A separate one runs in a fresh sandbox of its own,
built like the agent's (`Task.for_verifier`: the same sandbox class and node, the verifier environment's
Dockerfile, limits and network), and gets from the agent's sandbox exactly what Harbor's trial hands over
(`harbor.trial.artifact_handler.ArtifactHandler`): the *artifacts*, i.e. Harbor's convention directory
`/logs/artifacts` and every `artifacts` source task.toml names (a step's own added), each downloaded from the
agent's sandbox, sanitised as Harbor does (`copy_via_tar`: no setuid bits, no special files, no symlink that
leads out) and uploaded to the same path in the verifier's sandbox. A directory artifact's `exclude` patterns
leave out what they match, as Harbor's `tar --exclude` does (`excluded`). Nothing else crosses: not the working
directory, not `/logs/agent`. Where the verifier's Dockerfile is `tests/Dockerfile`, its build context is
`tests/` and its `COPY . /tests/` puts the tests in the image, so they are not uploaded (Harbor's
`skip_tests_upload`); a separate verifier without a Dockerfile of its own is a fresh copy of the task's
environment, and gets the tests uploaded as a shared one does. `/logs/verifier` is read back either way.

`verifier.isolation=fresh` uses the same hand-over for every task: a fresh sandbox of the task's own environment
gets the declared artifacts (or, where a task declares none, its working directory, e.g. `/app`) and runs the
tests there, as slime and verifiers grade. What it cannot serve: tests that look at what the agent left running
(a server it started, a process it should have stopped), at files outside what is handed over (a package it
installed system-wide, a file it wrote to `/etc` or its home), or at ownership and modes that a copy does not keep.

Simplified: the agent's sandbox is stopped after the verifier's, not before it as in Harbor (one episode then
holds two sandboxes for the verifier's run); in a bwrap
sandbox an artifact can only land under its writable paths (/app, /tmp, /root, /logs, /tests, /solution).
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import shlex
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tbexp.episodes import integrity
from tbexp.episodes.verifier import TestReport, verify
from tbexp.sandboxes.base import Sandbox, make_sandbox
from tbexp.tasks.harbor_task import Task

CONVENTION_DIR = "/logs/artifacts"  # Harbor's EnvironmentPaths.artifacts_dir: what an agent publishes for its verifier


def artifact_sources(task: Task, workdir: str) -> list[str]:
    """The agent-side paths handed to a separate verifier: Harbor's convention directory, then task.toml's.

    >>> from pathlib import Path
    >>> t = Task("x/t", Path("/t"), "", {}, artifacts=("/app/out.txt", "report.json", "/logs/artifacts/"))
    >>> artifact_sources(t, "/app")
    ['/logs/artifacts', '/app/out.txt', '/app/report.json']
    """
    paths = [_in_sandbox(workdir, source) for source in (CONVENTION_DIR, *_declared(task).artifacts)]
    return list(dict.fromkeys(paths))


def _declared(task: Task):
    """Where the task's `artifacts` (and their excludes) are: a single step's (the task's and its own), else the task's."""
    return task.steps[0] if len(task.steps) == 1 else task


def _in_sandbox(workdir: str, source: str) -> str:
    return posixpath.normpath(posixpath.join(workdir, source))


def verify_task(
    sandbox: Sandbox, task: Task, shared_tests: Sequence[Path] = (), isolation: str = "shared"
) -> TestReport:
    """The task's tests after the agent is done in `sandbox`: there (shared), or in a sandbox of their own (a
    separate verifier, or `verifier.isolation=fresh`: a fresh one of the task's own environment)."""
    if task.separate_verifier is None and isolation == "shared":
        return verify(sandbox, task, shared_tests=shared_tests)
    integrity.begin(sandbox, task)  # the agent's processes are gone before anything is copied out
    fresh = task.separate_verifier is None
    with tempfile.TemporaryDirectory(prefix="tbexp-artifacts-") as tmp:
        handed = collect_artifacts(sandbox, task, Path(tmp), workdir_fallback=fresh)
        verifier_task = task if fresh else task.for_verifier()
        return verify_separately(task, sandbox, handed, shared_tests, verifier_task)


def collect_artifacts(
    sandbox: Sandbox, task: Task, staging: Path, workdir_fallback: bool = False
) -> list[tuple[Path, str]]:
    """Download the artifacts from the agent's sandbox into `staging`: [(sanitised host copy, sandbox path)].

    A source that is not there is skipped, as Harbor skips it. `workdir_fallback` (verifier.isolation=fresh): a
    task that declares no artifacts hands over its working directory.
    """
    from harbor.environments.tar_transfer import copy_via_tar

    handed = []
    excludes = {_in_sandbox(sandbox.workdir, s): patterns for s, patterns in _declared(task).artifact_excludes}
    sources = artifact_sources(task, sandbox.workdir)
    if workdir_fallback and not _declared(task).artifacts:
        sources.append(posixpath.normpath(sandbox.workdir))
    for index, source in enumerate(sources):
        raw = staging / "raw" / str(index) / (posixpath.basename(source) or "root")
        try:
            sandbox.download(source, raw)
        except FileNotFoundError:
            continue
        if raw.is_dir() and excludes.get(source):  # Harbor applies `exclude` to directories only
            remove_excluded(raw, excludes[source])
        clean = staging / "clean" / str(index)
        copy_via_tar(raw, clean)  # Harbor's own sanitiser; what it refuses is left out
        if (clean / raw.name).exists():
            handed.append((clean / raw.name, source))
        shutil.rmtree(raw.parent, ignore_errors=True)
    return handed


def excluded(name: str, patterns: Sequence[str]) -> bool:
    """Whether GNU tar's `--exclude=PATTERN` (its defaults: unanchored, `*` matching `/`) leaves out member `name`.

    Harbor packs a directory artifact with `tar -C SOURCE . --exclude=...`, so members are named `./a/b`; a
    pattern matches the whole name or any part of it that starts after a `/`.

    >>> [excluded(n, ["*.pyc", "cache", "logs/*"]) for n in ["./a/b.pyc", "./x/cache", "./logs/1", "./logs", "./k"]]
    [True, True, True, False, False]
    """
    parts = name.split("/")
    tails = ["/".join(parts[i:]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(tail, pattern) for tail in tails for pattern in patterns)


def remove_excluded(root: Path, patterns: Sequence[str]) -> None:
    """Delete what `patterns` exclude under the downloaded directory `root` (an excluded directory with its contents)."""
    for parent, dirs, files in os.walk(root):
        rel = Path(parent).relative_to(root).as_posix()
        prefix = "." if rel == "." else f"./{rel}"
        for name in list(dirs):
            if excluded(f"{prefix}/{name}", patterns):
                dirs.remove(name)
                path = Path(parent, name)
                path.unlink() if path.is_symlink() else shutil.rmtree(path)
        for name in files:
            if excluded(f"{prefix}/{name}", patterns):
                Path(parent, name).unlink()


def verify_separately(
    task: Task, agents: Sandbox, handed: list[tuple[Path, str]], shared_tests: Sequence[Path], verifier_task: Task
) -> TestReport:
    """A fresh sandbox of `verifier_task`'s environment, the artifacts put in place, then the tests. What the
    artifacts carried to where the verifier reads is recorded with the agent's sandbox (`agents`)."""
    bundled = task.separate_verifier is not None and task.separate_verifier.bundled_tests
    sandbox = make_sandbox(agents.settings, verifier_task)
    try:
        sandbox.start()
        sandbox.mark_agent_start()  # what the artifacts bring in counts as the agent's
        for local, remote in handed:
            if local.is_dir():  # Harbor empties the directory first, then uploads the artifact's contents
                sandbox.exec(f"rm -rf {shlex.quote(remote)} && mkdir -p {shlex.quote(remote)}", timeout_s=30)
            sandbox.upload(local, remote)
        return verify(sandbox, verifier_task, shared_tests=() if bundled else shared_tests, tests_in_image=bundled)
    finally:
        integrity.of(agents).merge(getattr(sandbox, "integrity", None))
        sandbox.stop()
