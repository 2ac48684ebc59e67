"""load-nonexec-scripts: test.sh and solve.sh are published without the executable bit; Harbor runs them anyway."""
from pathlib import Path


def test_errors_counted():
    assert Path("/app/errors.txt").read_text() == "a.log 2\nb.log 1\n"
