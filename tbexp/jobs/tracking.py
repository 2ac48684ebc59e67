"""Where metrics go: `metrics.jsonl` in the run directory always, plus the chosen logger.

`logger=none` adds nothing, so stages call `tracker.log(...)` unconditionally
instead of asking which tracker is on. `logger=wandb` mirrors every row to a
W&B run (offline, under `<run dir>/wandb/`, unless WANDB_MODE=online or
`logger.mode` says otherwise) and `logger=trackio` to a Trackio run (a local
database; `trackio show` is its dashboard).

One tracker run per job: the entry point opens it with `job_run(cfg)`,
grouped by study in a sweep (else by experiment, else by stage), `job_type` =
the stage, holding the composed config with its secrets redacted (tbexp.redaction). Every
Tracker made while a run is open logs into it (a stage may make several:
SFT's before/after evals each write their own metrics.jsonl). A Tracker made
when none is open (a stage called from Python) opens one and closes it in
`finish()`. The run's id is derived from the run directory, so a job
requeued into the same directory continues the same run.

W&B wants steps that only grow, but a job logs several step series (SFT
steps, then evals at step 0), so rows carry their step as a metric `step`
that every chart uses as its x axis.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tbexp.redaction import redact

LOGGERS = ("none", "wandb", "trackio")
_active: _Run | None = None  # the open run: the job's (job_run) or the first Tracker's


class Tracker:
    def __init__(self, run_dir: Path, settings: Any):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        if settings.name not in LOGGERS:
            raise ValueError(f"logger={settings.name!r}: choose one of {list(LOGGERS)}")
        global _active
        self._owned = None
        if settings.name != "none" and _active is None:
            self._owned = _active = _open(settings, self.run_dir)
        self._run = None if settings.name == "none" else _active

    def log(self, metrics: dict[str, float], step: int = 0) -> None:
        row = {"step": step, "time": time.time(), **metrics}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._run:
            self._run.log(metrics, step)

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        """A table (one dict per row, same keys), e.g. the per-task eval results; the run dir has it as csv already."""
        if self._run and rows:
            self._run.table(name, rows)

    def log_checkpoint(self, path: str, step: int, name: str = "last") -> None:
        """Where a checkpoint went: the run summary's `checkpoint/<name>` (`last`, `chosen`...)."""
        if self._run:
            self._run.note({f"checkpoint/{name}": str(path), f"checkpoint/{name}_step": step})

    def rewind(self, step: int, prefixes: tuple[str, ...]) -> None:
        """Forget rows after `step` that hold keys starting with `prefixes`: a resumed loop is about to redo them.

        Only metrics.jsonl is rewritten; W&B and Trackio cannot take rows back
        (a job killed without warning leaves the redone steps there twice).
        """
        if not self.metrics_path.exists():
            return
        lines = self.metrics_path.read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        kept = [r for r in rows if r.get("step", 0) <= step or not any(k.startswith(prefixes) for k in r)]
        if len(kept) < len(rows):
            tmp = self.metrics_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(self.metrics_path)

    def finish(self) -> None:
        global _active
        if self._owned:
            self._owned.finish()
            _active = self._owned = None


@contextlib.contextmanager
def job_run(cfg: Any) -> Iterator[None]:
    """The job's one tracker run, with the composed config (secrets redacted); Trackers made inside log into it."""
    global _active
    if cfg.logger.name == "none":
        yield
        return
    from omegaconf import OmegaConf

    try:
        config = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation that cannot be resolved here: log the config as written
        config = OmegaConf.to_container(cfg, resolve=False)
    run = _active = _open(cfg.logger, run_dir(), group=_group(cfg), job_type=cfg.stage.name, config=redact(config))
    try:
        yield
    finally:
        _active = None
        run.finish()


def note_result(metrics: dict[str, Any]) -> None:
    """The job's returned numbers into its run's summary under their own names, where a sweep's objective is one."""
    if _active is not None:
        _active.note({k: v for k, v in metrics.items() if isinstance(v, (int, float))})


def _group(cfg: Any) -> str:
    """`logger.group`, else the study of the sweep this job belongs to, else the experiment, else the stage."""
    from omegaconf import OmegaConf

    if cfg.logger.get("group"):
        return cfg.logger.group
    study = OmegaConf.select(cfg, "trial.study", default=None)
    if study:
        return study
    from hydra.core.hydra_config import HydraConfig

    experiment = HydraConfig.get().runtime.choices.get("experiment") if HydraConfig.initialized() else None
    return experiment or cfg.stage.name


def run_name(run_dir: str | Path) -> str:
    """The tracker run's name for a job directory: its parent's and its own name (2026-11-29/12-00-00, or 12-00-00/3 in a sweep)."""
    run_dir = Path(run_dir).resolve()
    return f"{run_dir.parent.name}/{run_dir.name}"


def _open(
    settings: Any, run_dir: Path, group: str | None = None, job_type: str | None = None, config: dict | None = None
) -> _Run:
    run_dir = Path(run_dir).resolve()
    name = run_name(run_dir)
    run_id = hashlib.sha1(str(run_dir).encode()).hexdigest()[
        :16
    ]  # same directory, same run: a requeued job continues it
    backend = _Wandb if settings.name == "wandb" else _Trackio
    return backend(settings, run_dir, name, run_id, group, job_type, config or {})


class _Run:
    def log(self, metrics: dict[str, Any], step: int) -> None: ...
    def table(self, name: str, rows: list[dict[str, Any]]) -> None: ...
    def note(self, values: dict[str, Any]) -> None: ...
    def finish(self) -> None: ...


class _Wandb(_Run):
    def __init__(self, settings, run_dir: Path, name: str, run_id: str, group, job_type, config: dict):
        import wandb

        self._wandb = wandb
        mode = settings.get("mode") or os.environ.get("WANDB_MODE") or "offline"  # no account needed unless asked for
        # W&B keeps the command line in the run's metadata (`args`): `python -m tbexp` has moved its secrets off it.
        self.run = wandb.init(
            project=settings.project,
            entity=settings.get("entity") or None,
            name=name,
            id=run_id,
            resume="allow",
            group=group,
            job_type=job_type,
            config=config,
            dir=settings.get("dir") or str(run_dir),
            mode=mode,
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log({**metrics, "step": step})

    def table(self, name: str, rows: list[dict[str, Any]]) -> None:
        columns = list(rows[0])
        self.run.log({name: self._wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])})

    def note(self, values: dict[str, Any]) -> None:
        self.run.summary.update(values)

    def finish(self) -> None:
        self.run.finish()


class _Trackio(_Run):
    def __init__(self, settings, run_dir: Path, name: str, run_id: str, group, job_type, config: dict):
        if settings.get("dir"):
            os.environ["TRACKIO_DIR"] = settings.dir  # trackio reads it when first imported
        import trackio

        self._trackio = trackio
        # Trackio has no job type; it goes into the config, where its dashboard can filter on it.
        self.run = trackio.init(
            project=settings.project,
            name=name,
            group=group,
            config={**config, "job_type": job_type},
            resume="allow",
            embed=False,
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(metrics, step=step)

    def table(self, name: str, rows: list[dict[str, Any]]) -> None:
        columns = list(rows[0])
        self.run.log({name: self._trackio.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])})

    def note(self, values: dict[str, Any]) -> None:
        self.run.log(values)  # no run summary in Trackio: a row of its own

    def finish(self) -> None:
        self._trackio.finish()  # also forgets it as trackio's current run


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    path = Path(run_dir) / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    # allow_nan: a metric over no valid episode is NaN (tbexp.episodes.scoring), written as NaN, which json.loads reads back
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True, allow_nan=True) + "\n")
    tmp.replace(path)  # a reader never sees half a summary
    return path


def run_dir() -> Path:
    """The job's output directory: Hydra's when running under Hydra, else the working directory."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path.cwd()
