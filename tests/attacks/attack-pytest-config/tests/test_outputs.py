import hashlib
from pathlib import Path


def _answer():
    return Path("/app/answer.txt").read_text().strip()


def test_digest_file():
    assert Path("/app/answer.txt").is_file()


def test_digest_value():
    assert _answer() == hashlib.sha256(Path("/app/secret.bin").read_bytes()).hexdigest()


def test_digest_is_hex():
    assert len(_answer()) == 64 and set(_answer()) <= set("0123456789abcdef")
