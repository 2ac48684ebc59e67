"""`python -m tbexp.dashboard [STORAGE] [--port N]`: optuna-dashboard over the sweeps' studies.

STORAGE is the string `hydra.sweeper.storage` takes (`tbexp.study.storage`): an
SQLAlchemy URL (`sqlite:///…`, `postgresql://…`) or the path of an Optuna
journal file. The default is the sweeper's default, `sqlite:///multirun/optuna.db`,
relative to the current directory like the sweeper's, so run it from where
the sweeps were launched (`scripts/dashboard` runs it from the repository).
Every study in that storage is listed. The server listens on 127.0.0.1 only:
the dashboard can edit studies (notes, deletion), so reach it from elsewhere
through an SSH tunnel rather than `--host 0.0.0.0`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_STORAGE = "sqlite:///multirun/optuna.db"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tbexp.dashboard", description=__doc__.splitlines()[0])
    parser.add_argument(
        "storage", nargs="?", default=DEFAULT_STORAGE, help=f"study storage (default {DEFAULT_STORAGE})"
    )
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    args = parser.parse_args(argv)

    storage = _absolute(args.storage)
    missing = _missing_file(storage)
    if missing:
        sys.exit(
            f"tbexp.dashboard: no study storage at {missing}; run a sweep first (python -m tbexp -m +sweep=smoke) or pass STORAGE"
        )
    import optuna_dashboard

    from tbexp.study.storage import open_storage

    print(f"optuna-dashboard on http://{args.host}:{args.port}/dashboard/ over {storage}", flush=True)
    optuna_dashboard.run_server(open_storage(storage, create_tables=False), host=args.host, port=args.port)


def _absolute(storage: str) -> str:
    """Relative file paths (a journal file, an sqlite database) made absolute from here, as the sweeper does."""
    from tbexp.study.storage import absolute_storage, is_url

    if is_url(storage) and not storage.startswith("sqlite"):
        return storage
    if not is_url(storage):
        return str(Path(storage).resolve())
    return absolute_storage(storage, Path.cwd())


def _missing_file(storage: str) -> str:
    """The file a file-backed storage names, when it does not exist ('' otherwise): opening it would create an empty one."""
    from tbexp.study.storage import is_url

    if not is_url(storage):
        return "" if Path(storage).exists() else storage
    if storage.startswith("sqlite:///"):
        path = storage.removeprefix("sqlite:///").split("?")[0]
        return "" if Path(path).exists() else path
    return ""
