"""archive-lines (held-out only): count the lines of a file packed inside an archive of unknown name and format.

Discovery: the directory holds one archive (`.tar`, `.tar.gz` or `.tgz`, name
random per instance); the asked file sits in a top folder inside it among
decoys. The oracle lists the directory and the archive, then streams the
member out with `tar -xOf` (GNU tar detects gzip itself) into `wc -l`.
The archive is built in memory with fixed owners and times and gzip mtime 0,
so it is byte-identical on every run.
"""

from __future__ import annotations

import gzip
import io
import random
import tarfile

from tbexp.tasks.builtin.family import COUNT_CHECKS, Combo, Family, TaskSpec

DIRS = ("drop", "incoming", "delivery", "backup", "parcel", "transfer")
MEMBERS = ("data.txt", "names.txt", "items.txt", "notes.txt", "list.txt", "words.txt")
OUTPUTS = ("count.txt", "lines.txt", "result.txt", "answer.txt", "n.txt", "total.txt")
ARCHIVE_STEMS = ("bundle", "export", "snapshot", "package", "payload")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
WORDS = ("red", "green", "blue", "cyan", "amber", "ivory", "olive", "coral", "plum", "teal", "sand", "rust")


def build(combo: Combo, rng: random.Random) -> TaskSpec:
    folder, member, out = combo["dir"], combo["member"], combo["out"]
    stem = rng.choice(ARCHIVE_STEMS)
    archive = stem + rng.choice(ARCHIVE_SUFFIXES)
    members = {}
    for name in [member, *rng.sample([m for m in MEMBERS if m != member], 2)]:
        members[f"{stem}/{name}"] = "".join(f"{rng.choice(WORDS)}\n" for _ in range(rng.randint(3, 40)))
    line_count = members[f"{stem}/{member}"].count("\n")
    return TaskSpec(
        instruction=(
            f"The directory /app/{folder} holds an archive that contains a file named `{member}`. "
            f"Write the number of lines of that file to /app/{out}."
        ),
        app_files={f"{folder}/{archive}": _archive_bytes(members, gzipped=archive != stem + ".tar")},
        solution=[
            f"ls /app/{folder}",
            f"tar -tf /app/{folder}/{archive}",
            f"tar -xOf /app/{folder}/{archive} {stem}/{member} | wc -l > /app/{out}",
        ],
        expected={"out": f"/app/{out}", "count": line_count},
    )


def _archive_bytes(members: dict[str, str], gzipped: bool) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, text in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(text.encode()), 1_700_000_000, 0o644
            tar.addfile(info, io.BytesIO(text.encode()))
    # Drop tarfile's padding to a 10 KB record: tar needs only the two zero blocks, and files stay < 4 KB.
    data = buffer.getvalue()[: tar.offset]
    return gzip.compress(data, mtime=0) if gzipped else data


CHECKS = COUNT_CHECKS

FAMILY = Family(
    name="archive-lines",
    description="Count the lines of a file inside an archive of unknown name and format.",
    category="archives",
    difficulty="medium",
    discovery=True,
    pools={"dir": DIRS, "member": MEMBERS, "out": OUTPUTS},
    build=build,
    checks=CHECKS,
    heldout_only=True,
)
