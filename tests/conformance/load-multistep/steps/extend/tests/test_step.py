from pathlib import Path

INVENTORY = Path("/app/inventory.csv")


def test_first_step_lines_kept():
    assert INVENTORY.read_text().splitlines()[:3] == ["item,count", "apples,1", "pears,1"]


def test_new_items_appended():
    assert INVENTORY.read_text().splitlines()[3:] == ["plums,1"]
