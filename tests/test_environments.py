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


def test_terminal_bench_base_images_and_uv_have_stand_ins():
    python = stand_in("ghcr.io/laude-institute/t-bench/python-3-13:20250620")
    ubuntu = stand_in("ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest")
    assert (python.suite, ubuntu.suite) == ("trixie", "trixie")
    assert "asciinema" in python.flavour and "python3-pip" in python.flavour and "WORKDIR /app" in python.flavour
    assert "asciinema" in ubuntu.flavour and "pip" not in ubuntu.flavour  # the real one has no pip either
    assert stand_in("ghcr.io/laude-institute/t-bench/deveval:latest") is None  # contents not read: no stand-in
    uv = stand_in("ghcr.io/astral-sh/uv:0.9.5")
    assert (uv.tool, uv.version, uv.suite) == ("uv", "0.9.5", "")
    assert stand_in("ghcr.io/astral-sh/uv:python3.12-bookworm-slim") is None  # uv's derived images: none
    assert stand_in("ubuntu:26.04").suite == "trixie"
    assert "/usr/local/bin" in stand_in("python:3.13-slim-bookworm").flavour  # where the python images keep pip


def test_build_base_images_defaults_cover_every_stand_in_family():
    """scripts/build_base_images.sh's default set names an image of every row of the table (ubuntu:26.04 too)."""
    from tbexp.sandboxes.debian_roots import TABLE

    script = (Path(__file__).resolve().parents[1] / "scripts" / "build_base_images.sh").read_text()
    start = script.index("IMAGES=(debian")
    defaults = script[start + len("IMAGES=(") : script.index(")", start)].split()
    assert "ubuntu:26.04" in defaults and "ghcr.io/astral-sh/uv:0.9.5" in defaults
    for pattern, *_ in TABLE:
        assert any(__import__("re").fullmatch(pattern, image) for image in defaults), pattern


@pytest.mark.slow
def test_multi_stage_builds_the_stages_the_last_needs(tmp_path, bwrap_settings):
    """Without Docker: an unused stage is never built, a named stage is copied from, uv comes from its tool image."""
    from tbexp.sandboxes.bwrap import BwrapSandbox

    task = make_task(tmp_path, "multi")
    (task / "environment" / "Dockerfile").write_text(
        f"FROM debian:bookworm-slim AS unused\nRUN exit 9\n"
        f"FROM debian:bookworm-slim AS build\nRUN echo built-{uuid.uuid4().hex[:8]} > /out.txt\n"
        "FROM debian:bookworm-slim\nCOPY --from=build /out.txt /opt/x.txt\n"
        'COPY --from=ghcr.io/astral-sh/uv:0.9.5 /uv /uvx /usr/local/bin/\nCMD ["bash"]\n'
    )
    task = load_task(task)
    assert prepare_environments([task], bwrap_settings) == {}
    with BwrapSandbox(bwrap_settings, task) as box:
        result = box.exec("cat /opt/x.txt; uv --version; uvx --version")
        lines = result.output.split("\n")
        assert result.exit_code == 0 and lines[0].startswith("built-") and lines[1].startswith("uv 0.9.5"), (
            result.output
        )
    broken = make_task(tmp_path, "nostage")
    (broken / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nCOPY --from=alpine:3.20 /x /x\n")
    why = prepare_environments([load_task(broken)], bwrap_settings)["test/nostage"]
    assert "Dockerfile:2: COPY --from: alpine:3.20: no Debian stand-in" in why, why


def test_docker_image_that_cannot_be_had_is_built_from_its_dockerfile(tmp_path, bwrap_settings):
    """Terminal-Bench 2.0's convention: a registry image plus the Dockerfile it was built from."""
    from tbexp.sandboxes.bwrap import BwrapSandbox

    task = make_task(tmp_path, "tb2")
    toml = task / "task.toml"
    toml.write_text(toml.read_text() + 'docker_image = "registry.invalid/tbexp/tb2-style:2.0"\n')
    (task / "environment" / "Dockerfile").write_text("FROM tbexp-base:bookworm\nWORKDIR /app\nCOPY app/ /app/\n")
    task = load_task(task)
    assert prepare_environments([task], bwrap_settings) == {}
    with BwrapSandbox(bwrap_settings, task) as box:
        assert box.exec("cat /app/input.txt").output == "hello\n"
        assert box.environment_source == (
            "environment/Dockerfile (docker_image registry.invalid/tbexp/tb2-style:2.0 cannot be had offline; "
            "built from the Dockerfile beside it)"
        )
    (task.environment_dir / "Dockerfile").unlink()  # no Dockerfile: the image is all there is, and it is named
    again = load_task(task.path)
    why = prepare_environments([again], compose_config("sandbox.environment_source=debootstrap").sandbox)
    assert "registry.invalid/tbexp/tb2-style:2.0: no Debian stand-in" in why["test/tb2"]


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
def test_docker_image_the_engine_lacks_is_built_from_its_dockerfile_in_docker(tmp_path, docker_engine):
    from tbexp.agents.base import make_agent
    from tbexp.episodes.policies import make_policy
    from tbexp.episodes.rollout import run_episode

    cfg = compose_config("sandbox=docker", "sandbox.command_timeout_s=60")
    settings, agent = cfg.sandbox, make_agent(cfg.agent)
    task = make_task(tmp_path, "tb2")
    toml = task / "task.toml"
    toml.write_text(toml.read_text() + 'docker_image = "registry.invalid/tbexp/tb2-style:2.0"\n')
    task = load_task(task)
    assert prepare_environments([task], settings) == {}
    episode = run_episode(task, 0, agent, lambda t, a: make_policy("oracle", t, a), settings, max_turns=4)
    assert not episode.invalid and episode.report.strict, episode.invalid
    assert episode.environment == (
        "environment/Dockerfile (docker_image registry.invalid/tbexp/tb2-style:2.0 cannot be had offline; "
        "built from the Dockerfile beside it)"
    )
    prebuilt = _prebuilt_task(tmp_path / "image", "tbexp-base:bookworm")  # an image the engine holds is run
    episode = run_episode(prebuilt, 0, agent, lambda t, a: make_policy("oracle", t, a), settings, max_turns=4)
    assert episode.environment == "docker_image tbexp-base:bookworm"


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
