from pathlib import Path

GREETING = Path("/app/out/greeting.txt")


def test_greeting_exists():
    assert GREETING.is_file()


def test_greeting_text():
    assert GREETING.read_text().strip() == "hello from a prebuilt image"
