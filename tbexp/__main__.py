"""`python -m tbexp`: compose the config, check it, seed, build the job, run one stage, return its objective.

Heavy libraries (torch, docker, harbor) are imported by the stage that needs
them, so composing or printing a config (`--cfg job`) stays fast.
"""

from __future__ import annotations

import importlib
import logging
import random
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from tbexp.config import ConfigError, check, register
from tbexp.job import Job
from tbexp.launchers import assign_local_job_gpus
from tbexp.tracking import job_run, note_result

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
OBJECTIVE = "eval/reward"  # the number a sweep optimises: held-out reward

register()
log = logging.getLogger("tbexp")


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    from tbexp.backends.tinker_backend import BackendError
    from tbexp.models import ModelLoadError
    from tbexp.policies import PolicyError
    from tbexp.renderers import RendererError
    from tbexp.sandboxes.base import SandboxError
    from tbexp.sandboxes.dockerfile import DockerfileError
    from tbexp.tasks import TaskError
    from tbexp.trial import TrialPruned
    from tbexp.trajectories import DataError

    try:
        check(cfg)
        assign_local_job_gpus()  # before any stage starts CUDA
        random.seed(cfg.seed)
        stage = importlib.import_module(f"tbexp.stages.{cfg.stage.name}")
        job = Job(cfg)  # the one place that builds what the stages share
        with job_run(cfg):  # the job's one W&B / Trackio run, if logger says so
            metrics = stage.run(job)
            note_result(metrics)  # the W&B report reads a sweep's objective from the runs' summaries
        log.info("%d model load(s) in this job", job.models.loads)
    except (ConfigError, TaskError, PolicyError, SandboxError, DockerfileError, DataError, ModelLoadError, RendererError, BackendError) as err:
        print(f"tbexp: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except TrialPruned as stop:  # the sweep's pruner ended this trial (already marked PRUNED in the study)
        print(f"tbexp: {stop}", file=sys.stderr)
        return float("nan")
    return float(metrics.get(cfg.trial.objective or OBJECTIVE, float("nan")))  # stages without a held-out score give no objective


if __name__ == "__main__":
    main()
