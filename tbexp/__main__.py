"""`python -m tbexp`: compose the config, check it, seed, build the job, run one stage, return its objective.

Heavy libraries (torch, docker, harbor) are imported by the stage that needs
them, so composing or printing a config (`--cfg job`) stays fast.
"""

from __future__ import annotations

import importlib
import logging
import math
import random
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from tbexp.config import check, register
from tbexp.errors import TbexpError
from tbexp.job import Job
from tbexp.jobs.launchers import assign_local_job_gpus
from tbexp.jobs.tracking import job_run, note_result
from tbexp.redaction import redact_output, reexec_without_secrets
from tbexp.seeds import stream

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
OBJECTIVE = "eval/reward"  # the number a sweep optimises: held-out reward

register()
log = logging.getLogger("tbexp")


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    from tbexp.study.trial import TrialPruned

    redact_output()  # Hydra has set up its logs: from here on, nothing printed or logged carries a secret
    try:
        check(cfg)
        assign_local_job_gpus()  # before any stage starts CUDA
        random.seed(stream(cfg.seed, "process"))
        stage = importlib.import_module(f"tbexp.stages.{cfg.stage.name}")
        job = Job(cfg)  # the one place that builds what the stages share
        job.models.probe()  # a service that lacks the model or the loss says so now, not after the collection
        with job_run(cfg):  # the job's one W&B / Trackio run, if logger says so
            metrics = stage.run(job)
            note_result(metrics)  # the W&B report reads a sweep's objective from the runs' summaries
        log.info("%d model load(s) in this job", job.models.loads)
    except TbexpError as err:  # bad input or a missing service: its message names the file or key
        print(f"tbexp: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except TrialPruned as stop:  # the sweep's pruner ended this trial (already marked PRUNED in the study)
        print(f"tbexp: {stop}", file=sys.stderr)
        return float("nan")
    key = cfg.trial.objective or OBJECTIVE
    objective = float(metrics.get(key, float("nan")))  # stages without a held-out score give no objective
    if key in metrics and math.isnan(objective):  # a sweep fails such a trial; say why here, where the eval's table is
        print(
            f"tbexp: the objective {key} is NaN: its eval scored no valid episode (see the eval's tasks.csv)",
            file=sys.stderr,
        )
    return objective


if __name__ == "__main__":
    reexec_without_secrets()  # a secret on the command line moves to the environment before Hydra copies it
    main()
