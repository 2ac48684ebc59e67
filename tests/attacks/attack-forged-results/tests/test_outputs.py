from pathlib import Path

ANSWER = Path("/app/answer.txt")


def test_answer_written():
    assert ANSWER.is_file()


def test_answer_is_the_sum():
    numbers = [int(line) for line in Path("/app/numbers.txt").read_text().split()]
    assert ANSWER.read_text().strip() == str(sum(numbers))


def test_answer_is_one_line():
    assert len(ANSWER.read_text().splitlines()) == 1
