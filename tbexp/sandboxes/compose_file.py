"""A multi-container task's `environment/docker-compose.yaml`, read as Compose reads it (for compose.py to run).

Harbor runs such a task with `docker compose` (v2), merging the task's file over its own base file, whose `main`
service is the agent's container (built from `environment/`, `command: sh -c "sleep infinity"`). `read_compose(task,
main_image)` does that merge itself: Compose's variable substitution (`${VAR}`, `${VAR:-d}`, `${VAR-d}`,
`${VAR:?msg}`, `${VAR:+alt}`, `$$`) over Harbor's compose variables (`MAIN_IMAGE_NAME`, `CONTEXT_DIR`, `TEST_DIR`) and
the task's `[environment] env`, an unset variable empty as in Compose (the host's own environment is not read: an
episode does not depend on who runs it), and every service as a `Service`, `main` among them.

Honoured per service: `build` (a context, or `context`, `dockerfile`, `args`, `target`), `image`, `environment`
(list or map), `env_file`, `command`, `entrypoint`, `working_dir`, `user`, `hostname`, `depends_on` (list or map with
`condition`), `healthcheck` (`test`, `interval`, `timeout`, `retries`, `start_period`, `disable`), and `volumes` that
copy a file or folder of the task's `environment/` in (`./seed.json:/data/seed.json[:ro]`, copied before the service
starts; read-only is not enforced). Ignored, as they change nothing an episode sees: `ports`, `expose`,
`container_name`, `restart`, `labels`, `init`, `stdin_open`, `tty`, `deploy`, `networks` (every service is on the
episode's one network), `pull_policy`, `platform`, and on `main` volumes under /logs (Harbor's log mounts). Anything
else (`privileged`, `cap_add`, `network_mode`, `devices`, host paths in `volumes`, named volumes, `extends`,
`secrets`, `profiles`, ...) makes the task unrunnable, the message naming the key. `main` is always built from
`environment/` (its Dockerfile, or the task's `docker_image`): another build or image for it is refused, and so are
its `user` and `working_dir` (the sandbox takes those from the image and task.toml).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tbexp.sandboxes.base import EnvironmentBuildError
from tbexp.sandboxes.image_start import Healthcheck, duration_s

COMPOSE_FILE = "docker-compose.yaml"
MAIN = "main"
SERVICE_KEYS = {
    "build", "image", "environment", "env_file", "command", "entrypoint", "working_dir", "user", "hostname",
    "depends_on", "healthcheck", "volumes",
}  # fmt: skip
IGNORED_KEYS = {
    "ports", "expose", "container_name", "restart", "labels", "init", "stdin_open", "tty", "deploy", "networks",
    "pull_policy", "platform",
}  # fmt: skip
TOP_KEYS = {"services", "version", "name", "networks", "volumes", "x-"}  # top-level `networks`/`volumes`: definitions
CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")


@dataclass
class Service:
    name: str
    image: str = ""  # the image to run: the given one, or (with `build`) the tag built for it
    build: dict[str, Any] | None = None  # context (Path), dockerfile, args, target
    environment: dict[str, str] = field(default_factory=dict)
    command: list[str] | None = None
    entrypoint: list[str] | None = None
    working_dir: str = ""
    user: str = ""
    hostname: str = ""
    depends_on: dict[str, str] = field(default_factory=dict)  # service -> condition
    healthcheck: Healthcheck | None = None
    healthcheck_disabled: bool = False
    copies: list[tuple[Path, str]] = field(default_factory=list)  # (task file, path in the container)


def compose_file(task: Any) -> Path | None:
    path = task.environment_dir / COMPOSE_FILE
    return path if path.is_file() else None


def read_compose(task: Any, main_image: str) -> dict[str, Service]:
    """The compose file's services (`main` always among them, merged over Harbor's base); errors name the key."""
    import yaml

    path = compose_file(task)
    variables = {
        "MAIN_IMAGE_NAME": main_image,
        "CONTEXT_DIR": str(task.environment_dir),
        "TEST_DIR": "/tests",
        **{str(k): str(v) for k, v in (task.config.get("environment", {}).get("env") or {}).items()},
    }
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise EnvironmentBuildError(f"{path}: cannot be read as YAML: {err}") from err
    if not isinstance(document, dict) or not isinstance(document.get("services"), dict):
        raise EnvironmentBuildError(f"{path}: no `services:` mapping")
    if unknown := [k for k in document if k not in TOP_KEYS and not str(k).startswith("x-")]:
        raise EnvironmentBuildError(f"{path}: top-level {unknown[0]!r}: not honoured by tbexp's compose runner")
    document = substitute(document, variables, str(path))
    services = {MAIN: Service(MAIN, main_image, command=["sh", "-c", "sleep infinity"])}  # Harbor's base file
    for name, spec in document["services"].items():
        services[name] = _service(str(name), spec or {}, path, services.get(name), main_image)
    for service in services.values():
        for dependency in service.depends_on:
            if dependency not in services:
                raise EnvironmentBuildError(f"{path}: services.{service.name}.depends_on: no service {dependency!r}")
    order(services, path)  # a cycle is an error now, not at start
    return services


def _service(name: str, spec: dict, path: Path, base: Service | None, main_image: str) -> Service:
    where = f"{path}: services.{name}"
    if not isinstance(spec, dict):
        raise EnvironmentBuildError(f"{where}: not a mapping")
    for key in spec:
        if key not in SERVICE_KEYS and key not in IGNORED_KEYS:
            raise EnvironmentBuildError(f"{where}.{key}: not honoured by tbexp's compose runner (docs/environments.md)")
    service = base or Service(name)
    context = path.parent
    if "build" in spec:
        service.build = _build(spec["build"], context, where)
    if "image" in spec:
        service.image = str(spec["image"])
    if name == MAIN:
        if service.build and service.build["context"].resolve() != context.resolve() or service.image != main_image:
            raise EnvironmentBuildError(
                f"{where}: main is built from environment/ (its Dockerfile) as Harbor's base file builds it; "
                "another build context or image for main is not honoured"
            )
        service.build = None
        if unhonoured := sorted({"user", "working_dir"} & set(spec)):
            raise EnvironmentBuildError(
                f"{where}.{unhonoured[0]}: not honoured for main (the sandbox takes its user and working directory "
                "from the image and task.toml: set USER / WORKDIR in the Dockerfile)"
            )
    elif not service.image and not service.build:
        raise EnvironmentBuildError(f"{where}: neither `image` nor `build`")
    service.environment.update(_environment(spec, context, where))
    for key in ("command", "entrypoint"):
        if key in spec:
            value = spec[key]
            setattr(service, key, value if isinstance(value, list) else (["sh", "-c", value] if value else []))
    service.working_dir = str(spec.get("working_dir", service.working_dir))
    service.user = str(spec.get("user", service.user))
    service.hostname = str(spec.get("hostname", service.hostname))
    service.depends_on = _depends_on(spec.get("depends_on", {}), where) or service.depends_on
    if "healthcheck" in spec:
        service.healthcheck, service.healthcheck_disabled = _healthcheck(spec["healthcheck"], where)
    service.copies = _volumes(spec.get("volumes", []), context, where, name)
    return service


def _build(spec: Any, context: Path, where: str) -> dict[str, Any]:
    spec = {"context": spec} if isinstance(spec, str) else dict(spec or {})
    unknown = set(spec) - {"context", "dockerfile", "args", "target"}
    if unknown:
        raise EnvironmentBuildError(f"{where}.build.{sorted(unknown)[0]}: not honoured by tbexp's compose runner")
    folder = (context / str(spec.get("context", "."))).resolve()
    if not folder.is_dir() or not folder.is_relative_to(context.resolve()):
        raise EnvironmentBuildError(f"{where}.build.context: {folder} is not a folder of the task's environment/")
    args = spec.get("args") or {}
    args = dict(a.split("=", 1) if "=" in a else (a, "") for a in args) if isinstance(args, list) else args
    return {
        "context": folder,
        "dockerfile": str(spec.get("dockerfile", "Dockerfile")),
        "args": {str(k): str(v) for k, v in args.items()},
        "target": str(spec.get("target", "")),
    }


def _environment(spec: dict, context: Path, where: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for file in [spec["env_file"]] if isinstance(spec.get("env_file"), str) else spec.get("env_file") or []:
        source = (context / str(file)).resolve()
        if not source.is_file() or not source.is_relative_to(context.resolve()):
            raise EnvironmentBuildError(f"{where}.env_file: {file} is not a file of the task's environment/")
        for line in source.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#") and "=" in line:
                key, _, value = line.partition("=")
                env[key.strip()] = value.strip().strip("'\"")
    value = spec.get("environment") or {}
    if isinstance(value, list):
        value = dict(item.split("=", 1) if "=" in item else (item, "") for item in map(str, value))
    env.update(
        {str(k): "" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}
    )
    return env


def _depends_on(spec: Any, where: str) -> dict[str, str]:
    if isinstance(spec, list):
        return {str(name): "service_started" for name in spec}
    found = {}
    for name, options in (spec or {}).items():
        condition = (options or {}).get("condition", "service_started")
        if condition not in CONDITIONS:
            raise EnvironmentBuildError(f"{where}.depends_on.{name}.condition: {condition!r}; one of {CONDITIONS}")
        found[str(name)] = condition
    return found


def _healthcheck(spec: dict, where: str) -> tuple[Healthcheck | None, bool]:
    if spec.get("disable"):
        return None, True
    test = spec.get("test")
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    if not test or test[0] == "NONE":
        return None, True
    if test[0] not in ("CMD", "CMD-SHELL"):
        raise EnvironmentBuildError(f"{where}.healthcheck.test: starts with CMD or CMD-SHELL, got {test[0]!r}")
    values = {"interval": 30.0, "timeout": 30.0, "start_period": 0.0}
    for key in values:
        if key in spec:
            values[key] = duration_s(spec[key], f"{where}.healthcheck.{key}")
    return Healthcheck(
        list(map(str, test)), values["interval"], values["timeout"], values["start_period"], int(spec.get("retries", 3))
    ), False


def _volumes(spec: list, context: Path, where: str, name: str) -> list[tuple[Path, str]]:
    copies = []
    for entry in spec:
        if isinstance(entry, dict):
            source, target = str(entry.get("source", "")), str(entry.get("target", ""))
        else:
            source, _, rest = str(entry).partition(":")
            target = rest.split(":")[0]
        if name == MAIN and (target == "/logs" or target.startswith("/logs/")):
            continue  # Harbor's log mounts: tbexp's sandbox keeps /logs itself
        local = (context / source).resolve()
        if source.startswith((".", "/")) is False or not local.is_relative_to(context.resolve()) or not local.exists():
            raise EnvironmentBuildError(
                f"{where}.volumes: {entry!r}: only files of the task's environment/ are honoured (copied in); "
                "named volumes and host paths are not"
            )
        copies.append((local, target))
    return copies


def order(services: dict[str, Service], path: Path | str = "") -> list[str]:
    """Service names so that each comes after what it depends on (`main` last); a cycle is an error."""
    done: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in done:
            return
        if name in visiting:
            raise EnvironmentBuildError(f"{path}: depends_on has a cycle through {name!r}")
        visiting.add(name)
        for dependency in services[name].depends_on:
            visit(dependency)
        visiting.discard(name)
        done.append(name)

    for name in sorted(services, key=lambda n: n == MAIN):
        visit(name)
    return done


def substitute(value: Any, variables: dict[str, str], where: str) -> Any:
    """Compose's variable substitution in every string of `value`.

    >>> substitute({"a": ["${X:-d}", "$$HOME", "${Y-}", "$X"]}, {"X": "1"}, "")
    {'a': ['1', '$HOME', '', '1']}
    """
    if isinstance(value, dict):
        return {k: substitute(v, variables, where) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, variables, where) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(2)
        op, word = match.group(3) or "", match.group(4) or ""
        present, current = name in variables, variables.get(name, "")
        if op in (":-", "-"):
            return current if (current if op == ":-" else present) else word
        if op in (":?", "?"):
            if not (current if op == ":?" else present):
                raise EnvironmentBuildError(f"{where}: ${{{name}}} is required: {word or 'not set'}")
            return current
        if op in (":+", "+"):
            return word if (current if op == ":+" else present) else ""
        return current

    pattern = r"\$\$|\$(?:([A-Za-z_][A-Za-z0-9_]*)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\})"
    return re.sub(pattern, one, value)
