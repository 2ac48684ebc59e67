"""Trials outlive sweepers: who owns a RUNNING trial, and what happens when its sweeper is gone.

Each trial records its sweeper (`host:pid:process start time`) and a
heartbeat the sweeper refreshes every `heartbeat_s`. A RUNNING trial is
orphaned when its sweeper ran on this host and that process is gone (checked
at once, so a killed sweeper's trials are failed on the next start), or when
it ran elsewhere and its heartbeat is older than `stale_after_s` (another
host's processes cannot be inspected; several sweepers may share one study).

An orphaned trial is failed with `interrupted=True` and its parameters are
queued again (`retry_of`), so killing the sweeper loses no trial and repeats
none that finished; interrupted trials do not count against `n_trials`. Its
retry gets a new trial number and so a new job directory: the old job may
still be running (a SLURM job outlives its sweeper) and will stop at its
next report, when it finds its trial finished (tbexp.study.trial).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from tbexp.study.storage import (
    FAIL_REASON_ATTR,
    HEARTBEAT_ATTR,
    INTERRUPTED_ATTR,
    JOB_OFFSET_ATTR,
    OWNER_ATTR,
    RETRY_OF_ATTR,
)

log = logging.getLogger(__name__)


def owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def claim(study: Any, trial_id: int) -> None:
    storage = study._storage
    storage.set_trial_system_attr(trial_id, OWNER_ATTR, owner_id())
    storage.set_trial_system_attr(trial_id, HEARTBEAT_ATTR, time.time())


def heartbeat(study: Any, trial_ids: list[int]) -> None:
    from optuna.exceptions import UpdateFinishedTrialError

    now = time.time()
    for trial_id in trial_ids:
        try:
            study._storage.set_trial_system_attr(trial_id, HEARTBEAT_ATTR, now)
        except UpdateFinishedTrialError:  # the job finished its own trial (pruned)
            pass


def fail_orphans(study: Any, stale_after_s: float) -> int:
    """Fail and re-queue every RUNNING trial whose sweeper is gone; returns how many."""
    from optuna.trial import TrialState

    failed = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial.system_attrs.get(OWNER_ATTR, "")
        last = trial.system_attrs.get(HEARTBEAT_ATTR) or (
            trial.datetime_start.timestamp() if trial.datetime_start else 0.0
        )
        if _alive(owner, last, stale_after_s):
            continue
        if interrupt(study, trial, f"its sweeper ({owner or 'unknown'}) stopped while it ran"):
            failed += 1
    return failed


def interrupt(study: Any, trial: Any, reason: str) -> bool:
    """Fail a trial that its sweeper could not finish and queue its parameters again; False if it had ended meanwhile."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    storage = study._storage
    try:
        storage.set_trial_user_attr(trial._trial_id, INTERRUPTED_ATTR, True)
        storage.set_trial_user_attr(trial._trial_id, FAIL_REASON_ATTR, reason)
        storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    except UpdateFinishedTrialError:  # it finished (or another sweeper failed it) in the meantime
        return False
    study.enqueue_trial(trial.params, user_attrs={RETRY_OF_ATTR: trial.number})
    log.warning("trial %d: FAIL (%s); its parameters are queued again", trial.number, reason)
    return True


def job_offset(study: Any, sweep_dir: Path) -> int:
    """Job number = offset + trial number; the offset skips job directories already in `sweep_dir`.

    Fixed when the study is first swept, so a resumed study keeps numbering
    after its own trials, and a new study in an old directory starts after
    the old jobs instead of overwriting them.
    """
    if JOB_OFFSET_ATTR not in study.user_attrs:
        taken = [int(p.name) for p in sweep_dir.iterdir() if p.name.isdigit()] if sweep_dir.is_dir() else []
        study.set_user_attr(JOB_OFFSET_ATTR, max(taken) + 1 if taken else 0)
    return int(study.user_attrs[JOB_OFFSET_ATTR])


def _alive(owner: str, last_heartbeat: float, stale_after_s: float) -> bool:
    host, _, rest = owner.partition(":")
    pid, _, started = rest.partition(":")
    if host == socket.gethostname() and pid.isdigit() and started:
        return _start_time(int(pid)) == started  # same pid and start time: the same process
    return time.time() - last_heartbeat < stale_after_s


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' if it does not exist): tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[19]
