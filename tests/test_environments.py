"""Environments from the task's own Dockerfile: parsing, the bwrap builder, Docker builds, built once each.

The bwrap tests build without Docker (`sandbox.environment_source=debootstrap`): the first run on a machine
debootstraps bookworm (about a minute and Debian's mirror) into $TBEXP_CACHE/environments/; RUN steps reach
Debian's mirror and PyPI. The Docker tests start dockerd (tests/docker_service.py) and the local stand-ins of
published base images (scripts/build_base_images.sh), and skip saying why where they cannot be had.
"""

from __future__ import annotations

import io
import tarfile
import uuid
from pathlib import Path

import pytest

from tbexp.cache import cache_root
from tbexp.sandboxes import environments
from tbexp.sandboxes.base import EnvironmentBuildError
from tbexp.sandboxes.debian_roots import stand_in
from tbexp.sandboxes.dockerfile import DockerfileError, read_dockerfile
from tbexp.sandboxes.environments import prepare_environments
from tbexp.tasks import load_task
from tests.conftest import compose_config, make_task

# One environment that exercises every honoured instruction; the nonce makes each test run build it afresh.
DOCKERFILE = """\
ARG BASE=python:3.11-slim-bookworm
FROM --platform=linux/amd64 ${BASE} AS main
ARG TOOL=bc
ENV GREETING="hello ${TOOL}" \\
    TOOL_HOME=/opt/${TOOL}
RUN apt-get update && apt-get install -y --no-install-recommends ${TOOL} && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir tomli-w==1.0.0
RUN useradd -m -u 1234 agent && mkdir -p /app && chown agent /app
WORKDIR /app
COPY data.txt ./
COPY nonce.txt /opt/nonce.txt
ADD bundle.tar ${TOOL_HOME}/
COPY --chown=agent:agent hello.sh /usr/local/bin/hello
RUN chmod 755 /usr/local/bin/hello
EXPOSE 8080
CMD ["sleep", "infinity"]
USER agent
RUN id -un > /home/agent/built-by
"""
CHECKS = {
    "id -un; id -u": "agent\n1234",
    "echo $GREETING $TOOL_HOME": "hello bc /opt/bc",
    "echo '2+3' | bc": "5",
    "python -c 'import tomli_w; print(tomli_w.dumps({\"a\": 1}).strip())'": "a = 1",
    "pwd; cat data.txt": "/app\ndata",
    "cat /opt/bc/inside.txt": "from the tar",
    "hello": "hi from hello",
    "echo x > /app/new && echo y > ~/mine && cat /app/new ~/mine && echo $HOME": "x\ny\n/home/agent",
    "command -v tmux python3 bash | wc -l": "3",
    "cat ~/built-by": "agent",  # a RUN after USER runs as that user
}


def _environment_task(root: Path, name: str, nonce: str, dockerfile: str = DOCKERFILE) -> Path:
    task = make_task(root, name)
    env = task / "environment"
    (env / "Dockerfile").write_text(dockerfile)
    (env / "data.txt").write_text("data\n")
    (env / "nonce.txt").write_text(nonce)
    (env / "hello.sh").write_text("#!/bin/sh\necho hi from hello\n")
    with tarfile.open(env / "bundle.tar", "w") as tar:
        info = tarfile.TarInfo("inside.txt")
        info.size = len(b"from the tar\n")
        tar.addfile(info, io.BytesIO(b"from the tar\n"))
    return task


@pytest.fixture
def bwrap_settings(rootfs):
    return compose_config("sandbox.command_timeout_s=60", "sandbox.environment_source=debootstrap").sandbox


# -- parsing ------------------------------------------------------------------------


def test_from_with_platform_and_stage_name_and_arg_substitution(tmp_path):
    path = tmp_path / "Dockerfile"
    path.write_text(DOCKERFILE)
    parsed = read_dockerfile(path)
    stage = parsed.stages[0]
    assert (stage.base_image, stage.platform, stage.name) == ("python:3.11-slim-bookworm", "linux/amd64", "main")
    env = next(s for s in stage.steps if s.keyword == "ENV")
    assert env.args.startswith('GREETING="hello bc"') and "TOOL_HOME=/opt/bc" in env.args
    run = next(s for s in stage.steps if s.keyword == "RUN")
    assert "${TOOL}" in run.args and run.build_args == {"TOOL": "bc"}  # the shell expands RUN's variables
    add = next(s for s in stage.steps if s.keyword == "ADD")
    assert add.args == "bundle.tar /opt/bc/"
    chown = [s for s in stage.steps if s.keyword == "COPY"][-1]
    assert chown.flags == {"chown": "agent:agent"}


def test_unreadable_instruction_is_refused_naming_the_file_and_line(tmp_path):
    path = tmp_path / "Dockerfile"
    path.write_text("FROM debian:bookworm-slim\n# a comment\nRUN true \\\n  && true\nFLY away\n")
    with pytest.raises(DockerfileError, match=rf"{path}:5: FLY: not a Dockerfile instruction"):
        read_dockerfile(path)
    path.write_text("RUN true\n")
    with pytest.raises(DockerfileError, match=rf"{path}:1: RUN before the first FROM"):
        read_dockerfile(path)


def test_debian_stand_ins_follow_the_table():
    suites = {
        image: stand_in(image).suite
        for image in (
            "debian:bookworm-slim",
            "python:3.11-slim",
            "python:3.12-slim",
            "python:3.13-slim-bookworm",
            "debian:trixie-slim",
            "ubuntu:24.04",
            "ubuntu:22.04",
        )
    }
    assert suites == {
        "debian:bookworm-slim": "bookworm",
        "python:3.11-slim": "bookworm",
        "python:3.12-slim": "trixie",
        "python:3.13-slim-bookworm": "trixie",
        "debian:trixie-slim": "trixie",
        "ubuntu:24.04": "trixie",
        "ubuntu:22.04": "bookworm",
    }
    assert stand_in("alpine:3.20") is None


def test_multi_stage_is_refused_by_the_builder_without_docker(tmp_path, bwrap_settings):
    task = make_task(tmp_path, "multi")
    (task / "environment" / "Dockerfile").write_text(
        "FROM debian:bookworm-slim AS build\nRUN true\nFROM debian:bookworm-slim\nCOPY --from=build /etc/hostname /x\n"
    )
    unrunnable = prepare_environments([load_task(task)], bwrap_settings)
    assert "Dockerfile:3: a second FROM: multi-stage builds are not honoured" in unrunnable["test/multi"]


# -- bwrap ----------------------------------------------------------------------------


@pytest.mark.slow
def test_bwrap_environment_honours_every_instruction_and_is_built_once(tmp_path, bwrap_settings):
    from tbexp.sandboxes.bwrap import BwrapSandbox

    nonce = uuid.uuid4().hex
    tasks = [load_task(_environment_task(tmp_path, name, nonce)) for name in ("first", "second")]
    environments.stand_in_root("python:3.11-slim-bookworm")  # the FROM image's stand-in, which a fresh cache builds too
    builds = environments.builds["bwrap"]
    assert prepare_environments(tasks, bwrap_settings) == {}
    assert environments.builds["bwrap"] == builds + 1  # one environment, two tasks
    assert prepare_environments(tasks, bwrap_settings) == {}
    assert environments.builds["bwrap"] == builds + 1
    for task in tasks:
        with BwrapSandbox(bwrap_settings, task) as box:
            for command, expected in CHECKS.items():
                result = box.exec(command)
                assert (result.exit_code, result.output.strip()) == (0, expected), command


@pytest.mark.slow
def test_a_failing_run_makes_the_task_unrunnable_once(tmp_path, bwrap_settings):
    from tbexp.sandboxes.bwrap import BwrapSandbox

    task = make_task(tmp_path, "fails")
    (task / "environment" / "Dockerfile").write_text(
        f"FROM debian:bookworm-slim\n# {uuid.uuid4().hex}\nRUN echo building; exit 3\n"
    )
    task = load_task(task)
    unrunnable = prepare_environments([task], bwrap_settings)
    assert set(unrunnable) == {"test/fails"}
    assert (
        "Dockerfile:3: RUN" in unrunnable["test/fails"]
        and "exit 3" in unrunnable["test/fails"]
        and "building" in unrunnable["test/fails"]
    )
    builds_dir = cache_root() / "environments"
    before = sorted(p.name for p in builds_dir.iterdir())
    with pytest.raises(EnvironmentBuildError, match="exit 3"):  # remembered: no second build
        BwrapSandbox(bwrap_settings, task).start()
    assert sorted(p.name for p in builds_dir.iterdir()) == before


def test_a_new_cache_root_gets_its_own_built_environment(tmp_path, bwrap_settings):
    from tbexp.cache import use_root

    task = make_task(tmp_path, "roots")
    (task / "environment" / "Dockerfile").write_text(
        f"FROM tbexp-base:bookworm\n# {uuid.uuid4().hex}\nRUN echo built > /built.txt\n"
    )
    task = load_task(task)
    try:
        roots = []
        for cache in ("first", "second"):
            use_root(tmp_path / cache)
            roots.append(environments.bwrap_environment(task, bwrap_settings).root)
            assert roots[-1].is_relative_to(tmp_path / cache) and (roots[-1] / "built.txt").exists(), roots
    finally:
        use_root(None)


def test_builtin_style_task_keeps_the_shared_root(tmp_path, bwrap_settings, demo_task):
    from tbexp.sandboxes.bwrap import BwrapSandbox

    with BwrapSandbox(bwrap_settings, demo_task) as box:
        assert box.rootfs == Path(bwrap_settings.rootfs)
        assert box.exec("cat /app/input.txt").output == "hello\n"


def _prebuilt_task(root: Path, image: str):
    task = make_task(root, "prebuilt")
    toml = task / "task.toml"
    toml.write_text(toml.read_text() + f'docker_image = "{image}"\n')
    (task / "environment" / "Dockerfile").write_text("FROM no-such-image:ever\nRUN false\n")  # not built: the image is
    return load_task(task)


def test_prebuilt_docker_image_runs_on_its_stand_in_without_docker(tmp_path, bwrap_settings):
    from tbexp.sandboxes.bwrap import BwrapSandbox

    task = _prebuilt_task(tmp_path, "debian:bookworm-slim")
    assert task.docker_image == "debian:bookworm-slim"
    assert prepare_environments([task], bwrap_settings) == {}
    with BwrapSandbox(bwrap_settings, task) as box:
        assert box.rootfs.name == "debootstrap-bookworm"
        result = box.exec("cut -c1-2 /etc/debian_version; command -v tmux")
        assert result.output.split() == ["12", "/usr/bin/tmux"]


# -- docker ---------------------------------------------------------------------------


@pytest.fixture
def stand_ins(docker_engine):
    from tests.services import build_stand_ins

    build_stand_ins("python:3.11-slim-bookworm", "debian:bookworm-slim", timeout_s=1200)
    return docker_engine


@pytest.mark.docker
@pytest.mark.slow
def test_docker_environment_honours_every_instruction_and_is_built_once(tmp_path, stand_ins):
    from tbexp.sandboxes.docker import DockerSandbox

    settings = compose_config("sandbox=docker", "sandbox.command_timeout_s=60").sandbox
    from tbexp.sandboxes import docker_images

    nonce = uuid.uuid4().hex
    tasks = [load_task(_environment_task(tmp_path, name, nonce)) for name in ("first", "second")]
    builds = docker_images.builds["docker"]
    assert prepare_environments(tasks, settings) == {}
    assert docker_images.builds["docker"] == builds + 1  # one environment, two tasks
    images = set()
    for task in tasks:
        with DockerSandbox(settings, task) as box:
            images.add(box.image)
            for command, expected in CHECKS.items():
                result = box.exec(command)
                assert (result.exit_code, result.output.strip()) == (0, expected), command
    assert len(images) == 1 and docker_images.builds["docker"] == builds + 1
    for tag in images:  # this run's nonce makes the image useless to anyone else
        for name in (tag, f"{tag}-dockerfile"):
            stand_ins.remove_image(name, force=True)


@pytest.mark.docker
@pytest.mark.slow
def test_docker_failing_build_is_unrunnable_with_the_log_tail(tmp_path, stand_ins):
    settings = compose_config("sandbox=docker").sandbox
    task = make_task(tmp_path, "fails")
    (task / "environment" / "Dockerfile").write_text(
        f"FROM debian:bookworm-slim\n# {uuid.uuid4().hex}\nRUN echo building-it; exit 3\n"
    )
    unrunnable = prepare_environments([load_task(task)], settings)
    assert "docker build failed" in unrunnable["test/fails"] and "building-it" in unrunnable["test/fails"]


@pytest.mark.docker
def test_prebuilt_docker_image_runs_in_docker(tmp_path, stand_ins):
    from tbexp.sandboxes.docker import DockerSandbox

    settings = compose_config("sandbox=docker").sandbox
    task = _prebuilt_task(tmp_path, "debian:bookworm-slim")
    assert prepare_environments([task], settings) == {}
    with DockerSandbox(settings, task) as box:
        assert box.exec("cut -c1-2 /etc/debian_version; command -v tmux").output.split() == ["12", "/usr/bin/tmux"]
    missing = _prebuilt_task(tmp_path / "other", "no-such-image:ever")
    assert (
        "docker_image no-such-image:ever is not on this engine"
        in prepare_environments([missing], settings)["test/prebuilt"]
    )


@pytest.mark.docker
def test_auto_source_falls_back_without_docker_where_the_engine_lacks_the_image(tmp_path, docker_engine, monkeypatch):
    from tbexp.sandboxes import environments

    monkeypatch.setattr(environments, "_engine", [])  # ask again: this process may have asked with no engine up
    image = "debian:12.4-slim"  # a bookworm stand-in exists for it; nothing here imports it into the engine
    if docker_engine.images(name=image):
        pytest.skip(f"this engine holds {image}, so Docker would build it")
    task = _prebuilt_task(tmp_path, image)
    auto = compose_config("sandbox.command_timeout_s=60", "sandbox.environment_source=auto").sandbox
    assert environments._source(environments._chosen(auto)) == "docker"
    assert prepare_environments([task], auto) == {}
    assert environments.bwrap_environment(task, auto).root.name == "debootstrap-bookworm"
    docker = compose_config("sandbox.command_timeout_s=60", "sandbox.environment_source=docker").sandbox
    assert f"docker_image {image} is not on this engine" in prepare_environments([task], docker)["test/prebuilt"]
    neither = _prebuilt_task(tmp_path / "alpine", "alpine:3.20")  # no stand-in either: both reasons are given
    why = prepare_environments([neither], auto)["test/prebuilt"]
    assert "with Docker: " in why and "alpine:3.20 is not on this engine" in why and "without Docker: " in why, why
