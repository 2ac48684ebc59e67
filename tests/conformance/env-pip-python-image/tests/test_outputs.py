"""env-pip-python-image: a python image's interpreter and pip live in /usr/local/bin, and `pip install` installs
system-wide. The first test checks the environment (it passes without work); the second needs the work."""
import shutil
import subprocess
import tomllib
from pathlib import Path


def test_python_image_layout():
    assert shutil.which("pip") == "/usr/local/bin/pip" and shutil.which("python") == "/usr/local/bin/python"
    version = subprocess.run(["/usr/local/bin/python3", "--version"], capture_output=True, text=True).stdout
    assert version.startswith("Python 3.13")
    import tomli_w  # noqa: F401  (RUN python -m pip install, visible to every user)


def test_toml_written():
    assert tomllib.loads(Path("/app/settings.toml").read_text()) == {"name": "demo", "port": 8080, "debug": False}
