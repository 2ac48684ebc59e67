"""What an image starts (ENTRYPOINT/CMD, HEALTHCHECK) and multi-container tasks (environment/docker-compose.yaml).

The reading rules are checked on their own; then the same small tasks run in bwrap (marked `sandbox`) and Docker
(marked `docker`; tests/docker_service.py starts the engine or skips saying why). Each service test talks to a daemon
whose answer lives only in that daemon's memory, so it passes only where the image's service really runs; on the
commit before image_start.py every one of them failed (the daemon was never started: connection refused).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from tbexp.sandboxes.base import EnvironmentBuildError, SandboxError, make_sandbox
from tbexp.sandboxes.compose_file import MAIN, read_compose, substitute
from tbexp.sandboxes.dockerfile import read_dockerfile
from tbexp.sandboxes.environment_build import ImageConfig
from tbexp.sandboxes.image_start import ImageStart, apply_start
from tbexp.tasks import load_task
from tests.conftest import compose_config, make_task

# A daemon on 127.0.0.1:8765 whose one value is made at start: only a running daemon can give it.
SERVER = """\
import secrets, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
VALUE = secrets.token_hex(6).encode()
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"ok" if self.path == "/health" else VALUE
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
print("serving", flush=True)
HTTPServer((sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1", 8765), H).serve_forever()
"""
GET = "python3 -c \"import urllib.request as u; print(u.urlopen('http://{host}:8765/{path}', timeout=5).read().decode())\""


def _service_task(root: Path, name: str, lines: str) -> Path:
    """A task FROM the base image with the daemon at /app/server.py and `lines` after it (start instructions)."""
    task = make_task(root, name, files={"server.py": SERVER})
    (task / "environment" / "Dockerfile").write_text(
        f"FROM tbexp-base:bookworm\nWORKDIR /app\nCOPY app/ /app/\n{lines}"
    )
    return task


# -- reading ------------------------------------------------------------------------------------------------------


def _start_of(tmp_path: Path, text: str) -> ImageStart:
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    config = ImageConfig(start=ImageStart(cmd=["bash"]))  # the base image's CMD, as Docker inherits it
    for step in read_dockerfile(path).stages[-1].steps:
        if step.keyword in ("CMD", "ENTRYPOINT", "HEALTHCHECK"):
            apply_start(step, config.start, config.shell)
    return config.start


def test_start_instructions_are_read_as_docker_keeps_them(tmp_path):
    start = _start_of(tmp_path, 'FROM x\nENTRYPOINT ["/start.sh"]\n')
    assert (start.entrypoint, start.cmd) == (["/start.sh"], None)  # an ENTRYPOINT resets the base image's CMD
    assert start.service_argv() == ["/start.sh", "sh", "-c", "sleep infinity"]  # Harbor's command for main
    start = _start_of(tmp_path, 'FROM x\nCMD ["--port", "1"]\nENTRYPOINT ["srv"]\n')
    assert start.cmd == ["--port", "1"]  # ...but not a CMD this build set
    start = _start_of(tmp_path, "FROM x\nCMD redis-server --port 7\n")
    assert start.service_argv() == ["/bin/sh", "-c", "redis-server --port 7"]  # shell form through SHELL
    for idle in ('CMD ["bash"]', 'CMD ["python3"]', "CMD sleep infinity", 'CMD ["tail", "-f", "/dev/null"]'):
        assert _start_of(tmp_path, f"FROM x\n{idle}\n").service_argv() is None, idle
    start = _start_of(tmp_path, "FROM x\nHEALTHCHECK --interval=2s --timeout=1m --retries=5 CMD curl -f localhost\n")
    check = start.healthcheck
    assert (check.test, check.interval_s, check.timeout_s, check.retries) == (
        ["CMD-SHELL", "curl -f localhost"],
        2,
        60,
        5,
    )
    assert _start_of(tmp_path, "FROM x\nHEALTHCHECK CMD true\nHEALTHCHECK NONE\n").healthcheck is None
    with pytest.raises(EnvironmentBuildError, match=r"Dockerfile:2: HEALTHCHECK --bogus=1: not a HEALTHCHECK option"):
        _start_of(tmp_path, "FROM x\nHEALTHCHECK --bogus=1 CMD true\n")


def test_image_config_from_docker_inspect():
    config = {
        "Entrypoint": ["/e"],
        "Cmd": ["a"],
        "Healthcheck": {"Test": ["CMD", "true"], "Interval": 2_000_000_000, "Retries": 4},
    }
    start = ImageStart.from_docker(config)
    assert start.service_argv() == ["/e", "sh", "-c", "sleep infinity"]
    assert (start.healthcheck.interval_s, start.healthcheck.timeout_s, start.healthcheck.retries) == (2, 30, 4)
    assert ImageStart.from_docker({"Cmd": ["/bin/bash"]}).service_argv() is None


def _compose_task(root: Path, compose: str, name: str = "multi", files: dict[str, str] | None = None):
    task = make_task(root, name)
    (task / "environment" / "docker-compose.yaml").write_text(compose)
    for rel, text in (files or {}).items():
        (task / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / "environment" / rel).write_text(text)
    return load_task(task)


def test_compose_file_is_read_with_harbors_variables_and_its_own(tmp_path):
    task = _compose_task(
        tmp_path,
        """
services:
  main:
    build: {context: "${CONTEXT_DIR}"}
    image: ${MAIN_IMAGE_NAME}
    environment: ["API=http://api:${PORT:-8000}", "LITERAL=$$HOME"]
    depends_on: {api: {condition: service_healthy}, db: {condition: service_started}}
  api:
    build: ./api
    environment: {MODE: test, DEBUG: true}
    healthcheck: {test: "curl -f localhost", interval: 500ms, retries: 7}
    depends_on: [db]
  db:
    image: tbexp-base:bookworm
    command: sleep 1000
    volumes: ["./seed.sql:/docker-entrypoint-initdb.d/seed.sql:ro"]
    ports: ["5432:5432"]
""",
        files={"api/Dockerfile": "FROM tbexp-base:bookworm\n", "seed.sql": "select 1;\n"},
    )
    services = read_compose(task, "tbexp-task:abc")
    main, api, db = services[MAIN], services["api"], services["db"]
    assert main.image == "tbexp-task:abc" and main.command == ["sh", "-c", "sleep infinity"]  # Harbor's base file
    assert main.environment == {"API": "http://api:8000", "LITERAL": "$HOME"}
    assert main.depends_on == {"api": "service_healthy", "db": "service_started"}
    assert api.build["context"] == task.environment_dir / "api" and api.environment == {"MODE": "test", "DEBUG": "true"}
    assert (api.healthcheck.test, api.healthcheck.interval_s, api.healthcheck.retries) == (
        ["CMD-SHELL", "curl -f localhost"],
        0.5,
        7,
    )
    assert db.command == ["sh", "-c", "sleep 1000"] and db.copies == [
        (task.environment_dir / "seed.sql", "/docker-entrypoint-initdb.d/seed.sql")
    ]
    assert substitute("${NEEDED:?set it}", {"NEEDED": "x"}, "") == "x"
    with pytest.raises(EnvironmentBuildError, match=r"\$\{NEEDED\} is required: set it"):
        substitute("${NEEDED:?set it}", {}, "f")


@pytest.mark.parametrize(
    "compose, message",
    [
        ("services:\n  side:\n    image: x\n    privileged: true\n", r"services\.side\.privileged: not honoured"),
        (
            "services:\n  side:\n    image: x\n    volumes: ['/etc:/host-etc']\n",
            r"only files of the task's environment/",
        ),
        (
            "services:\n  side:\n    image: x\n    volumes: ['data:/var/lib/x']\n",
            r"named volumes and host paths are not",
        ),
        ("services:\n  a:\n    image: x\n    depends_on: [b]\n  b:\n    image: x\n    depends_on: [a]\n", "a cycle"),
        ("services:\n  main:\n    image: other:1\n", "main is built from environment/"),
        ("services:\n  main:\n    working_dir: /srv\n", r"main\.working_dir: not honoured for main"),
        ("services:\n  side: {}\n", r"services\.side: neither `image` nor `build`"),
        ("services:\n  main:\n    depends_on: [ghost]\n", r"main\.depends_on: no service 'ghost'"),
        ("secrets: {}\nservices: {}\n", "top-level 'secrets'"),
    ],
)
def test_compose_keys_tbexp_cannot_honour_are_refused_by_name(tmp_path, compose, message):
    task = _compose_task(tmp_path, compose)
    with pytest.raises(EnvironmentBuildError, match=message) as caught:
        read_compose(task, "tbexp-task:abc")
    assert "docker-compose.yaml" in str(caught.value)


# -- bwrap --------------------------------------------------------------------------------------------------------


@pytest.fixture
def bwrap_settings(rootfs):
    return compose_config("sandbox.command_timeout_s=30").sandbox


@pytest.mark.sandbox
@pytest.mark.parametrize(
    "lines",
    [
        'CMD ["python3", "/app/server.py"]\n',
        'ENTRYPOINT ["sh", "-c", "python3 /app/server.py >/tmp/srv.log 2>&1 & exec \\"$@\\"", "sh"]\n'
        "HEALTHCHECK --interval=200ms --retries=50 CMD python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:8765/health')\"\n",
    ],
    ids=["cmd", "entrypoint-healthcheck"],
)
def test_the_images_service_runs_before_the_agent_in_bwrap(tmp_path, bwrap_settings, lines):
    from tbexp.sandboxes.bwrap_session import BwrapSessionSandbox

    task = load_task(_service_task(tmp_path, "svc", lines))
    box = make_sandbox(bwrap_settings, task)
    assert isinstance(box, BwrapSessionSandbox)  # its execs share the service's network and processes
    with box:
        assert "server.py" in box.service
        deadline = time.monotonic() + 10
        while (first := box.exec(GET.format(host="127.0.0.1", path="value"))).exit_code and time.monotonic() < deadline:
            time.sleep(0.2)  # without a healthcheck nothing is waited for, as in Docker
        assert first.exit_code == 0, first.output
        box.exec("sleep 0.1 &")  # an agent's exec ending does not end the daemon
        again = box.exec(GET.format(host="127.0.0.1", path="value"))
        assert again.output == first.output  # the same daemon, its value in its memory


@pytest.mark.sandbox
def test_an_idle_cmd_starts_nothing_and_keeps_the_plain_sandbox(tmp_path, bwrap_settings):
    from tbexp.sandboxes.bwrap import BwrapSandbox

    task = load_task(_service_task(tmp_path, "idle", 'CMD ["bash"]\n'))
    box = make_sandbox(bwrap_settings, task)
    assert type(box) is BwrapSandbox
    with box:
        assert box.service == ""


@pytest.mark.sandbox
def test_a_service_that_never_becomes_healthy_fails_the_start_with_its_output(tmp_path, bwrap_settings):
    lines = 'CMD ["sh", "-c", "echo starting-up; sleep 600"]\nHEALTHCHECK --interval=100ms --retries=3 CMD false\n'
    box = make_sandbox(bwrap_settings, load_task(_service_task(tmp_path, "sick", lines)))
    with pytest.raises(
        SandboxError, match=r"(?s)never became healthy: its healthcheck \(false\) failed 3 times.*starting-up"
    ):
        box.start()
    box.stop()


@pytest.mark.sandbox
def test_a_compose_task_is_unrunnable_in_bwrap(tmp_path, bwrap_settings):
    from tbexp.sandboxes.environments import prepare_environments

    task = _compose_task(tmp_path, "services:\n  side:\n    image: tbexp-base:bookworm\n")
    why = prepare_environments([task], bwrap_settings)["test/multi"]
    assert "docker-compose.yaml: a multi-container task" in why and "needs sandbox=docker" in why


# -- docker -------------------------------------------------------------------------------------------------------


@pytest.fixture
def docker_settings(docker_engine):
    return compose_config("sandbox=docker", "sandbox.command_timeout_s=30", "sandbox.max_lifetime_s=600").sandbox


def _owned(api, kind: str) -> list[dict]:
    labels = ["tbexp.sandbox=1", f"tbexp.owner_pid={os.getpid()}"]
    if kind == "networks":
        return api.networks(filters={"label": labels})
    return api.containers(all=True, filters={"label": labels})


@pytest.mark.docker
def test_the_images_service_runs_before_the_agent_in_docker(tmp_path, docker_settings, docker_engine):
    lines = (
        'ENTRYPOINT ["sh", "-c", "python3 /app/server.py >/tmp/srv.log 2>&1 & exec \\"$@\\"", "sh"]\n'
        "HEALTHCHECK --interval=200ms --retries=50 CMD python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:8765/health')\"\n"
    )
    task = load_task(_service_task(tmp_path, "svc", lines))
    with make_sandbox(docker_settings, task) as box:
        assert "server.py" in box.service
        first = box.exec(GET.format(host="127.0.0.1", path="value"))
        assert first.exit_code == 0, first.output
        assert box.exec(GET.format(host="127.0.0.1", path="value")).output == first.output  # not killed by the exec
        config = docker_engine.inspect_container(box.id)["Config"]
        assert config["Healthcheck"]["Test"] == ["NONE"]  # the sandbox waited for it itself
        assert config["Entrypoint"][:2] == ["bash", "-c"]  # the image's ENTRYPOINT is the service, not PID 1


def _host_server() -> tuple[HTTPServer, int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"host")

        def log_message(self, *args):
            pass

    server = HTTPServer(("0.0.0.0", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def _host_addresses() -> list[str]:
    """This host's own IPv4 addresses (never another machine's)."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return [a for a in out if "." in a]


SIDECAR_COMPOSE = """
services:
  main:
    environment: [WEB_URL=http://web:8765]
    depends_on: {web: {condition: service_healthy}}
  web:
    build: ./web
    command: ["python3", "/srv/server.py", "0.0.0.0"]
    healthcheck:
      test: ["CMD", "python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8765/health')"]
      interval: 200ms
      retries: 50
"""


@pytest.mark.docker
def test_compose_sidecar_on_an_internal_network_of_the_episodes_own(tmp_path, docker_settings, docker_engine):
    nonce = uuid.uuid4().hex
    task = _compose_task(
        tmp_path,
        SIDECAR_COMPOSE,
        files={
            "web/Dockerfile": f"FROM tbexp-base:bookworm\n# {nonce}\nCOPY server.py /srv/server.py\n",
            "web/server.py": SERVER,
        },
    )
    server, port = _host_server()
    probe = "python3 -c \"import socket; s = socket.socket(); s.settimeout(2); s.connect(('{addr}', {port})); print('reached')\""
    try:
        with make_sandbox(docker_settings, task) as box:
            assert box.exec("echo $WEB_URL").output == "http://web:8765\n"
            answer = box.exec(GET.format(host="web", path="value"))
            assert answer.exit_code == 0 and len(answer.output.strip()) == 12, answer.output
            sidecars = [c for c in _owned(docker_engine, "containers") if c["Labels"].get("tbexp.service") == "web"]
            assert len(sidecars) == 1 and len(_owned(docker_engine, "networks")) == 1
            for addr in _host_addresses():  # the host itself, on every address it has: out of reach
                assert "reached" not in box.exec(probe.format(addr=addr, port=port)).output, addr
            network = _owned(docker_engine, "networks")[0]
            assert network["Internal"] and network["Options"]["com.docker.network.bridge.inhibit_ipv4"] == "true"
            # The probe can succeed: a container on a plain bridge network of this engine reaches the host.
            control = docker_engine.create_network(f"tbexp-control-{nonce[:8]}", driver="bridge")["Id"]
            try:
                gateway = docker_engine.inspect_network(control)["IPAM"]["Config"][0]["Gateway"]
                out = subprocess.run(
                    ["docker", "run", "--rm", "--network", control, "tbexp-base:bookworm", "bash", "-c",
                     probe.format(addr=gateway, port=port)],
                    capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                assert "reached" in out.stdout, out.stderr
            finally:
                docker_engine.remove_network(control)
    finally:
        server.shutdown()
    assert not _owned(docker_engine, "containers") and not _owned(docker_engine, "networks")  # nothing left


@pytest.mark.docker
def test_a_dead_owners_sidecars_and_network_are_removed(tmp_path, docker_engine):
    task = _compose_task(
        tmp_path,
        SIDECAR_COMPOSE,
        files={"web/Dockerfile": "FROM tbexp-base:bookworm\nCOPY server.py /srv/server.py\n", "web/server.py": SERVER},
    )
    from tests.test_docker_sandbox import _start_in_child

    child, _, _ = _start_in_child(task)  # starts the sandbox (main, its sidecar, their network), then sleeps
    labels = {"label": [f"tbexp.owner_pid={child.pid}"]}
    assert len(docker_engine.containers(filters=labels)) == 2 and len(docker_engine.networks(filters=labels)) == 1
    child.kill()
    child.wait()
    deadline = time.monotonic() + 20
    while (docker_engine.containers(all=True, filters=labels) or docker_engine.networks(filters=labels)) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert not docker_engine.containers(all=True, filters=labels), "the watchdog left the dead owner's containers"
    assert not docker_engine.networks(filters=labels), "the watchdog left the dead owner's network"


@pytest.mark.docker
def test_a_compose_service_image_the_engine_lacks_makes_the_task_unrunnable(tmp_path, docker_settings):
    from tbexp.sandboxes.environments import prepare_environments

    task = _compose_task(tmp_path, "services:\n  db:\n    image: postgres:16-never-pulled\n")
    why = prepare_environments([task], docker_settings)["test/multi"]
    assert "services.db.image postgres:16-never-pulled is not on this engine" in why
