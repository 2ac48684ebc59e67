"""Imported by the jobs' fork server, and only there, after everything else it preloads (`_job_server.start`).

gc.freeze(): what the server imported is left out of garbage collections,
in the server and in every job forked from it, so a job's collections do
not write to (and so copy) every page of it; a do-nothing job took half as
much CPU again without it.

An exit without interpreter shutdown: the server ends when the sweeper does,
and shutting down an interpreter with Optuna and SQLAlchemy loaded took a
second or two on a busy machine, during which the jobs (killed by
PR_SET_PDEATHSIG when the server ends) outlived their sweeper. The server
holds nothing to clean up; the jobs forked from it leave through os._exit
and never run this.
"""

import atexit
import gc
import os
import sys


def _exit_at_once() -> None:
    sys.stdout.flush()  # whatever the app's module printed on import
    sys.stderr.flush()
    os._exit(0)


atexit.register(_exit_at_once)
gc.freeze()
