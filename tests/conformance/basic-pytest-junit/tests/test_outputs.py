"""Checks /app/totals.csv against the totals of /app/sales.csv."""

from pathlib import Path

TOTALS = Path("/app/totals.csv")


def test_totals_file_exists():
    assert TOTALS.is_file()


def test_header():
    assert TOTALS.read_text().splitlines()[0] == "region,total"


def test_totals_sorted_by_region():
    assert TOTALS.read_text().splitlines()[1:] == ["east,3", "north,15", "south,8"]
