from pathlib import Path


def _errors():
    return sum("ERROR" in line for line in Path("/app/log.txt").read_text().splitlines())


def test_count_present():
    assert Path("/app/answer.txt").exists()


def test_count_matches_the_log():
    assert Path("/app/answer.txt").read_text().strip() == str(_errors())


def test_count_is_one_number():
    assert Path("/app/answer.txt").read_text().split() == [str(int(Path("/app/answer.txt").read_text()))]
