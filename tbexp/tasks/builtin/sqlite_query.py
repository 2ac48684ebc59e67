"""sqlite-query: select the names of rows above a threshold into a file (one sqlite3 call).

The database is built at generation time with Python's sqlite3 (in memory,
then serialized); the file is byte-identical for a given SQLite library,
which is as deterministic as a binary database gets. Each table has a second
numeric column from the same pool, so the column named in the instruction
decides the answer.
"""

from __future__ import annotations

import random
import sqlite3

from tbexp.tasks.builtin.family import Combo, Family, TaskSpec

DATABASES = ("shop.db", "store.db", "inventory.db", "warehouse.db", "catalog.db", "depot.db")
TABLES = ("items", "products", "parts", "goods", "stock", "tools")
COLUMNS = ("qty", "price", "weight", "rating", "size", "age")
THRESHOLDS = (20, 30, 40, 50, 60, 70)
OUTPUTS = ("names.txt", "result.txt", "out.txt", "list.txt", "answer.txt", "rows.txt")
ROW_NAMES = (
    "anvil",
    "bucket",
    "candle",
    "drill",
    "easel",
    "funnel",
    "gauge",
    "hammer",
    "ink",
    "jack",
    "kettle",
    "ladder",
    "magnet",
    "needle",
    "oar",
    "pliers",
    "quill",
    "ruler",
    "saw",
    "trowel",
)


def build(combo: Combo, rng: random.Random) -> TaskSpec:
    db, table, column, threshold, out = (combo[k] for k in ("db", "table", "column", "threshold", "out"))
    other = rng.choice([c for c in COLUMNS if c != column])
    names = rng.sample(ROW_NAMES, rng.randint(8, 14))
    values = [rng.randint(0, 100) for _ in names]
    for i in range(2):  # at least two rows on each side of the threshold
        values[i], values[-1 - i] = threshold + rng.randint(1, 30), threshold - rng.randint(0, 20)
    rows = [(name, value, rng.randint(0, 100)) for name, value in zip(names, values)]
    query = f"SELECT name FROM {table} WHERE {column} > {threshold} ORDER BY name;"
    return TaskSpec(
        instruction=(
            f"The SQLite database /app/{db} has a table `{table}` with columns `name` and `{column}`. "
            f"Write the names of the rows whose `{column}` is greater than {threshold}, "
            f"one per line in alphabetical order, to /app/{out}."
        ),
        app_files={db: _database_bytes(table, column, other, rows)},
        solution=[f'sqlite3 /app/{db} "{query}" > /app/{out}'],
        expected={"out": f"/app/{out}", "names": sorted(name for name, value, _ in rows if value > threshold)},
    )


def _database_bytes(table: str, column: str, other: str, rows: list[tuple]) -> bytes:
    # Built in memory and serialized: the same bytes as on disk, without a temp file and its fsyncs.
    connection = sqlite3.connect(":memory:")
    connection.execute("PRAGMA page_size = 1024")  # a 2 KB file instead of the default 8 KB
    with connection:
        columns = f"id INTEGER PRIMARY KEY, name TEXT, {column} INTEGER, {other} INTEGER"
        connection.execute(f"CREATE TABLE {table} ({columns})")
        connection.executemany(f"INSERT INTO {table} (name, {column}, {other}) VALUES (?, ?, ?)", rows)
    image = connection.serialize()
    connection.close()
    return image


CHECKS = """
from pathlib import Path

EXPECTED = __EXPECTED__
OUT = Path(EXPECTED["out"])


def _names():
    return [line.strip() for line in OUT.read_text().splitlines() if line.strip()]


def test_output_file_exists():
    assert OUT.is_file(), f"{OUT} was not written"


def test_right_number_of_names():
    assert len(_names()) == len(EXPECTED["names"])


def test_right_names():
    assert set(_names()) == set(EXPECTED["names"])


def test_names_are_in_alphabetical_order():
    assert _names() == sorted(_names())
"""

FAMILY = Family(
    name="sqlite-query",
    description="Query a SQLite table into a text file.",
    category="database",
    difficulty="medium",
    discovery=False,
    pools={"db": DATABASES, "table": TABLES, "column": COLUMNS, "threshold": THRESHOLDS, "out": OUTPUTS},
    build=build,
    checks=CHECKS,
)
