#!/usr/bin/env python
"""scripts/bench_tinker_latency.py: GRPO on backend=tinker, synchronous vs pipelined, under synthetic call latencies.

    .venv/bin/python scripts/bench_tinker_latency.py
    .venv/bin/python scripts/bench_tinker_latency.py --forward-backward-s 5 --sample-s 0.5 --steps 4

The Tinker service cannot be reached from this machine, so the GRPO stage runs,
unchanged, against the stand-in of tests/test_tinker_loops.py: `tinker.ServiceClient`
replaced at the SDK's boundary by an object that trains and samples the tiny
model with the local engine. Each of its futures first sleeps for a latency
stated on the command line (the time a call to the service would spend away
from this machine), then does the stand-in's work:

* forward_backward (and forward): `--forward-backward-s`
* optim_step: `--optim-step-s`
* saving or loading weights (save_state, save_weights_for_sampler, the sampling
  client made from the live weights, load_state): `--weights-s`
* each sample call: `--sample-s`, plus `--sample-token-s` per token sampled

The sleep is spent when the result is asked for, which in the stage is at once,
except optim_step's, asked for after forward_backward's, as the service runs a
client's calls in order. The latencies are synthetic: every figure this prints
says so, and none is a measurement of Tinker.

Every step must train for the update's latency to count, and the tiny model
rarely solves a task from scratch, so rewards are replaced by the run index
within a group (0, 1, 2, ...: they always spread), as the pipelining test does;
the reward figures mean nothing here. Per variant (`VARIANTS`: the synchronous
loop and `grpo.max_off_policy_steps=1`, each from the base model on the same
RL tasks) it prints the steps' wall time (the sum of `time/step`; the per-step
checkpoint save falls outside it, and in the synchronous loop so does the
sampling client's weight save), steps/s, episodes/s, the ratio to the
synchronous run, the mean seconds from one step's end to the next (which
includes those saves), the whole `grpo.train` call, and the load average.

`--rollouts 1,4,16` measures rollouts instead: episodes/s of the model policy on the RL tasks at each
concurrency, through the same stand-in with the same synthetic sample latency, for the sampling path as it is
("concurrent": a request submitted under ModelRuntime's lock, its reply awaited outside it) and as it was before
issue #42 ("lock held": the reply awaited inside the lock, reproduced here by wrapping the sampler).
With `--base-url URL` the rollouts sample from a real Tinker-API server instead (scripts/start_tinker_server.sh;
any TINKER_API_KEY): no synthetic latency then, the server's own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))  # bench_grpo's totals

# name -> the overrides beside the benchmark's own; the first is the baseline
VARIANTS = {
    "synchronous": ["grpo.max_off_policy_steps=0"],
    "pipelined": ["grpo.max_off_policy_steps=1"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward-backward-s", type=float, default=2.0, help="latency of forward_backward")
    parser.add_argument("--optim-step-s", type=float, default=0.5, help="latency of optim_step")
    parser.add_argument("--weights-s", type=float, default=1.0, help="latency of a save or load of weights")
    parser.add_argument("--sample-s", type=float, default=0.3, help="latency of a sample call")
    parser.add_argument("--sample-token-s", type=float, default=0.01, help="latency per token sampled")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rollouts", default="", help="concurrencies, e.g. 1,4,16: rollout episodes/s instead")
    parser.add_argument("--base-url", default="", help="--rollouts: sample from this Tinker-API server")
    parser.add_argument("--episodes", type=int, default=16, help="--rollouts: episodes per concurrency")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. grpo.group_size=8")
    args = parser.parse_args()
    latency = {
        "forward_backward": args.forward_backward_s,
        "forward": args.forward_backward_s,
        "optim_step": args.optim_step_s,
        **dict.fromkeys(("save_state", "save_weights_for_sampler", "sampling_client", "load"), args.weights_s),
        "sample": args.sample_s,
    }

    import tbexp.backends.tinker_backend as tinker_backend
    from tbexp.job import Job
    from tbexp.stages import grpo
    from tests import test_tinker_loops as stand_in
    from tests.conftest import compose_config

    stand_in.Later = _delayed(stand_in.Later, latency, args.sample_token_s)
    # Rewards that always spread, so every step updates (and waits on the update's latency).
    grpo.score_episodes = lambda episodes, _: {id(ep): float(ep.run) for ep in episodes}
    bench = [
        "stage=grpo",
        *stand_in.TINKER_POLICY,
        "task_filter=none",
        "tasks.families=[file-move]",
        "tasks.limit=3",
        "grpo.groups_per_step=2",
        "grpo.group_size=4",
        "sampling.max_tokens=48",
        "agent.max_turns=3",
        f"grpo.steps={args.steps}",
        "grpo.eval_at_start=false",
        f"grpo.eval_every={10**6}",
        "grpo.eval_n_runs=1",
        *args.overrides,
    ]
    _check_rootfs(compose_config(*bench))
    print("synthetic latencies (s):", json.dumps({**latency, "sample per token": args.sample_token_s}))

    run = Path(tempfile.mkdtemp(prefix="bench-tinker-latency-"))
    if args.rollouts:
        concurrencies = [int(c) for c in args.rollouts.split(",")]
        _rollouts(bench, concurrencies, args.episodes, run, stand_in, tinker_backend, args.base_url)
        return
    rows = []
    for name, variant in VARIANTS.items():
        service = stand_in.StandInService(run / name / "service")
        tinker_backend._connect = lambda base_url, service=service: service
        job = Job(compose_config(*bench, *variant), run_dir=run / name)
        clock = time.perf_counter()
        grpo.train(job, "", job.tasks("rl"), run / name / "grpo")
        rows.append(_totals(name, job.cfg, run / name / "grpo", time.perf_counter() - clock))
    _print_table(rows, args.steps, job.cfg)


def _rollouts(
    bench: list[str], concurrencies: list[int], n_episodes: int, run: Path, stand_in, tinker_backend, base_url: str
) -> None:
    """Episodes/s of the model policy at each concurrency, sampling path as it is and as it was (module doc)."""
    import threading

    from tbexp.build import run_policy
    from tbexp.job import Job
    from tests.conftest import compose_config

    if base_url:
        bench = [*bench, f"backend.base_url={base_url}"]
    else:
        service = stand_in.StandInService(run / "service")
        tinker_backend._connect = lambda base_url: service
    job = Job(compose_config(*bench), run_dir=run / "rollouts")
    tasks = job.tasks("rl")
    n_runs = max(1, n_episodes // len(tasks))
    sampler = job.models.sampler("")

    class LockHeld:  # the pre-#42 path: the reply awaited while ModelRuntime's lock is held
        tokenizer = sampler.tokenizer
        lock = threading.Lock()

        def sample(self, prompt, num_samples, params):
            with self.lock:
                value = sampler.sample(prompt, num_samples, params).result()
            return type("Done", (), {"result": lambda _self: value})()

        def compute_logprobs(self, prompt):
            return sampler.compute_logprobs(prompt)

    rows = []
    # A real server compiles each new batch shape on first sight (SkyRL's JAX: seconds each), so against one every
    # setting runs once unmeasured first; the stand-in has nothing to warm.
    for path, wrapped in (("lock held", LockHeld()), ("concurrent", sampler)):
        for concurrency in concurrencies:
            runtime = job.models.runtime(wrapped, job.cfg.sampling, seed=0)
            for measured in (False, True) if base_url else (True,):
                clock = time.perf_counter()
                episodes = run_policy(job, tasks, n_runs, concurrency, "model", runtime)
                seconds = time.perf_counter() - clock
            rows.append({"path": path, "concurrency": concurrency, "episodes": len(episodes), "s": seconds})
    where = f"SkyRL's Tinker server at {base_url}" if base_url else "the Tinker stand-in, SYNTHETIC LATENCIES"
    print(f"\nrollouts on {where}, load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")
    print(f"{'path':<11} {'concurrency':>11} {'episodes':>8} {'s':>7} {'ep/s':>6} {'x at 1':>6}")
    for r in rows:
        base = next(b for b in rows if b["path"] == r["path"] and b["concurrency"] == concurrencies[0])
        print(
            f"{r['path']:<11} {r['concurrency']:>11} {r['episodes']:>8} {r['s']:7.1f} "
            f"{r['episodes'] / r['s']:6.2f} {base['s'] / r['s'] * r['episodes'] / base['episodes']:6.2f}"
        )
    print(json.dumps({"synthetic_latencies": not base_url, "rows": rows}))


def _delayed(later: type, latency: dict[str, float], token_s: float) -> type:
    """The stand-in's future with a call's latency slept inside its work, before the work itself."""

    class Delayed(later):
        def result(self):
            time.sleep(latency.get(self.name, 0.0))
            out = super().result()
            if self.name == "sample":  # the sequences of one call are sampled side by side
                time.sleep(token_s * max((len(s.tokens) for s in out.sequences), default=0))
            return out

    return Delayed


def _check_rootfs(cfg) -> None:
    """The sandboxes' root file system, as the tests find it (tests/conftest.py's `rootfs`)."""
    if not (Path(cfg.sandbox.rootfs) / ".tbexp-complete").exists():
        sys.exit(
            f"no sandbox root file system at {cfg.sandbox.rootfs}: run scripts/build_rootfs.sh {cfg.sandbox.rootfs}"
        )


def _totals(name: str, cfg, run: Path, train_s: float) -> dict:
    """bench_grpo's per-variant totals, and the mean seconds from one step's end to the next."""
    from bench_grpo import _totals as grpo_totals

    ends = [
        json.loads(line)["time"] for line in (run / "metrics.jsonl").read_text().splitlines() if "time/step" in line
    ]
    end_to_end = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else float("nan")
    return {**grpo_totals(name, cfg, run, train_s), "end_to_end_s": end_to_end}


def _print_table(rows: list[dict], steps: int, cfg) -> None:
    g = cfg.grpo
    print(
        f"\nGRPO on the Tinker stand-in, SYNTHETIC LATENCIES, {steps} steps of {g.groups_per_step} groups x "
        f"{g.group_size} episodes, load average {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} cores"
    )
    print(
        f"{'variant':<12} {'steps s':>8} {'steps/s':>8} {'ep/s':>6} {'x sync':>7} {'end-to-end s/step':>18} {'train() s':>9}"
    )
    for r in rows:
        print(
            f"{r['variant']:<12} {r['steps_s']:8.1f} {r['steps_per_s']:8.3f} {r['episodes_s']:6.2f} "
            f"{r['steps_per_s'] / rows[0]['steps_per_s']:7.2f} {r['end_to_end_s']:18.1f} {r['train_s']:9.1f}"
        )
    print(json.dumps({"synthetic_latencies": True, "rows": rows}))


if __name__ == "__main__":
    main()
