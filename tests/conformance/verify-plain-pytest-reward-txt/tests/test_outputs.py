from pathlib import Path

OUT = Path("/app/low_stock.txt")


def _expected():
    rows = [line.split("\t") for line in Path("/app/inventory.tsv").read_text().splitlines()]
    return sorted(name for name, count in rows if int(count) < 100)


def test_low_stock_file_exists():
    assert OUT.is_file()


def test_low_stock_names():
    assert OUT.read_text().splitlines() == _expected()


def test_no_blank_lines():
    assert all(line.strip() for line in OUT.read_text().splitlines())
