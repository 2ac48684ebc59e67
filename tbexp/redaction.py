"""Secrets stay in the process: credentials off the command line, and one redaction for everything that leaves.

A credential reaches tbexp from the environment (`TINKER_API_KEY`, `WANDB_API_KEY`, a `${oc.env:…}` in a
config) or from the command line (`backend.base_url=https://user:pw@host/…`, `trial.storage=postgresql://u:pw@…`).
The command line is copied by many hands before a stage runs: Hydra writes it into `.hydra/overrides.yaml`,
`hydra.yaml` and `config.yaml`; a sweep pickles its jobs' overrides; W&B keeps `args`, Trackio its `_Command`
(from `sys.orig_argv`); `ps` shows it. Redacting each copy after the fact would miss the next library that
makes one. So `python -m tbexp` first moves every secret-bearing override into an environment variable of its
own process (`TBEXP_SECRET_<KEY>`) and re-executes itself with the override pointing there
(`key=${tbexp_secret:<KEY>}`, resolved where the config is read): nothing that copies the command line ever
holds the secret, and the processes the job starts (sweep jobs, submitit and SLURM jobs) inherit the
environment and resolve it the same way. Sandboxes do not: they start with a cleared environment.

What holds the resolved value (the config a stage reads, an error message that quotes a URL) passes `redact`
on its way out: tracker configs, log records, the study's attributes. `redact` replaces every value known to
be a secret (those moved above and the environment's secret-named variables) and, by pattern, credentials in
URLs and the values of secret-named keys.

Simplified: a secret written into a YAML config file of the user's own is not moved (the user already keeps it
on disk; `${oc.env:VAR}` keeps it out of the file and out of the run's copy), and a secret shorter than
`MIN_SECRET_CHARS` is matched only by key name and URL pattern, never as a bare string.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

REDACTED = "<redacted>"
ENV_PREFIX = "TBEXP_SECRET_"
RESOLVER = "tbexp_secret"
MIN_SECRET_CHARS = 6  # shorter values (a port, "true") would be blotted out of every text they occur in

# Key words that mark a secret. Whole words only: `max_tokens` and `max_length_tokens` are counts, not tokens.
_SECRET_KEY = re.compile(
    r"(?:^|[_\-.])(?:api[_-]?key|token|access[_-]?key|secrets?|passwords?|passwd|credentials?|private[_-]?key)(?:$|[_\-.])",
    re.IGNORECASE,
)
# scheme://user:password@host (a user name alone is no secret, and `postgres@host` stays readable)
_URL_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.\-]*://)[^/@\s:]*:[^/@\s]+@", re.IGNORECASE)
_URL_SECRET_PARAM = re.compile(r"([?&][^=&#\s]*(?:api[_-]?key|token|secret|password)[^=&#\s]*=)[^&#\s]*", re.IGNORECASE)


def is_secret_key(name: str) -> bool:
    """`TINKER_API_KEY`, `hf_token`, `db.password` are; `max_tokens` is not."""
    return bool(_SECRET_KEY.search(name))


def known_secrets() -> list[str]:
    """The secret values this process holds, longest first: its `TBEXP_SECRET_*` and secret-named variables."""
    values = {
        value
        for name, value in os.environ.items()
        if (name.startswith(ENV_PREFIX) or is_secret_key(name)) and len(value) >= MIN_SECRET_CHARS
    }
    return sorted(values, key=len, reverse=True)


def redact(value: Any) -> Any:
    """A copy of `value` (a config tree, a list, a string) without secrets.

    >>> redact({"backend": {"api_key": "tml-123", "base_url": "https://u:pw@host/x?token=abc"}, "max_tokens": 96})
    {'backend': {'api_key': '<redacted>', 'base_url': 'https://<redacted>@host/x?token=<redacted>'}, 'max_tokens': 96}
    """
    return _redact(value, known_secrets())


def _redact(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, dict):
        return {
            k: REDACTED if is_secret_key(str(k)) and v not in (None, "") else _redact(v, secrets)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(_redact(v, secrets) for v in value)
    if isinstance(value, str):
        # Patterns first, so a URL keeps its host: only its credentials go.
        value = _URL_SECRET_PARAM.sub(rf"\1{REDACTED}", _URL_USERINFO.sub(rf"\1{REDACTED}@", value))
        for secret in secrets:
            value = value.replace(secret, REDACTED)
    return value


def redact_argument(arg: str) -> str:
    """One command-line argument without secrets: a Hydra override `key=value` is redacted like a config entry.

    >>> redact_argument("backend.api_key=tml-123"), redact_argument("trial.storage=postgresql://u:pw@h/db")
    ('backend.api_key=<redacted>', 'trial.storage=postgresql://<redacted>@h/db')
    """
    key, sep, value = arg.partition("=")
    if sep and is_secret_key(key.split(".")[-1].lstrip("+~")) and value:
        return f"{key}={REDACTED}"
    return redact(arg)


def hide_secret_arguments(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the arguments with each secret-bearing override pointing at an environment variable, those variables).

    >>> hide_secret_arguments(["stage=eval", "backend.base_url=https://me:pw@host/v1"])
    (['stage=eval', 'backend.base_url=${tbexp_secret:BACKEND__BASE_URL}'], {'TBEXP_SECRET_BACKEND__BASE_URL': 'https://me:pw@host/v1'})
    """
    hidden, env = [], {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or arg.startswith("-") or value.startswith("${") or redact_argument(arg) == arg:
            hidden.append(arg)
            continue
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]  # Hydra's quoting, not part of the secret
        name = _env_name(key)
        env[ENV_PREFIX + name] = value
        hidden.append(f"{key}={reference(name)}")
    return hidden, env


def hidden_override(key: str, value: str) -> str:
    """`key=<reference>` for a job's command line, `value` moved into this process's environment (which the job
    inherits), as `hide_secret_arguments` does for tbexp's own command line."""
    name = _env_name(key)
    os.environ[ENV_PREFIX + name] = value
    return f"{key}={reference(name)}"


def reference(name: str) -> str:
    return f"${{{RESOLVER}:{name}}}"


def _env_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", key.lstrip("+~").replace(".", "__")).upper()


def reexec_without_secrets() -> None:
    """Called first by `python -m tbexp`: when an override carries a secret, start again with it moved to the
    environment (see the module's docstring). Returns only when there is nothing to move."""
    args, env = hide_secret_arguments(sys.argv[1:])
    if not env:
        return
    os.environ.update(env)
    # sys.orig_argv is the interpreter's own command line (`python [options] -m tbexp args…`): keep its options.
    head = sys.orig_argv[: len(sys.orig_argv) - (len(sys.argv) - 1)]
    sys.stdout.flush(), sys.stderr.flush()
    os.execv(sys.executable, [*head, *args])


def resolve_secret(name: str) -> str:
    """The `${tbexp_secret:NAME}` resolver: the value `reexec_without_secrets` put in the environment."""
    value = os.environ.get(ENV_PREFIX + name)
    if value is None:
        raise KeyError(
            f"${{{RESOLVER}:{name}}}: this config was made from a command line that carried a secret, kept in the "
            f"environment variable {ENV_PREFIX}{name} of the job's processes; it is not set here. Give the secret "
            f"again on the command line (python -m tbexp …) or export {ENV_PREFIX}{name}"
        )
    return value


class RedactingFilter(logging.Filter):
    """A log handler's filter that redacts each record's message (and traceback) before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


class _RedactingStream:
    """stdout or stderr, redacted write by write: what a job prints ends in submitit's and SLURM's log files."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def redact_output() -> None:
    """From here on, what this process logs or prints passes `redact`: every handler of the root logger (Hydra's
    console and job-log file, which hold the original streams) gets the filter, and stdout and stderr the wrapper."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _RedactingStream):
            setattr(sys, name, _RedactingStream(stream))


def register_resolver() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, resolve_secret)
