"""The fork server that the sweeper's isolated jobs (`_jobs.IsolatedJob`) are forked from, one per sweep.

A spawned job spent about a second importing Hydra, OmegaConf, Optuna's
storage and the app's module before its job started. multiprocessing's fork
server is a fresh interpreter that imports them once (`PRELOAD` and the
app's module) and then forks a child per job. It shares nothing with the
sweeper but what was passed to it, and stays single-threaded (numpy's
OpenBLAS pool aside, which handles fork), so a forked job carries none of
the sweeper's threads or database connections.

The server quits when every holder of its "alive" pipe has closed it: the
sweeper, and every forked child, which inherits a copy. A job closes its
copy (`release`), so the sweeper's death ends the server (at once:
`_job_server_setup`) and, through the job's PR_SET_PDEATHSIG against its
parent, the job. That pipe and stopping the server are multiprocessing
internals, with no public handle.
"""

from __future__ import annotations

import os
import sys

# What every job imports; a name that does not import is skipped.
PRELOAD = [
    "hydra_plugins.tbexp_optuna_sweeper._jobs",
    "hydra._internal.core_plugins.basic_launcher",
    "cloudpickle",
    "tbexp.study.trial",
    "tbexp.study.storage",
    "optuna",  # tbexp.study.trial.report opens the study: Optuna, SQLAlchemy and the RDB storage's Alembic
    "optuna.storages._rdb.storage",
    "optuna.storages._rdb.models",
    "sqlalchemy.orm",
    "sqlalchemy.dialects.sqlite",
    "alembic.migration",
]
SETUP = "hydra_plugins.tbexp_optuna_sweeper._job_server_setup"  # imported last, to prepare the server for forking


def start(task_module: str) -> None:
    """Start the server with PRELOAD and the app's module imported; call before the job threads start.

    Importing the app's module there runs no job: `tbexp.__main__` calls
    `main()` only as `__main__`, and a script app (`__main__`) is imported by
    multiprocessing as `__mp_main__`, under its `if __name__ == "__main__"`
    guard. The module of `python -m pkg.app` is left out: multiprocessing
    runs it afresh as each child's `__main__` and warns if it is imported
    already. An app module that raises on import kills the server; the jobs
    are then spawned (`_jobs.IsolatedJob`).
    """
    from multiprocessing import forkserver

    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    rerun = main_spec is not None and main_spec.name == task_module and not task_module.endswith(".__main__")
    forkserver.set_forkserver_preload(PRELOAD + ([] if rerun else [task_module]) + [SETUP])
    forkserver.ensure_running()


def stop() -> None:
    """Stop the server, if one runs, and reap it, so that its time and its jobs' count as the sweep's."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()


def release() -> None:
    """In a forked job: close its copy of the server's "alive" pipe, leaving the sweeper's the last."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:  # None in a spawned job
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None  # a fork server the job itself uses is then its own, started afresh
