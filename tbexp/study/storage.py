"""Where an Optuna study lives and what its trials agree on, shared by the sweeper, the jobs and the report.

A storage is named by one string, the same on the command line, in a job's
`trial.storage` and for `optuna-dashboard`:

* an SQLAlchemy URL — `sqlite:///multirun/optuna.db` (the default; one file
  for every study, not safe on NFS) or `postgresql://user:password@host:5432/db`
  (a password in the URL reaches the jobs through their environment, never
  their files: tbexp.redaction; the sweep directory's `study.yaml` keeps the
  URL without it, so `tbexp.report` takes it from `PGPASSWORD`, `~/.pgpass`
  or `--storage`);
* anything else is a path to Optuna's journal file
  (`JournalStorage(JournalFileBackend(path))`), the choice for a shared file
  system without a database server.

The pruner is not kept in Optuna's storage, so the sweeper writes its
settings into the study's user attributes and every job rebuilds the same
pruner from there (`study_pruner`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Study user attributes (visible in optuna-dashboard).
PRUNER_ATTR = "tbexp:pruner"  # dict of PrunerConf fields
OBJECTIVE_ATTR = "tbexp:objective"  # the metric the trials' values are
PRUNING_METRIC_ATTR = "tbexp:pruning_metric"  # the metric behind the intermediate values
JOB_OFFSET_ATTR = "tbexp:job_offset"  # job number = offset + trial number, so no job directory is reused
SWEEP_DIR_ATTR = "tbexp:sweep_dir"
# Trial user attributes.
JOB_DIR_ATTR = "job_dir"
FAIL_REASON_ATTR = "fail_reason"
INTERRUPTED_ATTR = "interrupted"  # failed because its sweeper stopped, not because of the job; retried
RETRY_OF_ATTR = "retry_of"  # the interrupted trial whose parameters this one runs again
PRUNED_AT_ATTR = "pruned_at_step"
# Trial system attributes: which sweeper runs the trial and when it last said so.
OWNER_ATTR = "tbexp:owner"
HEARTBEAT_ATTR = "tbexp:heartbeat"

POINTER_FILE = "study.yaml"  # in a sweep directory: the storage and study it belongs to (read by tbexp.report)
SQLITE_TIMEOUT_S = 60  # jobs and the sweeper write to one sqlite file at once; wait for the lock instead of failing


def is_url(storage: str) -> bool:
    return "://" in storage


def without_password(storage: str) -> str:
    """The storage as it may be written down: a URL's password left out (libpq then reads `PGPASSWORD`).

    >>> without_password("postgresql://tb:pw@127.0.0.1:5432/optuna"), without_password("multirun/optuna.journal")
    ('postgresql://tb@127.0.0.1:5432/optuna', 'multirun/optuna.journal')
    """
    if not is_url(storage):
        return storage
    from sqlalchemy.engine import make_url

    url = make_url(storage)
    return (
        url._replace(password=None).render_as_string(hide_password=False) if url.password else storage
    )  # set() keeps a None


def absolute_storage(storage: str, base: Path) -> str:
    """The same storage with relative file paths made absolute from `base`, so jobs anywhere find it.

    A relative sqlite file's directory is created, as Optuna would fail on it.
    """
    if not is_url(storage):
        path = (base / storage).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return str(path)
    from sqlalchemy.engine import make_url

    url = make_url(storage)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return storage
    path = (base / url.database).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return url.set(database=str(path)).render_as_string(hide_password=False)


def open_storage(storage: str, create_tables: bool = True) -> Any:
    """An Optuna storage object for the string.

    Jobs pass create_tables=False: the sweeper has made the tables and checked
    their schema version, and skipping both saves each job about half a second.
    """
    import optuna

    if not is_url(storage):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(storage))
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if storage.startswith("sqlite"):
        engine_kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    if storage.startswith("postgresql://"):  # the driver tbexp installs (psycopg 3), whatever SQLAlchemy's default
        storage = "postgresql+psycopg://" + storage[len("postgresql://") :]
    return optuna.storages.RDBStorage(
        storage,
        engine_kwargs=engine_kwargs,
        skip_table_creation=not create_tables,
        skip_compatibility_check=not create_tables,
    )


def make_pruner(settings: dict[str, Any]) -> Any:
    """The pruner a `PrunerConf` (as a plain dict) names."""
    import optuna

    name = settings.get("name", "none")
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=settings["n_startup_trials"],
            n_warmup_steps=settings["n_warmup_steps"],
            interval_steps=settings["interval_steps"],
        )
    if name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=settings["min_resource"], reduction_factor=settings["reduction_factor"]
        )
    if name == "hyperband":
        max_resource = settings["max_resource"] or "auto"
        return optuna.pruners.HyperbandPruner(
            min_resource=settings["min_resource"],
            max_resource=max_resource,
            reduction_factor=settings["reduction_factor"],
        )
    raise ValueError(f"pruner.name={name!r}: choose none, median, successive_halving or hyperband")


def study_pruner(study: Any) -> Any:
    return make_pruner(study.user_attrs.get(PRUNER_ATTR, {"name": "none"}))


def load_study(storage: str, study_name: str, create_tables: bool = True) -> Any:
    """An existing study with the pruner its sweeper chose."""
    import optuna

    study = optuna.load_study(
        study_name=study_name, storage=open_storage(storage, create_tables), sampler=optuna.samplers.RandomSampler()
    )
    study.pruner = study_pruner(study)
    return study
