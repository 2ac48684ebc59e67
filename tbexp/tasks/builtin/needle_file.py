"""needle-file: find the one file under a tree that mentions a word, and copy it out.

Discovery: files sit in random subdirectories; other files mention the other
words of the pool, never the asked one. The oracle greps for the file with
`grep -rl`, then copies `"$(grep -rl ...)"` so its last command stands alone.
"""

from __future__ import annotations

import random

from tbexp.tasks.builtin.family import Combo, Family, TaskSpec

DIRS = ("docs", "notes", "mail", "papers", "memos", "drafts")
WORDS = ("password", "deadline", "invoice", "merger", "budget", "launch", "incident", "contract")
DESTINATIONS = ("found", "flagged", "review", "picked", "keep", "hits")
SUBDIRS = ("2023", "2024", "old", "team", "misc", "shared")
FILE_NAMES = (
    "a.txt",
    "b.txt",
    "c.txt",
    "minutes.txt",
    "status.txt",
    "todo.txt",
    "week.txt",
    "plan.txt",
    "log.txt",
    "ideas.txt",
)
FILLER = ("the", "meeting", "moved", "to", "friday", "please", "review", "attached", "team", "update", "call", "soon")


def build(combo: Combo, rng: random.Random) -> TaskSpec:
    folder, word, dest = combo["dir"], combo["word"], combo["dest"]
    names = rng.sample(FILE_NAMES, rng.randint(5, 8))
    files = {}
    for i, name in enumerate(names):
        mention = word if i == 0 else rng.choice([w for w in WORDS if w != word] + [""])
        sentence = rng.choices(FILLER, k=8)
        sentence.insert(rng.randint(0, 8), mention)
        files[f"{folder}/{rng.choice(SUBDIRS)}/{name}"] = " ".join(w for w in sentence if w) + "\n"
    needle_path = next(iter(files))
    return TaskSpec(
        instruction=(
            f"Exactly one file under /app/{folder} mentions the word `{word}`. "
            f"Copy that file into a new directory /app/{dest}, keeping its name."
        ),
        app_files=files,
        solution=[
            f"grep -rl '{word}' /app/{folder}",
            f"mkdir -p /app/{dest} && cp \"$(grep -rl '{word}' /app/{folder})\" /app/{dest}/",
        ],
        expected={
            "dest": f"/app/{dest}",
            "source": f"/app/{needle_path}",
            "name": needle_path.rsplit("/", 1)[1],
            "content": files[needle_path],
        },
    )


CHECKS = """
from pathlib import Path

EXPECTED = __EXPECTED__
DEST = Path(EXPECTED["dest"])


def test_destination_directory_exists():
    assert DEST.is_dir(), f"{DEST} was not created"


def test_destination_holds_only_the_right_file():
    assert [p.name for p in DEST.iterdir()] == [EXPECTED["name"]]


def test_copy_has_the_original_content():
    assert (DEST / EXPECTED["name"]).read_text() == EXPECTED["content"]


def test_original_is_still_in_place():
    assert Path(EXPECTED["source"]).read_text() == EXPECTED["content"]
"""

FAMILY = Family(
    name="needle-file",
    description="Find the one file that mentions a word and copy it out.",
    category="file-search",
    difficulty="medium",
    discovery=True,
    pools={"dir": DIRS, "word": WORDS, "dest": DESTINATIONS},
    build=build,
    checks=CHECKS,
)
