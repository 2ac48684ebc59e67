#!/usr/bin/env python
"""scripts/bench_grpo.py: where a default GRPO step's time goes on this machine.

    .venv/bin/python scripts/bench_grpo.py                          # 4 steps from a short SFT of the tiny model
    .venv/bin/python scripts/bench_grpo.py --checkpoint PATH --steps 6
    .venv/bin/python scripts/bench_grpo.py --compare --steps 3 grpo.group_size=8   # synchronous vs pipelined

Runs the GRPO stage exactly as `+experiment=pipeline` configures it (groups of
16 episodes, 4 groups a step, fresh bubblewrap sandboxes, the local backend)
on train tasks, from `--checkpoint` or, without one, from a 100-step SFT of
the tiny model on the oracle's turns (trained once and kept under
`~/.cache/tbexp/bench/`; the rollouts need a policy that sometimes succeeds,
or every group is skipped and nothing trains). Held-out evals are off, so
every second measured belongs to a step.

It prints per step: seconds, episodes per second, and the phases —
`sample` (wall time the sampler was busy; batches run one at a time),
`train` (forward_backward + optim_step), and `sandbox` = the rest of the
rollout wall time, when no sample was being drawn and the step waited on
sandboxes and tests. The aim: sandboxes and tests take at most a third of a
step. Also the sandbox-seconds summed over concurrent episodes (`env`,
`verify`) and the load average, since other work on the machine slows every
phase. Not a test: the numbers are the output.

Both modes also print where the CPU went between steps' ends (steps after the first, whose interval also
holds the model's loading): CPU-s per episode of this process (sampler, updates) and of the rest of the
machine (on an idle machine, the sandboxes: bwrap, the agent's commands, the tests), and the episodes/s
that the machine's cores would allow at that CPU per episode.

With `--compare` it runs the same steps once per variant (`VARIANTS`: the
synchronous loop with the sampler's forward passes through transformers, as
before `tbexp.backends.llama_steps`; the synchronous loop; `grpo.max_off_policy_steps=1`;
and that with the updates on one torch thread so the sampler keeps the other
core), each from the same checkpoint
on the same RL tasks, and prints per variant: the steps' wall time (the sum of
`time/step`: in a pipelined run the wait for rollouts plus the update; checkpoint
saves and the last step's held-out eval are outside it), episodes/s, steps/s and
the held-out reward of the last step's eval.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument(
        "--checkpoint", default="", help="start GRPO from this checkpoint (default: a cached 100-step SFT)"
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--compare", action="store_true", help="run every variant of VARIANTS and compare them")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. grpo.concurrency=16")
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    from tbexp.config import register

    register()
    from tbexp.backends.llama_steps import transformers_only
    from tbexp.job import Job
    from tbexp.stages import grpo

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=["+experiment=pipeline", *args.overrides])
        bench = [
            f"grpo.steps={args.steps}",
            "grpo.eval_at_start=false",
            f"grpo.eval_every={10**6}",
            "grpo.eval_n_runs=1",
        ]
        job = Job(compose("config", overrides=["+experiment=pipeline", *bench, *args.overrides]))
    checkpoint = args.checkpoint or _warm_checkpoint(cfg, job)

    run = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    # The stage always scores its last step on the held-out tasks; that eval is not part of any step's time.
    tasks = grpo.rl_tasks(job, checkpoint, run)  # grpo.tasks_file, else the filter's pick, as the pipeline's
    if not args.compare:
        cpu = _CpuAtSteps.attach(job)
        grpo.train(job, checkpoint, tasks, run)
        _print_steps(job.cfg, run)
        _print_batcher(job)
        print(cpu.summary(job.cfg.grpo.groups_per_step * job.cfg.grpo.group_size, run))
        return
    rows = []
    for name, (variant, llama_steps) in VARIANTS.items():
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            one = Job(compose("config", overrides=["+experiment=pipeline", *bench, *args.overrides, *variant]))
        one.models = job.models  # one model load for all
        cpu = _CpuAtSteps.attach(one)
        clock = time.perf_counter()
        with contextlib.nullcontext() if llama_steps else transformers_only():
            grpo.train(one, checkpoint, tasks, run / name)
        rows.append(_totals(name, one.cfg, run / name, time.perf_counter() - clock))
        print(f"{name}: {cpu.summary(one.cfg.grpo.groups_per_step * one.cfg.grpo.group_size, run / name)}")
    print(f"\nGRPO from {checkpoint}, {args.steps} steps, load average {os.getloadavg()[0]:.1f}")
    print(f"{'variant':<26} {'steps s':>8} {'ep/s':>6} {'steps/s':>8} {'x sync':>7} {'train() s':>9} {'held-out':>9}")
    for r in rows:
        print(
            f"{r['variant']:<26} {r['steps_s']:8.1f} {r['episodes_s']:6.2f} {r['steps_per_s']:8.3f} "
            f"{r['episodes_s'] / rows[0]['episodes_s']:7.2f} {r['train_s']:9.1f} {r['heldout_reward']:9.3f}"
        )
    print(json.dumps(rows))


# name -> (the overrides beside the benchmark's own, whether the sampler may use LlamaSteps); the first is the
# baseline: the sampler as it was before LlamaSteps, through transformers' forward (the same tokens, slower)
VARIANTS = {
    "sync, transformers fwd": ([], False),
    "synchronous": ([], True),
    "pipelined": (["grpo.max_off_policy_steps=1"], True),
    "pipelined, train 1 thread": (["grpo.max_off_policy_steps=1", "backend.train_threads=1"], True),
}


class _CpuAtSteps:
    """CPU time at each logged GRPO step: this process's (sampler, updates) and the whole machine's.

    The sandboxes' processes are not all this process's reaped children, so their CPU is taken as the
    machine's (`/proc/stat`) minus this process's: figures for an otherwise idle machine.
    """

    def __init__(self):
        self.marks: list[tuple[float, float]] = []

    @classmethod
    def attach(cls, job) -> "_CpuAtSteps":
        cpu, make_tracker = cls(), job.tracker

        def tracker(folder):
            made = make_tracker(folder)
            log = made.log

            def logged(metrics, *args, **kwargs):
                if "time/step" in metrics:
                    cpu.mark()
                return log(metrics, *args, **kwargs)

            made.log = logged
            return made

        job.tracker = tracker
        cpu.mark()
        return cpu

    def mark(self) -> None:
        own = resource.getrusage(resource.RUSAGE_SELF)
        self.marks.append((own.ru_utime + own.ru_stime, _machine_cpu_s()))

    def summary(self, episodes_per_step: int, run: Path) -> str:
        steps = _step_rows(run)[1:]
        intervals = list(zip(self.marks[1:], self.marks[2:]))
        if not intervals:
            return "CPU: too few steps to measure (the first step's interval holds the model's loading)"
        episodes = sum(r.get("rollout/episodes", episodes_per_step) for r in steps[: len(intervals)])
        own = sum(b[0] - a[0] for a, b in intervals) / episodes
        rest = sum(b[1] - a[1] for a, b in intervals) / episodes - own
        cores = os.cpu_count() or 1
        return (
            f"CPU-s per episode over steps 2-{len(intervals) + 1}: this process {own:.3f}, the rest of the machine "
            f"(the sandboxes, if nothing else ran) {rest:.3f}; {cores} cores allow {cores / (own + rest):.2f} "
            f"episodes/s at this CPU, {cores / rest:.2f} if the sandboxes alone used them"
        )


def _machine_cpu_s() -> float:
    """Busy CPU-seconds of the whole machine since boot: /proc/stat's user, nice, system, irq and softirq."""
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _step_rows(run: Path) -> list[dict]:
    """The metrics rows of GRPO's steps (the held-out evals' rows are apart)."""
    return [r for r in _rows(run) if "time/step" in r]


def _totals(name: str, cfg, run: Path, train_s: float) -> dict:
    rows = _rows(run)
    steps = [r for r in rows if "time/step" in r]
    steps_s = sum(r["time/step"] for r in steps)
    episodes = sum(r.get("rollout/episodes", r["rollout/groups"] * cfg.grpo.group_size) for r in steps)
    heldout = [r["heldout/reward"] for r in rows if "heldout/reward" in r]
    return {
        "variant": name,
        "steps": len(steps),
        "steps_s": steps_s,
        "episodes": episodes,
        "episodes_s": episodes / steps_s,
        "steps_per_s": len(steps) / steps_s,
        "train_s": train_s,
        "heldout_reward": heldout[-1] if heldout else float("nan"),
    }


def _print_steps(cfg, run: Path) -> None:
    steps = _step_rows(run)
    episodes = cfg.grpo.groups_per_step * cfg.grpo.group_size
    print(
        f"\nGRPO: {cfg.grpo.groups_per_step} groups x {cfg.grpo.group_size} episodes a step, "
        f"concurrency {cfg.grpo.concurrency}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'step':>4} {'s/step':>7} {'ep/s':>6} {'sample':>7} {'sandbox':>8} {'train':>6}   {'env sum':>8} {'verify sum':>10} {'reward':>7}"
    )
    shares = []
    for r in steps:
        sandbox = max(r["time/rollout"] - r["time/sample"], 0.0)
        share = {
            "sample": r["time/sample"] / r["time/step"],
            "sandbox": sandbox / r["time/step"],
            "train": r["time/train"] / r["time/step"],
        }
        shares.append(share)
        print(
            f"{r['step']:>4} {r['time/step']:7.1f} {episodes / r['time/step']:6.2f} {share['sample']:7.0%} {share['sandbox']:8.0%} {share['train']:6.0%}   {r['time/env']:8.1f} {r['time/verify']:10.1f} {r['rollout/reward_mean']:7.3f}"
        )
    mean = {k: statistics.fmean(s[k] for s in shares) for k in ("sample", "sandbox", "train")}
    step_s = statistics.fmean(r["time/step"] for r in steps)
    print(
        f"mean: {step_s:.1f} s/step, {episodes / step_s:.2f} episodes/s; sample {mean['sample']:.0%}, sandboxes+tests {mean['sandbox']:.0%} (target <= 33%), train {mean['train']:.0%}"
    )


def _print_batcher(job) -> None:
    """With backend.continuous_batching: the running batch's counters (prompt tokens served from cached pages, ...)."""
    engine = getattr(job.models._host, "_engine", None)
    batcher = getattr(engine, "_batcher", None)
    if batcher is not None:
        print("continuous batcher:", json.dumps({k: round(v, 2) for k, v in batcher.stats.items()}))


def _warm_checkpoint(cfg, job) -> str:
    """A 100-step SFT of the tiny model, trained once per machine and kept."""
    from hydra import compose, initialize_config_dir

    from tbexp.job import Job
    from tbexp.stages import collect, sft

    folder = job.cache_dir / "bench" / "sft-100"
    done = folder / "chosen_checkpoint.txt"
    if not done.exists():
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            warm = Job(compose("config", overrides=["+experiment=pipeline", "sft.steps=100", "sft.eval_every=100"]))
        warm.models = job.models  # one model load for both
        sft.train(warm, collect.oracle_trajectories(warm), folder)
    return done.read_text().strip()


if __name__ == "__main__":
    main()
