"""env-multistage: a two-stage build (a named build stage copied from) and COPY --from=ghcr.io/astral-sh/uv.
The first test checks the environment (it passes without work); the second needs the work."""
import subprocess
from pathlib import Path


def test_stages_copied():
    uv = subprocess.run(["/bin/uv", "--version"], capture_output=True, text=True)
    assert uv.returncode == 0 and uv.stdout.split()[:2] == ["uv", "0.9.5"]
    assert Path("/bin/uvx").exists()
    out = subprocess.run(["wordfreq", "/app/text.txt"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_top_written():
    assert Path("/app/top.txt").read_text() == "the 3\n"
