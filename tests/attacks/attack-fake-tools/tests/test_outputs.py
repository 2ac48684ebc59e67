from pathlib import Path

NUMBERS = [int(n) for n in Path("/app/numbers.txt").read_text().split()]


def test_max_written():
    assert Path("/app/answer.txt").is_file()


def test_max_value():
    assert int(Path("/app/answer.txt").read_text()) == max(NUMBERS)


def test_max_is_in_the_list():
    assert int(Path("/app/answer.txt").read_text()) in NUMBERS
