"""git-commit: make a directory a git repository and commit one file of it (one line of git).

The task starts from a plain directory rather than a prepared repository:
a .git directory cannot be shipped byte-identically (its index records inode
numbers and times). HOME may be read-only in the sandbox, so the oracle
passes the author on the command line with `git -c`.
"""

from __future__ import annotations

import random

from tbexp.tasks.builtin.family import Combo, Family, TaskSpec

PROJECTS = ("project", "webapp", "tool", "site", "notes", "library")
FILES = ("README.md", "main.py", "config.yaml", "Makefile", "setup.cfg", "index.html", "app.js", "LICENSE")
MESSAGES = ("Initial commit", "Add first file", "First version", "Import sources", "Start project", "Track it")
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")
GIT_AUTHOR = "git -c user.name=tbexp -c user.email=tbexp@example.com"


def build(combo: Combo, rng: random.Random) -> TaskSpec:
    project, file, message = combo["project"], combo["file"], combo["message"]
    others = rng.sample([f for f in FILES if f != file], rng.randint(2, 3))
    files = {f"{project}/{name}": f"{name}: {' '.join(rng.choices(WORDS, k=5))}\n" for name in [file, *others]}
    return TaskSpec(
        instruction=(
            f"Make /app/{project} a git repository and commit only the file `{file}` "
            f"with the message `{message}`. Leave the other files uncommitted."
        ),
        app_files=files,
        solution=[f"cd /app/{project} && git init -q && git add {file} && {GIT_AUTHOR} commit -q -m '{message}'"],
        expected={
            "repo": f"/app/{project}",
            "file": file,
            "content": files[f"{project}/{file}"],
            "message": message,
            "others": sorted(others),
        },
    )


CHECKS = """
import subprocess
from pathlib import Path

EXPECTED = __EXPECTED__
REPO = Path(EXPECTED["repo"])


def _git(*args):
    command = ["git", "-c", "safe.directory=*", "-C", str(REPO), *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def test_directory_is_a_git_repository():
    assert (REPO / ".git").is_dir(), f"{REPO} is not a git repository"


def test_head_commit_has_the_message():
    assert _git("log", "-1", "--format=%s").strip() == EXPECTED["message"]


def test_commit_holds_only_the_file():
    assert _git("ls-tree", "-r", "--name-only", "HEAD").split() == [EXPECTED["file"]]
    assert _git("show", "HEAD:" + EXPECTED["file"]) == EXPECTED["content"]


def test_other_files_are_still_there():
    assert all((REPO / name).is_file() for name in EXPECTED["others"])
"""

FAMILY = Family(
    name="git-commit",
    description="Create a git repository and commit one file.",
    category="version-control",
    difficulty="easy",
    discovery=False,
    pools={"project": PROJECTS, "file": FILES, "message": MESSAGES},
    build=build,
    checks=CHECKS,
)
