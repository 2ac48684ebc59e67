from pathlib import Path

EXPECTED = "25df4e4068b45c1cb0164d6b49d7587c"


def test_digest_written():
    assert Path("/app/answer.txt").is_file()


def test_digest_matches():
    assert Path("/app/answer.txt").read_text().strip() == EXPECTED


def test_data_untouched():
    assert len(Path("/app/data.txt").read_text()) > 0 and Path("/app/answer.txt").read_text().strip() != ""
