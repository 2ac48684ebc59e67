from pathlib import Path

INVENTORY = Path("/app/inventory.csv")


def test_inventory_exists():
    assert INVENTORY.is_file()


def test_inventory_lines():
    assert INVENTORY.read_text().splitlines() == ["item,count", "apples,1", "pears,1"]
