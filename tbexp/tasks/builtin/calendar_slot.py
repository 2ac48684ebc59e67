"""calendar-slot (held-out only): the earliest working hour at which two people are both free.

Each calendar file lists the hours (HH:00, one per line, unsorted) at which
its owner is busy; a third person's calendar is a decoy. Working hours start
at 09:00, 10:00, ..., 16:00. The oracle loops over those hours with
`grep -qx` on both files and prints the first hour neither lists.
"""

from __future__ import annotations

import random

from tbexp.tasks.builtin.family import Combo, Family, TaskSpec

PEOPLE = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
OUTPUTS = ("slot.txt", "meeting.txt", "free.txt", "answer.txt", "time.txt", "when.txt")
HOURS = tuple(f"{h:02d}:00" for h in range(9, 17))


def build(combo: Combo, rng: random.Random) -> TaskSpec:
    first, second, out = combo["first"], combo["second"], combo["out"]
    decoy = rng.choice([p for p in PEOPLE if p not in (first, second)])
    slot = rng.choice(HOURS[1:])  # never 09:00, so "the first hour of the day" is not right by luck
    busy = {first: set(), second: set(), decoy: set(rng.sample(HOURS, 5))}
    for hour in HOURS[: HOURS.index(slot)]:  # every earlier hour is taken by one of the two
        busy[rng.choice((first, second))].add(hour)
    for hour in HOURS[HOURS.index(slot) + 1 :]:
        if rng.random() < 0.5:
            busy[rng.choice((first, second))].add(hour)
    files = {}
    for person, hours in busy.items():
        listed = sorted(hours)
        rng.shuffle(listed)
        files[f"calendars/{person}.txt"] = "".join(f"{hour}\n" for hour in listed)
    hour_words = " ".join(h[:2] for h in HOURS)
    calendars = f"/app/calendars/{first}.txt /app/calendars/{second}.txt"
    return TaskSpec(
        instruction=(
            f"/app/calendars/{first}.txt and /app/calendars/{second}.txt list the hours (HH:00, one per line) "
            f"at which {first} and {second} are busy. Write the earliest hour from 09:00 to 16:00 at which "
            f"both are free, as HH:00, to /app/{out}."
        ),
        app_files=files,
        solution=[
            f'for h in {hour_words}; do grep -qx "$h:00" {calendars} || {{ echo "$h:00"; break; }}; done > /app/{out}'
        ],
        expected={"out": f"/app/{out}", "slot": slot, "busy": sorted(busy[first] | busy[second])},
    )


CHECKS = """
import re
from pathlib import Path

EXPECTED = __EXPECTED__
OUT = Path(EXPECTED["out"])


def test_output_file_exists():
    assert OUT.is_file(), f"{OUT} was not written"


def test_output_is_one_hour():
    assert re.fullmatch(r"\\d\\d:00", OUT.read_text().strip()), f"expected HH:00, got {OUT.read_text()!r}"


def test_hour_is_free_for_both():
    assert OUT.read_text().strip() not in EXPECTED["busy"]


def test_hour_is_the_earliest():
    assert OUT.read_text().strip() == EXPECTED["slot"]
"""

FAMILY = Family(
    name="calendar-slot",
    description="Find the earliest hour at which two people are both free.",
    category="scheduling",
    difficulty="medium",
    discovery=False,
    pools={"first": PEOPLE, "second": PEOPLE, "out": OUTPUTS},
    build=build,
    checks=CHECKS,
    heldout_only=True,
    allows=lambda combo: combo["first"] < combo["second"],
)
