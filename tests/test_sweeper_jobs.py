"""How the sweeper's jobs are run under Hydra's basic launcher: forked from a fork server, tied to the sweeper.

The end-to-end behaviour (results, failures, timeouts, resuming) is in
test_sweeper.py; these tests look at the processes: a job's parent is the
fork server, a job dies with a sweeper killed by SIGKILL although it is not
the sweeper's child, an app whose module cannot be imported in the fork
server still runs, its jobs spawned instead, and jobs started and joined on
several threads at once each get their own exit status.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import Counter

from optuna.trial import TrialState

from hydra_plugins.tbexp_optuna_sweeper import _jobs
from hydra_plugins.tbexp_optuna_sweeper._jobs import _parent_of as parent_of
from tests.conftest import REPO
from tests.test_sweeper import APP, gone, load, sweep


def test_forked_jobs_die_with_a_killed_sweeper(tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    command = [
        sys.executable,
        "-m",
        APP,
        "-m",
        f"hydra.sweep.dir={tmp_path}/multirun",
        f"hydra.sweeper.storage='{storage}'",
        "hang_on=[0,1]",
    ]
    sweeper = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ran = [tmp_path / "multirun" / str(n) / "ran.txt" for n in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(path.exists() and path.read_text().strip() for path in ran):
        assert sweeper.poll() is None and time.monotonic() < deadline, (
            sweeper.stdout.read() if sweeper.poll() is not None else "timed out"
        )
        time.sleep(0.2)
    jobs = [int(path.read_text().split()[1]) for path in ran]
    servers = {parent_of(job) for job in jobs}
    assert len(servers) == 1 and sweeper.pid not in servers, "both jobs should be forked from one fork server"
    assert parent_of(servers.pop()) == sweeper.pid
    sweeper.send_signal(signal.SIGKILL)
    sweeper.wait()
    assert all(gone(job) for job in jobs), (
        "the jobs must die with their sweeper (the fork server quits, PR_SET_PDEATHSIG)"
    )
    assert all(t.state == TrialState.RUNNING for t in load(storage).trials)


def test_an_app_the_fork_server_cannot_import_gets_spawned_jobs(tmp_path):
    command = [
        sys.executable,
        "-m",
        "tests.unforkable_app",
        "-m",
        f"hydra.sweep.dir={tmp_path}/multirun",
        f"hydra.sweeper.storage='sqlite:///{tmp_path}/optuna.db'",
        "hydra.sweeper.n_trials=3",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "refuses to be imported by a fork server" in done.stderr and "spawning each job instead" in done.stdout
    assert [t.state for t in load(f"sqlite:///{tmp_path}/optuna.db").trials] == [TrialState.COMPLETE] * 3


def test_a_script_app_is_not_run_by_the_fork_server(tmp_path):
    sweep(tmp_path, "hydra.sweeper.n_trials=2", script=True)
    jobs = sorted((tmp_path / "multirun").glob("*/ran.txt"))
    assert [path.read_text().split()[0] for path in jobs] == ["0", "1"], "only the two jobs may have run the app's main"


def test_jobs_started_and_joined_on_many_threads_keep_their_exit_status():
    # Six threads each start and join 20 fork-server children that SIGKILL themselves, as six trials at once do. With
    # multiprocessing's own start and join, about one status in four came back as 255: a start on one thread
    # read the status another thread was joining (see _jobs' docstring).
    statuses: list[int | None] = []

    def trials() -> None:
        for _ in range(20):
            process = _jobs.start(signal.raise_signal, (signal.SIGKILL,))
            _jobs.join(process)
            statuses.append(process.exitcode)

    threads = [threading.Thread(target=trials) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert Counter(statuses) == {-signal.SIGKILL: 120}
