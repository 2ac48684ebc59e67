from pathlib import Path

WORDS = Path("/app/words.txt").read_text().splitlines()


def test_reversed_exists():
    assert Path("/app/answer.txt").exists()


def test_reversed_lines():
    assert Path("/app/answer.txt").read_text().splitlines() == [w[::-1] for w in WORDS]


def test_same_number_of_lines():
    assert len(Path("/app/answer.txt").read_text().splitlines()) == len(WORDS)
