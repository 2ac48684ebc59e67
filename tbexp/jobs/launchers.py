"""The job's side of hydra-submitit-launcher: its config files, and GPUs for local jobs.

`conf/hydra/launcher/submitit_{local,slurm}.yaml` take the place of the
plugin's configs of the same names, so `hydra/launcher=submitit_slurm` gets
tbexp's defaults (requeue on time-out, every key documented). Hydra 1.3 still
type-checks such a file against the plugin's dataclass, and warns on every
launch that this matching is deprecated; the files list every key, so they
work the same without it, and the warning is silenced here.

A job that submitit starts unpickles the entry point's `main` (pickled by
value, being `__main__`'s) and never runs that module's top level, where
`tbexp.config.register()` is called. The ConfigStore comes across with the
pickle, but not register's patch that reads `# @package` after a config
file's first-line command, so `+experiment=…` and `+sweep=…` files would
compose into the wrong package in the job. `main` refers to this module, so
unpickling imports it, and it calls `register()` (idempotent) here.

submitit's local executor starts every job of a sweep at once, each with
`CUDA_VISIBLE_DEVICES` set to the first `gpus_per_node` GPUs, so all of them
would train on GPU 0. A job started that way (`SUBMITIT_EXECUTOR=local`)
takes instead the slice of the machine's GPUs its Hydra job number points to:
job n of k-GPU jobs on a machine with G GPUs gets slot n mod (G // k). Jobs
beyond the number of slots share GPUs round-robin (the local launcher has no
queue; use fewer jobs at once, or SLURM, when they do not fit together).
SLURM jobs are left alone: SLURM binds each job to the GPUs it allocated.
The machine's GPUs are `TBEXP_GPUS` (e.g. `2,3`, to keep a sweep off the
others) or every GPU `nvidia-smi` lists (it ignores CUDA_VISIBLE_DEVICES).
This runs before any stage imports torch, which reads the variable when CUDA
starts.
"""

from __future__ import annotations

import logging
import os
import subprocess
import warnings

from tbexp.config import register

register()
log = logging.getLogger(__name__)
warnings.filterwarnings(
    "ignore", message=r"(?s).*'hydra/launcher/submitit_(local|slurm)' is validated against ConfigStore schema"
)


def devices_for_job(job_num: int, machine_gpus: list[str], per_job: int) -> list[str]:
    """The GPUs job `job_num` uses when each job wants `per_job` of `machine_gpus`.

    >>> devices_for_job(3, ["0", "1", "2", "3"], 1)
    ['3']
    >>> devices_for_job(5, ["0", "1", "2", "3"], 2)
    ['2', '3']
    >>> devices_for_job(2, ["0", "1"], 1)  # more jobs than GPUs: round-robin
    ['0']
    """
    if per_job <= 0 or not machine_gpus:
        return []
    slots = max(1, len(machine_gpus) // per_job)
    start = (job_num % slots) * per_job
    return machine_gpus[start : start + per_job]


def machine_gpus() -> list[str]:
    """`TBEXP_GPUS` if set, else the indices of every GPU the NVIDIA driver lists; [] without one."""
    chosen = os.environ.get("TBEXP_GPUS", "").strip()
    if chosen:
        return [d.strip() for d in chosen.split(",") if d.strip()]
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()] if listed.returncode == 0 else []


def assign_local_job_gpus(job_num: int | None = None) -> list[str] | None:
    """Point CUDA_VISIBLE_DEVICES of a submitit_local job at its own GPUs; None when there is nothing to do.

    `job_num` defaults to the running Hydra job's number.
    """
    if os.environ.get("SUBMITIT_EXECUTOR") != "local":
        return None
    if job_num is None:
        from hydra.core.hydra_config import HydraConfig

        job_num = HydraConfig.get().job.get("num") if HydraConfig.initialized() else None
        if job_num is None:
            return None
    per_job = len([d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()])
    if per_job == 0:  # a CPU job (gpus_per_node unset)
        return None
    devices = devices_for_job(job_num, machine_gpus(), per_job)
    if not devices:
        return None
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    log.info("submitit_local job %d: CUDA_VISIBLE_DEVICES=%s", job_num, os.environ["CUDA_VISIBLE_DEVICES"])
    return devices
