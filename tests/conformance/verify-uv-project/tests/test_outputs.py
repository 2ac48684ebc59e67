from pathlib import Path

OUT = Path("/app/squares.txt")


def test_file_exists():
    assert OUT.is_file()


def test_five_lines():
    assert len(OUT.read_text().split()) == 5


def test_values():
    assert [int(x) for x in OUT.read_text().split()] == [1, 4, 9, 16, 25]
