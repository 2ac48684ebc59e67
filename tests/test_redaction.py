"""No secret reaches a tracker, a log or a run file (tbexp.redaction): one test per sink.

A secret given as an override (`backend.base_url=https://me:<secret>@…`, a storage URL with a password) is moved
off the command line before Hydra copies it; what holds the resolved value passes `redact` on its way out.
Each test reads the sink itself, as a user (or an attacker with the files) would.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest

from tbexp.redaction import hide_secret_arguments, redact, redact_argument
from tbexp.study.storage import open_storage
from tests.conftest import REPO
from tests.postgres_service import postgres_url  # noqa: F401
from tests.test_trackers import wandb_records

SECRET = "hunter2-d0d0"
WITH_SECRETS = [
    "backend=tinker",  # base_url is a Tinker option; the oracle's eval never calls the service
    f"backend.base_url=https://me:{SECRET}@tinker.example/v1",
    f"trial.storage=postgresql://tb:{SECRET}@127.0.0.1/optuna",
]


def _tbexp(*args: str, cwd: Path = REPO, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRACKIO_", "TBEXP_SECRET_"))}
    done = subprocess.run(
        [sys.executable, "-m", "tbexp", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert SECRET not in done.stdout + done.stderr, "the job printed the secret"
    return done


def _holding_secret(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()
    )


@pytest.fixture(scope="module")
def runs(rootfs, tmp_path_factory):
    """One oracle eval per tracker, each given the secrets on its command line."""
    root = tmp_path_factory.mktemp("secret-runs")
    common = ["stage=eval", "policy=oracle", "tasks.limit=2", "eval.n_runs=1", *WITH_SECRETS]
    _tbexp(*common, f"hydra.run.dir={root / 'wandb'}", "logger=wandb", "trial.study=my-study")
    _tbexp(
        *common,
        f"hydra.run.dir={root / 'trackio'}",
        "logger=trackio",
        f"logger.dir={root / 'trackio-db'}",
        "logger.project=p",
    )
    return root


def test_hydras_run_files_hold_a_reference_not_the_secret(runs):
    hydra_dir = runs / "wandb" / ".hydra"
    overrides = (hydra_dir / "overrides.yaml").read_text()
    assert "backend.base_url=${tbexp_secret:BACKEND__BASE_URL}" in overrides
    assert "${tbexp_secret:TRIAL__STORAGE}" in (hydra_dir / "config.yaml").read_text()
    assert _holding_secret(hydra_dir) == []


def test_wandb_keeps_neither_the_secret_in_its_config_nor_in_its_args(runs):
    (run,) = (runs / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    args = [list(r.environment.args) for r in wandb_records(run) if r.WhichOneof("record_type") == "environment"]
    assert any("backend.base_url=${tbexp_secret:BACKEND__BASE_URL}" in a for a in args)  # W&B's copy
    assert _holding_secret(runs / "wandb" / "wandb") == []  # the run, its config, its captured console


def test_trackio_keeps_neither_the_secret_in_its_config_nor_in_its_command(runs):
    db = runs / "trackio-db" / "p.db"
    (config,) = [json.loads(c) for (c,) in sqlite3.connect(db).execute("SELECT config FROM configs")]
    assert "${tbexp_secret:BACKEND__BASE_URL}" in config["_Command"]
    assert config["backend"]["base_url"] == "https://<redacted>@tinker.example/v1"
    assert SECRET.encode() not in db.read_bytes()


def test_no_other_file_of_the_run_holds_the_secret(runs):
    """metrics.jsonl, summary.json, episodes, tasks.csv, the job's log."""
    assert list((runs / "trackio").glob("*.log")), "the job's log file is among what is read"
    assert _holding_secret(runs) == []


def test_logs_printed_output_and_tracebacks_are_redacted(tmp_path):
    """Whatever a stage logs or prints after `redact_output` (Hydra's job log, stderr, which submitit and SLURM
    keep in files), including an exception's message, with the secret from the environment or a URL."""
    script = textwrap.dedent(f"""
        import logging, sys
        from tbexp.redaction import redact_output
        logging.basicConfig(filename={str(tmp_path / "job.log")!r}, level=logging.INFO)
        logging.getLogger().addHandler(logging.StreamHandler(sys.stderr))
        redact_output()
        logging.info("connecting to https://me:pw-in-url@host/v1 with key %s", "{SECRET}")
        try:
            raise RuntimeError("refused: {SECRET}")
        except RuntimeError:
            logging.exception("the call failed")
        print("key={SECRET}", file=sys.stderr)
        print("key={SECRET}")
    """)
    env = {**os.environ, "TINKER_API_KEY": SECRET}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "job.log").read_text()
    for text in (log, done.stderr, done.stdout):
        assert SECRET not in text and "pw-in-url" not in text and "<redacted>" in text
    assert "RuntimeError: refused: <redacted>" in log


def test_sandboxes_start_without_the_jobs_secrets(demo_task, sandbox_settings, monkeypatch):
    """The agent never sees what the job process holds in its environment."""
    from tbexp.sandboxes.base import make_sandbox

    monkeypatch.setenv("TINKER_API_KEY", SECRET)
    monkeypatch.setenv("TBEXP_SECRET_BACKEND__BASE_URL", f"https://me:{SECRET}@host")
    sandbox = make_sandbox(sandbox_settings, demo_task)
    sandbox.start()
    try:
        seen = sandbox.exec("env; cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'", timeout_s=10).output
    finally:
        sandbox.stop()
    assert "PATH=" in seen and SECRET not in seen


def test_a_sweeps_storage_password_stays_out_of_its_jobs_files_and_its_study(tmp_path, rootfs, postgres_url):  # noqa: F811
    """A PostgreSQL URL with a password on the sweep's command line: the trials reach the study (the jobs resolve
    it), and no job file, submitit pickle, log or study attribute holds the password."""
    storage = postgres_url.replace("postgres@", f"postgres:{SECRET}@")  # trust authentication: any password does
    (tmp_path / "conf" / "sweep").mkdir(parents=True)
    (tmp_path / "conf" / "sweep" / "leak.yaml").write_text(
        textwrap.dedent("""\
        # @package _global_
        defaults:
          - override /hydra/sweeper: tbexp_optuna
        hydra:
          sweeper:
            study_name: leak
            objective: {metric: eval/reward, direction: maximize}
            sampler: {name: random, seed: 0}
            n_trials: 2
            n_jobs: 2
            params:
              eval.n_runs: {type: categorical, choices: [1]}
        """)
    )
    _tbexp(
        "-m",
        "+sweep=leak",
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
        f"hydra.sweep.dir={tmp_path / 'multirun'}",
        f"hydra.sweeper.storage={storage}",
        "hydra/launcher=submitit_local",
        "stage=eval",
        "policy=oracle",
        "tasks.limit=1",
        timeout=600,
    )
    study = optuna.load_study(study_name="leak", storage=open_storage(storage))
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    storage_ = study._storage
    attrs = [study.user_attrs, storage_.get_study_system_attrs(study._study_id)]
    attrs += [t.user_attrs | storage_.get_trial_system_attrs(t._trial_id) | t.params for t in study.trials]
    assert SECRET not in json.dumps(attrs, default=str)
    assert list((tmp_path / "multirun").rglob("*.pkl")), "submitit's job pickles are among what is read"
    assert _holding_secret(tmp_path / "multirun") == []


def test_redact():
    config = {
        "backend": {
            "api_key": "tml-123",
            "TINKER_API_KEY": "tml-456",
            "hf_token": "hf_x",
            "max_tokens": 96,
            "empty_token": "",
        },
        "db": {"password": "pw", "url": "postgresql://u:pw@h/db?sslmode=require&access_token=abc"},
        "list": [{"client_secret": "s"}],
    }
    assert redact(config) == {
        "backend": {
            "api_key": "<redacted>",
            "TINKER_API_KEY": "<redacted>",
            "hf_token": "<redacted>",
            "max_tokens": 96,
            "empty_token": "",
        },
        "db": {"password": "<redacted>", "url": "postgresql://<redacted>@h/db?sslmode=require&access_token=<redacted>"},
        "list": [{"client_secret": "<redacted>"}],
    }


def test_a_user_name_alone_is_no_secret():
    assert redact("postgresql://postgres@127.0.0.1:5432/tbexp") == "postgresql://postgres@127.0.0.1:5432/tbexp"
    assert redact("postgresql://postgres:@127.0.0.1/tbexp") == "postgresql://postgres:@127.0.0.1/tbexp"


def test_known_secret_values_are_redacted_wherever_they_stand(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "local-0123456789")
    monkeypatch.setenv("SHORT_TOKEN", "1")  # too short to blot out of every text
    assert redact("key local-0123456789 in a message, port 1") == "key <redacted> in a message, port 1"


def test_secret_arguments_move_to_the_environment_and_others_stay():
    args = ["stage=eval", "logger.dir=/x", "backend.api_key='tml-2'", "-m", "a=${x}"]
    hidden, env = hide_secret_arguments(args)
    assert hidden == [
        "stage=eval",
        "logger.dir=/x",
        "backend.api_key=${tbexp_secret:BACKEND__API_KEY}",
        "-m",
        "a=${x}",
    ]
    assert env == {"TBEXP_SECRET_BACKEND__API_KEY": "tml-2"}  # Hydra's quotes are not part of the secret
    assert redact_argument("+hf_token=abc") == "+hf_token=<redacted>"


def test_a_config_made_from_a_secret_command_line_says_how_to_give_it_again(monkeypatch):
    from omegaconf import OmegaConf

    from tbexp.redaction import register_resolver

    register_resolver()
    monkeypatch.delenv("TBEXP_SECRET_BACKEND__BASE_URL", raising=False)
    cfg = OmegaConf.create({"base_url": "${tbexp_secret:BACKEND__BASE_URL}"})
    with pytest.raises(Exception, match="TBEXP_SECRET_BACKEND__BASE_URL.*command line"):
        cfg.base_url
