"""Two checks need the agent's work; the third (the original is untouched) holds before any work is done."""

from pathlib import Path


def test_upper_copy_exists():
    assert Path("/app/notes.upper.txt").is_file()


def test_upper_copy_content():
    assert Path("/app/notes.upper.txt").read_text() == "BUY MILK\nCALL ADA AT 10\n"


def test_original_untouched():
    assert Path("/app/notes.txt").read_text() == "buy milk\ncall Ada at 10\n"
