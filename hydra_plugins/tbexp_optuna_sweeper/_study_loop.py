"""One sweep: open or resume the study, fail its orphans, keep `n_jobs` trials running until the budget is spent.

ask → claim the trial → suggest the values → compose the job's config (which
also gives its directory; a config that does not compose stops the sweep,
since every later trial would fail the same way) → launch the job on a thread
→ when any job ends: tell. COMPLETE with the job's value; FAIL when the job
raised, returned no finite number, was killed or timed out (the reason is
kept in the trial's `fail_reason`); PRUNED when the job pruned itself through
tbexp.study.trial. Then the next trial starts at once.

The budget `n_trials` is for the study, counted from the storage before each
start, so a restarted sweep (or a second sweeper on the same study) only runs
what is missing. Every storage call is made on this thread; the job threads
only wait for their jobs.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from omegaconf import OmegaConf, open_dict

from tbexp.redaction import hidden_override, redact, redact_output
from tbexp.study.storage import (
    FAIL_REASON_ATTR,
    INTERRUPTED_ATTR,
    JOB_DIR_ATTR,
    POINTER_FILE,
    PRUNED_AT_ATTR,
    RETRY_OF_ATTR,
    absolute_storage,
    without_password,
)

from . import _job_server, _recovery, _space
from ._jobs import IsolatedJob, Outcome, kill_live_jobs, launch_in_thread, task_reference
from ._study_open import SweepError, open_study

log = logging.getLogger("tbexp.sweep")

GRID_QUEUED_ATTR = "tbexp:grid_queued"
OUTPUT_TAIL_LINES = 15


@dataclass
class _Running:
    trial_id: int
    number: int
    job_num: int
    job_dir: Path
    values: dict[str, Any]
    started: float = field(default_factory=time.monotonic)


def run_sweep(sweeper: Any, arguments: list[str]) -> float | None:
    redact_output()  # the sweep's log names trials' failures, which may quote a URL with its password
    return _Sweep(sweeper, arguments).run()


class _Sweep:
    def __init__(self, sweeper: Any, arguments: list[str]):
        from hydra._internal.core_plugins.basic_launcher import BasicLauncher

        self.sweeper = sweeper
        self.s = sweeper.settings
        if self.s.n_jobs < 1 or self.s.n_trials < 1:
            raise SweepError(
                f"hydra.sweeper.n_jobs={self.s.n_jobs}, n_trials={self.s.n_trials}: both must be at least 1"
            )
        self.space = _space.SearchSpace(self.s.params)
        self.arguments = _fixed_overrides(arguments, self.space)
        self.isolated = isinstance(sweeper.launcher, BasicLauncher)  # see _jobs: in-process jobs get a process each
        self.storage_url = absolute_storage(self.s.storage, Path.cwd())
        # A storage URL with a password reaches the jobs through the environment (set here, before the fork server
        # that the jobs inherit it from starts), never through their saved and pickled overrides.
        storage_key = f"{self.s.trial_key}.storage"
        self.storage_override = (
            hidden_override(storage_key, self.storage_url)
            if redact(self.storage_url) != self.storage_url
            else f"{storage_key}={_space.override_value(self.storage_url)}"
        )
        self.sweep_dir = Path(str(sweeper.config.hydra.sweep.dir)).absolute()
        self.pruning_metric = self.s.pruner.metric or self.s.objective.metric
        self.study = open_study(self.s, self.storage_url, self.sweep_dir, self.pruning_metric)
        self.offset = _recovery.job_offset(self.study, self.sweep_dir)
        self.running: dict[int, _Running] = {}
        self.results: queue.Queue[tuple[int, Outcome]] = queue.Queue()

    def run(self) -> float | None:
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.sweeper.config, self.sweep_dir / "multirun.yaml")
        OmegaConf.save(
            {
                "study_name": self.s.study_name,
                "storage": without_password(self.storage_url),  # a file: tbexp.report asks PGPASSWORD
                "objective": OmegaConf.to_container(self.s.objective),
            },
            self.sweep_dir / POINTER_FILE,
        )
        orphans = _recovery.fail_orphans(self.study, self.s.stale_after_s)
        if self.s.sampler.name == "grid":
            self._queue_grid()
        log.info(
            "study %r in %s: %d trials so far%s; budget %d, %d at a time; jobs in %s",
            self.s.study_name,
            self.storage_url,
            len(self.study.get_trials(deepcopy=False)),
            f" ({orphans} orphaned, re-queued)" if orphans else "",
            self.s.n_trials,
            self.s.n_jobs,
            self.sweep_dir,
        )
        last_beat = last_orphan_check = time.monotonic()
        if self.isolated:
            _job_server.start(task_reference(self.sweeper.task_function)[0])
        try:
            while True:
                while len(self.running) < self.s.n_jobs and self._may_start():
                    self._start()
                if not self.running:
                    break
                try:
                    trial_id, outcome = self.results.get(timeout=self.s.heartbeat_s)
                    self._finish(self.running.pop(trial_id), outcome)
                except queue.Empty:
                    pass
                now = time.monotonic()
                if now - last_beat >= self.s.heartbeat_s:
                    _recovery.heartbeat(self.study, list(self.running))
                    last_beat = now
                if now - last_orphan_check >= self.s.stale_after_s:  # another sweeper on this study may have died
                    _recovery.fail_orphans(self.study, self.s.stale_after_s)
                    last_orphan_check = now
        except BaseException as stop:  # Ctrl-C, or a config that does not compose: leave no trial RUNNING
            self._interrupt_running(f"the sweep stopped ({type(stop).__name__})")
            raise
        finally:
            _job_server.stop()
        return self._write_results()

    # --- one trial -------------------------------------------------------------------------------

    def _may_start(self) -> bool:
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        used = sum(
            1
            for t in trials
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
            or (t.state == TrialState.FAIL and not t.user_attrs.get(INTERRUPTED_ATTR))
        )
        if used >= self.s.n_trials:
            return False
        if self.s.sampler.name == "grid":  # the grid's points are the queued trials; none left = grid done
            return any(t.state == TrialState.WAITING for t in trials)
        return True

    def _start(self) -> None:
        trial = self.study.ask()
        _recovery.claim(
            self.study, trial._trial_id
        )  # at once: a killed sweeper's unclaimed trial would wait stale_after_s to be failed
        values = self.space.suggest(trial)
        job_num = self.offset + trial.number
        overrides = self.arguments + _space.overrides(values) + self._trial_overrides(trial.number)
        job_config = self._job_config(overrides, job_num, trial)
        job_dir = (Path(str(job_config.hydra.sweep.dir)) / str(job_config.hydra.sweep.subdir)).absolute()
        storage = self.study._storage
        if job_dir.is_dir() and any(job_dir.iterdir()):
            self._fail(
                _Running(trial._trial_id, trial.number, job_num, job_dir, values),
                f"job directory {job_dir} already holds files; not overwriting it",
            )
            return
        storage.set_trial_user_attr(trial._trial_id, JOB_DIR_ATTR, str(job_dir))
        record = _Running(trial._trial_id, trial.number, job_num, job_dir, values)
        self.running[record.trial_id] = record
        retry = trial.user_attrs.get(RETRY_OF_ATTR)
        log.info(
            "trial %d (job %d%s) started: %s",
            trial.number,
            job_num,
            f", retry of trial {retry}" if retry is not None else "",
            _describe(values),
        )
        payload = self._payload(overrides, job_num, job_config) if self.isolated else None
        threading.Thread(
            target=self._run_job, args=(record, overrides, payload), name=f"trial-{trial.number}", daemon=True
        ).start()

    def _run_job(self, record: _Running, overrides: list[str], payload: dict[str, Any] | None) -> None:
        try:
            if payload is not None:
                outcome = IsolatedJob(payload, record.job_dir / "output.log", self.s.trial_timeout_s).run()
            else:
                outcome = launch_in_thread(self.sweeper.launcher, overrides, record.job_num)
        except BaseException as err:  # noqa: BLE001 - whatever happens, the main loop must hear of it
            outcome = Outcome(False, error=f"{type(err).__name__}: {err}")
        self.results.put((record.trial_id, outcome))

    def _finish(self, record: _Running, outcome: Outcome) -> None:
        from optuna.trial import TrialState

        trial = self.study._storage.get_trial(record.trial_id)
        took = time.monotonic() - record.started
        if trial.state == TrialState.PRUNED:
            log.info(
                "trial %d: PRUNED at step %s after %.1f s (%s)",
                record.number,
                trial.user_attrs.get(PRUNED_AT_ATTR, trial.last_step),
                took,
                _describe(record.values),
            )
            return
        if trial.state.is_finished():  # failed as an orphan by another sweeper; its retry is queued
            log.info("trial %d: already %s after %.1f s", record.number, trial.state.name, took)
            return
        if not outcome.ok:
            self._fail(record, outcome.error, show_output=self.isolated)
            return
        value = _objective(outcome.value, self.s.objective.metric)
        if value is None:
            nan = (
                " (NaN: what an eval with no valid episode gives; the job's tasks.csv says why)"
                if _is_nan(outcome.value, self.s.objective.metric)
                else ""
            )
            self._fail(
                record, f"the job returned {outcome.value!r}, not a finite number for {self.s.objective.metric}{nan}"
            )
            return
        self.study.tell(record.number, value, skip_if_finished=True)
        log.info(
            "trial %d: COMPLETE %s=%.4f after %.1f s (%s)",
            record.number,
            self.s.objective.metric,
            value,
            took,
            _describe(record.values),
        )

    def _fail(self, record: _Running, reason: str, show_output: bool = False) -> None:
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        try:
            self.study._storage.set_trial_user_attr(record.trial_id, FAIL_REASON_ATTR, redact(reason))
        except UpdateFinishedTrialError:
            return
        self.study.tell(record.number, state=TrialState.FAIL, skip_if_finished=True)
        tail = _tail(record.job_dir / "output.log") if show_output else ""
        log.warning(
            "trial %d: FAIL (%s) in %s%s",
            record.number,
            reason,
            record.job_dir,
            f"; the end of its output.log:\n{tail}" if tail else "",
        )

    def _interrupt_running(self, reason: str) -> None:
        kill_live_jobs()
        for record in list(self.running.values()):
            _recovery.interrupt(self.study, self.study._storage.get_trial(record.trial_id), reason)
        self.running.clear()

    # --- set-up ---------------------------------------------------------------------------------

    def _queue_grid(self) -> None:
        if self.study.user_attrs.get(GRID_QUEUED_ATTR):  # a resumed grid keeps its queue
            return
        points = self.space.grid(self.s.sampler.seed)
        for values in points:
            self.study.enqueue_trial(values)
        self.study.set_user_attr(GRID_QUEUED_ATTR, len(points))
        log.info("grid: %d feasible combinations queued", len(points))

    def _trial_overrides(self, number: int) -> list[str]:
        key = self.s.trial_key
        if not key:
            return []
        fields = {
            "number": number,
            "study": self.s.study_name,
            "storage": self.storage_url,
            "objective": self.s.objective.metric,
            "pruning_metric": self.pruning_metric,
        }
        return [
            self.storage_override if name == "storage" else f"{key}.{name}={_space.override_value(value)}"
            for name, value in fields.items()
        ]

    def _job_config(self, overrides: list[str], job_num: int, trial: Any) -> Any:
        """Compose the job's config as its launcher will (for its directory); a failure stops the sweep."""
        try:
            cfg = self.sweeper.hydra_context.config_loader.load_sweep_config(self.sweeper.config, list(overrides))
        except Exception as err:
            from optuna.trial import TrialState

            self.study._storage.set_trial_user_attr(
                trial._trial_id, FAIL_REASON_ATTR, redact(f"config does not compose: {err}")
            )
            self.study._storage.set_trial_user_attr(
                trial._trial_id, INTERRUPTED_ATTR, True
            )  # the sweep's fault: not counted against n_trials
            self.study.tell(trial.number, state=TrialState.FAIL)
            hint = (
                f" (does the app's config have a `{self.s.trial_key}` node? set hydra.sweeper.trial_key='' if not)"
                if self.s.trial_key and self.s.trial_key in str(err)
                else ""
            )
            raise SweepError(
                f"trial {trial.number}: the job's config does not compose{hint}: {err}\noverrides: {' '.join(overrides)}"
            ) from err
        with open_dict(cfg):
            cfg.hydra.job.num = job_num
            cfg.hydra.job.id = job_num
        return cfg

    def _payload(self, overrides: list[str], job_num: int, job_config: Any) -> dict[str, Any]:
        from hydra.core.singleton import Singleton

        return {
            "task": task_reference(self.sweeper.task_function),
            "singletons": Singleton.get_state(),
            "hydra_context": self.sweeper.hydra_context,
            "config": self.sweeper.config,
            "overrides": overrides,
            "job_num": job_num,
            "job_config": job_config,
        }

    def _write_results(self) -> float | None:
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        counts = {
            state.name: sum(1 for t in trials if t.state == state)
            for state in TrialState
            if any(t.state == state for t in trials)
        }
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        results: dict[str, Any] = {
            "study_name": self.s.study_name,
            "storage": without_password(self.storage_url),
            "trials": counts,
        }
        if complete:
            best = self.study.best_trial
            results.update(
                best_trial=best.number,
                best_value=best.value,
                best_params=best.params,
                best_job_dir=best.user_attrs.get(JOB_DIR_ATTR, ""),
            )
            log.info(
                "done: %s; best trial %d: %s=%.4f (%s) in %s",
                counts,
                best.number,
                self.s.objective.metric,
                best.value,
                _describe(best.params),
                best.user_attrs.get(JOB_DIR_ATTR, ""),
            )
        else:
            log.warning("done: %s; no trial completed", counts)
        OmegaConf.save(OmegaConf.create(results), self.sweep_dir / "optimization_results.yaml")
        return results.get("best_value")


def _fixed_overrides(arguments: list[str], space: _space.SearchSpace) -> list[str]:
    """The command line's own overrides go to every job; sweeping belongs in the sweep file."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in OverridesParser.create().parse_overrides(arguments):
        if override.is_sweep_override():
            raise SweepError(
                f"{override.input_line}: hydra/sweeper=tbexp_optuna takes its search space from the sweep file (hydra.sweeper.params), not from command-line sweeps"
            )
        if override.get_key_element() in space.params:
            raise SweepError(
                f"{override.input_line}: {override.get_key_element()} is also in the search space; drop one of them"
            )
    return list(arguments)


def _objective(value: Any, metric: str) -> float | None:
    if isinstance(value, Mapping):
        value = value.get(metric)
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _is_nan(value: Any, metric: str) -> bool:
    if isinstance(value, Mapping):
        value = value.get(metric)
    return isinstance(value, float) and math.isnan(value)


def _describe(values: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line[-300:] for line in lines[-OUTPUT_TAIL_LINES:])
