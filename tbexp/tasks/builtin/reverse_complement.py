"""dna-revcomp: write the reverse complement of a DNA sequence (`rev | tr`).

The input is one line of A/C/G/T (plus its newline, which `rev` keeps at the
end); the checks ignore surrounding whitespace.
"""

from __future__ import annotations

import random

from tbexp.tasks.builtin.family import Combo, Family, TaskSpec

DIRS = ("seq", "dna", "genome", "reads", "samples", "lab")
FILES = ("gene.txt", "plasmid.txt", "fragment.txt", "primer.txt", "insert.txt", "contig.txt")
OUTPUTS = ("revcomp.txt", "reverse.txt", "rc.txt", "complement.txt", "answer.txt", "result.txt")
COMPLEMENT = str.maketrans("ACGT", "TGCA")


def build(combo: Combo, rng: random.Random) -> TaskSpec:
    folder, file, out = combo["dir"], combo["file"], combo["out"]
    sequence = "".join(rng.choice("ACGT") for _ in range(rng.randint(40, 160)))
    return TaskSpec(
        instruction=(
            f"/app/{folder}/{file} holds one DNA sequence on a single line. "
            f"Write its reverse complement (A<->T, C<->G, read backwards) to /app/{out}."
        ),
        app_files={f"{folder}/{file}": sequence + "\n"},
        solution=[f"rev /app/{folder}/{file} | tr ACGT TGCA > /app/{out}"],
        expected={"out": f"/app/{out}", "revcomp": sequence.translate(COMPLEMENT)[::-1]},
    )


CHECKS = """
from pathlib import Path

EXPECTED = __EXPECTED__
OUT = Path(EXPECTED["out"])


def test_output_file_exists():
    assert OUT.is_file(), f"{OUT} was not written"


def test_output_is_a_dna_sequence_of_the_right_length():
    text = OUT.read_text().strip()
    assert set(text) <= set("ACGT"), f"unexpected characters in {text!r}"
    assert len(text) == len(EXPECTED["revcomp"])


def test_sequence_is_the_reverse_complement():
    assert OUT.read_text().strip() == EXPECTED["revcomp"]
"""

FAMILY = Family(
    name="dna-revcomp",
    description="Write the reverse complement of a DNA sequence.",
    category="bioinformatics",
    difficulty="easy",
    discovery=False,
    pools={"dir": DIRS, "file": FILES, "out": OUTPUTS},
    build=build,
    checks=CHECKS,
)
