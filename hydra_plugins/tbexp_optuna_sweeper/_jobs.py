"""Run one trial's job through Hydra's launcher and say how it ended.

A Hydra launcher's `launch()` takes a batch and returns when the whole batch
is done. The sweeper calls it with one job at a time, each call on its own
thread, so a new trial starts the moment any one ends (no batch barrier).

That works as is for launchers whose jobs run in other processes
(hydra-submitit-launcher: `submitit_local`, `submitit_slurm`). Hydra's basic
launcher runs the job inside the calling process and keeps per-job state in
process-wide singletons (HydraConfig, logging, the working directory), so two
jobs at once would trample each other; and a job that crashes the
interpreter or is killed would take the sweeper with it. Its calls therefore
run in a child process each (`IsolatedJob`), as the joblib launcher does:
the child restores Hydra's singletons, runs the basic launcher for the one
job and sends back the result. The child is killed with the sweeper
(PR_SET_PDEATHSIG) and after `trial_timeout_s`, with everything it started
(it leads its own process group). Its output goes to `output.log` in the job
directory, so jobs running side by side do not interleave on the terminal.

The children are forked from a fork server that has already imported what
every job imports (`_job_server`); should it fail, they are spawned.

Every start and every join of a job's process holds one lock (`start`,
`join`). multiprocessing is not thread-safe there: `Process.start()` first
polls every child the process has started, and a fork-server child's exit
status is eight bytes on a pipe, so a start on one thread that polls a job
another thread is joining reads the status, and the joiner reads EOF, which
multiprocessing reports as exit status 255 (a SIGKILLed job then reads as
"exited with status 255", about one in four times with six threads).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _job_server

log = logging.getLogger(__name__)

KILL_GRACE_S = 10.0  # between SIGTERM and SIGKILL when a job times out or the sweep stops
ERROR_LIMIT_CHARS = 8000


@dataclass
class Outcome:
    ok: bool  # the job function returned (its value may still be unusable)
    value: Any = None
    error: str = ""


def launch_in_thread(launcher: Any, overrides: list[str], job_num: int) -> Outcome:
    """One job through a launcher that runs it elsewhere (submitit); blocks until it ends."""
    try:
        ret = launcher.launch([overrides], initial_job_idx=job_num)[0]
    except BaseException as err:  # noqa: BLE001 - a failed submission or a dead job is this trial's failure, not the sweep's
        return Outcome(False, error=_describe(err))
    return _outcome(ret)


class IsolatedJob:
    """One job of an in-process launcher, in a child process of its own."""

    live: set["IsolatedJob"] = set()  # for killing them all when the sweep is stopped
    _lock = threading.Lock()

    def __init__(self, payload: dict[str, Any], log_path: Path, timeout_s: float):
        self.payload = payload
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.process: Any = None

    def run(self) -> Outcome:
        reader, writer = multiprocessing.Pipe(duplex=False)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        import cloudpickle  # Hydra's singleton state holds OmegaConf resolvers defined in functions, which plain pickle refuses

        args = (cloudpickle.dumps(self.payload), writer, os.getpid(), str(self.log_path))
        with IsolatedJob._lock:  # started and listed at once, so that `kill_live_jobs` cannot miss it
            self.process = start(_child_main, args)
            IsolatedJob.live.add(self)
        writer.close()
        try:
            return self._wait(reader)
        finally:
            with IsolatedJob._lock:
                IsolatedJob.live.discard(self)

    def kill(self) -> None:
        """SIGTERM to the job's process group, SIGKILL after a grace period."""
        if self.process is None or self.process.pid is None:
            return
        _signal_group(self.process.pid, signal.SIGTERM)
        join(self.process, KILL_GRACE_S)
        _signal_group(self.process.pid, signal.SIGKILL)
        join(self.process)

    def _wait(self, reader: Any) -> Outcome:
        from multiprocessing.connection import wait

        deadline = time.monotonic() + self.timeout_s if self.timeout_s > 0 else None
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([reader, self.process.sentinel], timeout=remaining)
            if reader in ready:
                try:
                    outcome = reader.recv()
                except EOFError:  # the child died before it could answer
                    outcome = None
                join(self.process)
                return outcome or Outcome(False, error=self._death())
            if self.process.sentinel in ready:
                join(self.process)
                return Outcome(False, error=self._death())
            if deadline is not None and time.monotonic() >= deadline:
                self.kill()
                return Outcome(False, error=f"timed out after {self.timeout_s:g} s (trial_timeout_s) and was killed")

    def _death(self) -> str:
        code = self.process.exitcode
        if code is not None and code < 0:
            return f"job process killed by {signal.Signals(-code).name}"
        return f"job process exited with status {code} without a result"


_process_lock = threading.Lock()  # see the module's docstring: multiprocessing's start and join race across threads
_forked = True  # False once the fork server has failed: the sweep's later jobs are spawned


def start(target: Any, args: tuple[Any, ...]) -> Any:
    """A started process running `target(*args)`: forked from the fork server, or spawned once that has failed."""
    global _forked
    with _process_lock:
        if _forked:
            process = multiprocessing.get_context("forkserver").Process(target=target, args=args, daemon=False)
            try:
                process.start()
                return process
            except (OSError, EOFError) as err:
                # the server died, most likely importing the app's module (its traceback is above)
                log.warning(
                    "the jobs' fork server failed (%s: %s); spawning each job instead, about a second more each",
                    type(err).__name__,
                    err,
                )
                _forked = False
        process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=False)
        process.start()
        return process


def join(process: Any, timeout: float | None = None) -> None:
    """`process.join(timeout)`, but never while another thread starts or joins a process."""
    from multiprocessing.connection import wait

    # The sentinel turns readable once the status is written (or the server is gone), so the join under the lock
    # does not block; waiting for it outside the lock keeps one slow job from holding up every other start.
    if wait([process.sentinel], timeout):
        with _process_lock:
            process.join()


def kill_live_jobs() -> None:
    with IsolatedJob._lock:
        jobs = list(IsolatedJob.live)
    for job in jobs:
        job.kill()


def task_reference(task_function: Any) -> tuple[str, str]:
    """(module, qualname) under which a job process can import the task function.

    `python -m tbexp` runs `tbexp/__main__.py` as `__main__`; the child imports
    it under its real name (`tbexp.__main__`, where `main()` is not called).
    A script's `__main__` is re-run by multiprocessing as the child's
    `__main__` (under its `if __name__ == "__main__"` guard), so it stays
    `__main__`.
    """
    module = task_function.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is not None:
            module = spec.name
    return module, task_function.__qualname__


def _child_main(payload_bytes: bytes, conn: Any, sweeper_pid: int, log_path: str) -> None:
    os.setsid()  # a process group of its own: a timeout kills the job and whatever it started
    _die_with_sweeper(sweeper_pid)
    if (
        "numpy.random" in sys.modules
    ):  # forked jobs would share the server's draws; `random` reseeds itself after a fork, numpy does not
        sys.modules["numpy.random"].seed()
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    import pickle

    from hydra._internal.core_plugins.basic_launcher import BasicLauncher
    from hydra.core.singleton import Singleton

    payload = pickle.loads(payload_bytes)
    task_function = _import_task(*payload["task"])  # first: importing it registers the app's schemas and patches
    Singleton.set_state(payload["singletons"])
    loader = payload["hydra_context"].config_loader
    loader.load_sweep_config = lambda *_: payload[
        "job_config"
    ]  # the sweeper composed it (for the job's directory); again took half a do-nothing job's time
    launcher = BasicLauncher()
    launcher.setup(hydra_context=payload["hydra_context"], task_function=task_function, config=payload["config"])
    try:
        outcome = _outcome(launcher.launch([payload["overrides"]], initial_job_idx=payload["job_num"])[0])
    except SystemExit as stop:  # the app chose to exit (tbexp: a config error, exit 2)
        outcome = Outcome(False, error=f"job exited with status {stop.code}")
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(outcome)
    conn.close()


def _import_task(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while hasattr(obj, "__wrapped__"):  # the @hydra.main wrapper -> the function it wraps
        obj = obj.__wrapped__
    return obj


def _outcome(ret: Any) -> Outcome:
    from hydra.core.utils import JobStatus

    value = ret._return_value
    if ret.status == JobStatus.COMPLETED:
        return Outcome(True, _picklable(value))
    if isinstance(value, BaseException):
        print("".join(traceback.format_exception(value)), file=sys.stderr)  # into the job's output.log
        return Outcome(False, error=_describe(value))
    return Outcome(False, error=f"job ended with status {ret.status}: {value!r}")


def _describe(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= ERROR_LIMIT_CHARS else text[:ERROR_LIMIT_CHARS] + " ..."


def _picklable(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if isinstance(value, dict):
        return {str(k): _picklable(v) for k, v in value.items()}
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


def _die_with_sweeper(sweeper_pid: int) -> None:
    """Ask Linux to kill this process when the sweeper dies, even by SIGKILL (no-op elsewhere).

    The request is for the death of this process's parent: the sweeper for a
    spawned job, the fork server for a forked one, which quits with the
    sweeper once the job has let go of it (`_job_server.release`).

    SIGKILL rather than SIGTERM: a Python handler runs only between bytecodes,
    and a job blocked in C (a database lock, a long tensor op) would outlive
    the sweeper by that long. What the job started is left to its own
    clean-up (tbexp's sandboxes die with their parent or are swept up later).
    """
    _job_server.release()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = os.getppid()
    if sweeper_pid not in (parent, _parent_of(parent)):  # the sweeper or the server died before the request took effect
        os.killpg(0, signal.SIGKILL)


def _parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
