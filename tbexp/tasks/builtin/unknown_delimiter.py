"""unknown-delimiter: sum a column of a table whose separator and column order must be looked up.

Discovery: the file is a `.dat` with a header row; neither the separator
(comma, semicolon, pipe or tab) nor the position of the asked column is in
the instruction. The oracle looks at the first lines with `head`, then sums
with `awk -F<sep>` on the column number it read from the header.
"""

from __future__ import annotations

import random

from tbexp.tasks.builtin.family import SINGLE_INTEGER_CHECKS, Combo, Family, TaskSpec

FILES = ("table.dat", "export.dat", "records.dat", "dump.dat", "metrics.dat", "rows.dat")
COLUMNS = ("amount", "price", "qty", "score", "cost", "hours")
SEPARATORS = {"comma": ",", "semicolon": ";", "pipe": "|", "tab": "\t"}
AWK_SEPARATORS = {"comma": ",", "semicolon": ";", "pipe": "|", "tab": "\\t"}  # as written after awk -F
OUTPUTS = ("total.txt", "sum.txt", "result.txt", "answer.txt", "out.txt", "value.txt")
ROW_NAMES = ("ash", "birch", "cedar", "elm", "fir", "hazel", "larch", "maple", "oak", "pine", "rowan", "yew")


def build(combo: Combo, rng: random.Random) -> TaskSpec:
    file, column, separator, out = combo["file"], combo["column"], combo["separator"], combo["out"]
    header = ["id", "name", column, rng.choice([c for c in COLUMNS if c != column])]
    rng.shuffle(header)
    position = header.index(column) + 1
    rows, total = [], 0
    for row_id in range(1, rng.randint(6, 14) + 1):
        cells = {"id": str(row_id), "name": rng.choice(ROW_NAMES)}
        for name in header:
            if name not in cells:
                cells[name] = str(rng.randint(1, 250))
        total += int(cells[column])
        rows.append(SEPARATORS[separator].join(cells[name] for name in header))
    program = f"NR>1 {{s+=${position}}} END {{print s}}"
    return TaskSpec(
        instruction=(
            f"/app/data/{file} is a table with a header row, but its column separator is not documented. "
            f"Write the sum of its `{column}` column to /app/{out}."
        ),
        app_files={f"data/{file}": "\n".join([SEPARATORS[separator].join(header), *rows]) + "\n"},
        solution=[
            f"head -n 3 /app/data/{file}",
            f"awk -F'{AWK_SEPARATORS[separator]}' '{program}' /app/data/{file} > /app/{out}",
        ],
        expected={"out": f"/app/{out}", "total": total},
    )


CHECKS = SINGLE_INTEGER_CHECKS

FAMILY = Family(
    name="unknown-delimiter",
    description="Sum a column of a table whose separator is not documented.",
    category="data-processing",
    difficulty="medium",
    discovery=True,
    pools={"file": FILES, "column": COLUMNS, "separator": tuple(SEPARATORS), "out": OUTPUTS},
    build=build,
    checks=CHECKS,
)
