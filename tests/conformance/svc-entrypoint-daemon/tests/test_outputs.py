"""svc-entrypoint-daemon: the image's ENTRYPOINT starts a daemon before the agent, as a container of the image would.
The first test checks the daemon answers (it passes without work); the second needs the work, and the value it checks
exists only in that daemon's memory."""
import urllib.request
from pathlib import Path

URL = "http://127.0.0.1:8080"


def test_daemon_answers():
    assert urllib.request.urlopen(f"{URL}/health", timeout=5).read() == b"ok"


def test_answer_written():
    expected = urllib.request.urlopen(f"{URL}/key/answer", timeout=5).read().decode()
    assert Path("/app/answer.txt").read_text().strip() == expected
