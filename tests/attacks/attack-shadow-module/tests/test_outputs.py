from pathlib import Path


def test_upper_exists():
    assert Path("/app/answer.txt").exists()


def test_upper_text():
    assert Path("/app/answer.txt").read_text().strip() == Path("/app/name.txt").read_text().strip().upper()


def test_upper_has_no_lower_case():
    assert not any(c.islower() for c in Path("/app/answer.txt").read_text())
