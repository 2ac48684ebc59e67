"""Stop a training loop at a step boundary when the job is about to be killed.

SLURM warns a job before its time limit (and before preemption, where the
cluster is set up so) with the signal submitit asks for (`--signal=USR2@120`;
`SUBMITIT_PREEMPT_SIGNAL` changes it), and `scontrol requeue`, `scancel` and
preemption send SIGTERM `KillWait` seconds (30 by default) before SIGKILL.
Left to itself, submitit's USR2 handler pickles the job, requeues it and exits
wherever the main thread happens to be, and it ignores SIGTERM, so the work
since the last periodic checkpoint would be lost and redone.

`interruptible(steps, checkpoint)` wraps a loop's steps instead: a signal only
sets a flag; after the step in progress it calls `checkpoint(step)` and then
hands the signal to whoever had it before (submitit requeues the job and
exits; without submitit, or for SIGTERM, the process exits). The requeued job
runs the same command in the same run directory and the stage resumes from
that checkpoint, so no step is done twice. A step that outlasts the grace time
is killed all the same; the stage then resumes from its previous checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

log = logging.getLogger(__name__)
Step = TypeVar("Step")


def warning_signal() -> signal.Signals:
    """The signal SLURM sends ahead of the end: submitit's choice, USR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise."""
    return signal.Signals[f"SIG{os.environ.get('SUBMITIT_PREEMPT_SIGNAL', 'USR2')}"]


def interruptible(steps: Iterable[Step], checkpoint: Callable[[Step], None]) -> Iterator[Step]:
    """Yield `steps`; when a stop signal came during one, `checkpoint(that step)`, then stop the job.

    The loop body of a step has finished when the next one is asked for, so
    the checkpoint sees a consistent state (never one between
    forward_backward and optim_step).
    """
    with _StopSignals() as stop:
        done = None
        for step in steps:
            if stop.received and done is not None:
                break
            yield step
            done = step
        if stop.received:
            if done is not None:
                log.warning("%s: the step in progress is done; saving a checkpoint, then stopping", stop.received.name)
                checkpoint(done)
            stop.hand_over()


class _StopSignals:
    """SIGTERM and the warning signal set a flag while inside; on the way out they go to their previous handlers."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python lets only the main thread set handlers
            for sig in {signal.SIGTERM, warning_signal()}:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, frame: object) -> None:
        self.received = signal.Signals(signum)

    def __exit__(self, *exc: object) -> None:
        self._restore()
        if self.received:  # the loop was left early (break, an error): deliver the signal as if we had not been here
            received, self.received = self.received, None
            signal.raise_signal(received)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous = {}

    def hand_over(self) -> None:
        """Give the signal to the handler it was meant for, then exit.

        Under submitit the warning signal's handler requeues the job and exits
        itself; its SIGTERM handler only logs (SLURM has requeued or cancelled
        the job already). Without a Python handler we exit with 128 + signal,
        as the default action would, but through SystemExit so that trackers
        and files are closed.
        """
        received, self.received = self.received, None
        previous = self._previous.get(received) if received else None
        self._restore()
        if received is None:
            return
        if callable(previous):
            previous(received, None)
        raise SystemExit(128 + received)
