"""A Hydra app for the sweeper tests: a free objective of x and y, with switches to misbehave on given trials.

    python -m tests.sweep_app.app -m hydra.sweep.dir=... hydra.sweeper.storage=...

Each job appends "trial pid" to ran.txt in its directory (so a test sees a directory used twice), reports
`loss` at each of `steps` steps (sleeping `sleep_s` before each) and returns it, unless its trial number is
in one of the misbehaviour lists. `--config-name bounds` sweeps a pair lo < hi on a grid instead.
"""

import json
import math
import os
import signal
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from tbexp.study.trial import TrialPruned, report


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg) -> float:
    out = Path(HydraConfig.get().runtime.output_dir)
    with (out / "ran.txt").open("a") as f:
        f.write(f"{cfg.trial.number} {os.getpid()}\n")
    number = cfg.trial.number
    if number in cfg.raise_on:
        raise RuntimeError(f"trial {number} raises on purpose")
    if number in cfg.kill_on:
        os.kill(os.getpid(), signal.SIGKILL)
    if number in cfg.hang_on:
        time.sleep(3600)
    if number in cfg.slow_on:
        time.sleep(cfg.slow_s)
    if cfg.get("lo") is not None and not cfg.lo < cfg.hi:
        raise ValueError(f"infeasible pair lo={cfg.lo} hi={cfg.hi}")
    loss = (cfg.x - 1.0) ** 2 + cfg.y + (0.0 if cfg.get("lo") is None else (cfg.hi - cfg.lo - 0.5) ** 2)
    try:
        for step in range(cfg.steps):
            time.sleep(cfg.sleep_s)
            with (out / "metrics.jsonl").open("a") as f:  # as tbexp's Tracker writes it, for the report's curves
                f.write(json.dumps({"step": step, "loss": loss + (cfg.steps - step)}) + "\n")
            report(cfg, "loss", loss + (cfg.steps - step), step, higher_is_better=False)
    except TrialPruned:
        return math.nan
    if number in cfg.nan_on:
        return math.nan
    return loss


if __name__ == "__main__":
    main()
