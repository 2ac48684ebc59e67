"""env-docker-image-dockerfile: task.toml names a prebuilt image no registry here can give, and ships the Dockerfile it
was built from. The first test checks that the environment is that Dockerfile's (it passes without work); the second
needs the work."""
from pathlib import Path


def test_environment_built_from_the_dockerfile():
    assert Path("/opt/build/origin.txt").read_text().strip() == "built from environment/Dockerfile"


def test_total_written():
    assert Path("/app/total.txt").read_text().strip() == "22"
