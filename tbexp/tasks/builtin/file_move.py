"""file-move: move every file of one extension into a new directory (mkdir && mv).

The source directory mixes the asked extension with others from the same
pool; the other files must stay where they are, untouched.
"""

from __future__ import annotations

import random

from tbexp.tasks.builtin.family import Combo, Family, TaskSpec

SOURCES = ("inbox", "downloads", "uploads", "desktop", "scratch", "dump")
EXTENSIONS = ("txt", "csv", "log", "json", "md", "png", "pdf", "jpg")
DESTINATIONS = ("archive", "sorted", "keep", "done", "store", "vault")
BASENAMES = ("report", "photo", "notes", "budget", "draft", "scan", "list", "plan", "memo", "data", "todo", "chart")


def build(combo: Combo, rng: random.Random) -> TaskSpec:
    source, ext, dest = combo["src"], combo["ext"], combo["dest"]
    names = rng.sample(BASENAMES, rng.randint(6, 10))
    n_moved = rng.randint(2, 4)
    moved = sorted(f"{name}.{ext}" for name in names[:n_moved])
    kept = sorted(f"{name}.{rng.choice([e for e in EXTENSIONS if e != ext])}" for name in names[n_moved:])
    files = {f"{source}/{name}": f"{name} {rng.randint(1000, 9999)}\n" for name in moved + kept}
    return TaskSpec(
        instruction=(
            f"Move every `.{ext}` file from /app/{source} into a new directory /app/{dest}. "
            f"Leave all other files in /app/{source} where they are."
        ),
        app_files=files,
        solution=[f"mkdir -p /app/{dest} && mv /app/{source}/*.{ext} /app/{dest}/"],
        expected={
            "source": f"/app/{source}",
            "dest": f"/app/{dest}",
            "moved": {name: files[f"{source}/{name}"] for name in moved},
            "kept": {name: files[f"{source}/{name}"] for name in kept},
        },
    )


CHECKS = """
from pathlib import Path

EXPECTED = __EXPECTED__
SOURCE, DEST = Path(EXPECTED["source"]), Path(EXPECTED["dest"])


def test_destination_directory_exists():
    assert DEST.is_dir(), f"{DEST} was not created"


def test_destination_holds_exactly_the_moved_files():
    assert sorted(p.name for p in DEST.iterdir()) == sorted(EXPECTED["moved"])
    for name, text in EXPECTED["moved"].items():
        assert (DEST / name).read_text() == text, f"{name} changed on the way"


def test_moved_files_are_gone_from_the_source():
    assert not [name for name in EXPECTED["moved"] if (SOURCE / name).exists()]


def test_other_files_stay_untouched():
    for name, text in EXPECTED["kept"].items():
        assert (SOURCE / name).read_text() == text, f"{name} should have stayed in {SOURCE}"
"""

FAMILY = Family(
    name="file-move",
    description="Move the files of one extension into a new directory.",
    category="file-operations",
    difficulty="easy",
    discovery=False,
    pools={"src": SOURCES, "ext": EXTENSIONS, "dest": DESTINATIONS},
    build=build,
    checks=CHECKS,
)
