#!/usr/bin/env python
"""scripts/bench_sandbox.py: oracle episodes per second, tbexp's rollout path against Harbor's trial runner.

    .venv/bin/python scripts/bench_sandbox.py                       # bwrap and docker, concurrency 1,2,4,6,8, 96 episodes a run
    .venv/bin/python scripts/bench_sandbox.py --quick               # concurrency 2,4, 24 episodes a run
    .venv/bin/python scripts/bench_sandbox.py --sandboxes bwrap --concurrency 2,4 --episodes 48 --no-harbor
    .venv/bin/python scripts/bench_sandbox.py --suite --sandboxes bwrap --concurrency 2 --episodes 6  # the suite

For each sandbox and concurrency level it runs the same oracle episodes twice:
through tbexp's `run_episode`/`run_episodes` (exactly what the eval stage
runs), and through Harbor's `Job` (Harbor's oracle agent and verifier) on the
same sandbox via `tbexp.sandboxes.harbor_env`. The two runners alternate per level, so
load from anything else on the machine hits both alike. Episodes are the
built-in held-out tasks, then train tasks spread over the families when more
are asked for, then repeats; every task's sandbox is started once before any
timing (Docker builds the task images then). It prints episodes/s; CPU seconds per episode,
both of its own processes (`cpu_s/ep`, from a cpuacct cgroup it moves into;
bwrap sandboxes count, Docker containers belong to the engine and do not)
and of the whole machine (`all_cpu`, /proc/stat, other users included, with
the load average beside it to judge how busy the machine was); where each
episode's time goes; sandbox start latency; and the targets next to them.
Docker runs only when `tbexp/sandboxes/docker.py` imports and the engine
answers (scripts/start_dockerd.sh and scripts/build_base_image.sh are run
first when present); otherwise a line says why it was skipped.

With `--suite [DIR]` (default tests/conformance) the episodes are the conformance suite's
scored tasks instead, and three rows come first for each runner: the environment build time
cold (the first start of each task's sandbox with TBEXP_CACHE pointing at a fresh, empty
folder and the base root file system kept, one task at a time; Docker keeps its images in the
engine, so there only environments it has not built before are cold), then episodes/s with the
environment cache warm and the verify time per episode, tbexp's rollout path beside Harbor's
`Job` on the same tasks and sandbox. A suite task tbexp cannot load is left out, saying why.

Not a test: nothing fails on a missed target; the numbers are the output.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import io
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # harbor imports litellm, which goes online otherwise
os.environ.setdefault("HARBOR_TELEMETRY", "0")  # a Job reports usage unless told not to
os.environ.setdefault("TQDM_DISABLE", "1")  # run_episodes' progress bar would interleave with the table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))  # run as a file or imported: the suite runner beside it

from conformance import docker_unavailable  # noqa: E402

EPISODES_PER_S_TARGET = {"bwrap": 8.0, "docker": 3.0}
START_P50_TARGET_MS = {"bwrap": 20.0}
HARBOR_RATIO_TARGET = 1.5
PHASES = ("start", "agent", "verify", "stop")
ENVIRONMENTS = {
    "bwrap": "tbexp.sandboxes.harbor_env:BwrapEnvironment",
    "docker": "tbexp.sandboxes.harbor_env:DockerEnvironment",
}


@dataclass
class Run:
    runner: str  # tbexp | harbor
    concurrency: int
    episodes: int
    wall_s: float
    cpu_s: float  # CPU seconds of this process and its children (sandboxes), or NaN where it cannot be told
    machine_cpu_s: float  # busy CPU seconds of the whole machine, other users included
    invalid: int = 0  # could not be scored (sandbox or verifier failure)
    unsolved: int = 0  # scored, but the oracle did not get full marks
    phase_s: dict[str, float] = field(default_factory=dict)  # mean seconds per episode
    start_s: list[float] = field(default_factory=list)  # every episode's start time
    load: float = field(default_factory=lambda: os.getloadavg()[0])  # 1-minute load average when the run ended

    @property
    def per_s(self) -> float:
        return self.episodes / self.wall_s


def main() -> None:
    args = _parse_args()
    if args.suite:
        return _main_suite(args)
    cfg = _compose("bwrap")
    tasks = _pick_tasks(cfg, args.episodes)
    runs = math.ceil(args.episodes / len(tasks))
    jobs = [(task, r) for r in range(runs) for task in tasks]
    print(
        f"tbexp sandbox benchmark: {len(jobs)} oracle episodes a run ({len(tasks)} tasks x {runs}), "
        f"agent={cfg.agent.name}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start"
    )
    for name in args.sandboxes:
        print(f"\n== {name} ==")
        if not _usable(name):
            continue
        _bench_sandbox(name, jobs, tasks, runs, args)


def _usable(name: str) -> bool:
    """Whether the sandbox can be benchmarked here; a line says why not."""
    why_not = docker_unavailable() if name == "docker" else ""
    if why_not:
        print(f"docker skipped: {why_not}")
    return not why_not


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="concurrency 2,4 and 24 episodes a run, unless given")
    parser.add_argument("--concurrency", type=_ints, help="levels to try (default 1,2,4,6,8)")
    parser.add_argument("--episodes", type=int, help="episodes per run (default 96)")
    parser.add_argument("--sandboxes", type=lambda s: s.split(","), default=["bwrap", "docker"])
    parser.add_argument("--no-harbor", dest="harbor", action="store_false", help="skip Harbor's trial runner")
    suite = REPO / "tests" / "conformance"
    parser.add_argument("--suite", nargs="?", const=suite, type=Path, help="bench the conformance suite (DIR)")
    args = parser.parse_args()
    args.concurrency = args.concurrency or ([2, 4] if args.quick else [1, 2, 4, 6, 8])
    args.episodes = args.episodes or (24 if args.quick else 96)
    unknown = set(args.sandboxes) - set(ENVIRONMENTS)
    if unknown:
        parser.error(f"--sandboxes: unknown {sorted(unknown)}; choose from {sorted(ENVIRONMENTS)}")
    return args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _compose(sandbox: str, *overrides: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tbexp.config import register

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose("config", overrides=[f"sandbox={sandbox}", "policy=oracle", *overrides])


def _pick_tasks(cfg, n: int):
    """Held-out tasks first; then train tasks, one family after another in turn, as many as needed."""
    from tbexp.tasks import load_task_set

    tasks = load_task_set(cfg.tasks, split="heldout")
    if n > len(tasks):
        train, rank, seen = load_task_set(cfg.tasks, split="train"), {}, {}
        for task in train:
            rank[task.name] = seen[task.family] = seen.get(task.family, -1) + 1
        tasks += sorted(train, key=lambda t: (rank[t.name], t.family))[: n - len(tasks)]
    return tasks[:n]


def _bench_sandbox(name: str, jobs, tasks, runs: int, args) -> None:
    cfg = _compose(name)
    _warm_up(cfg, tasks)
    _run_tbexp(cfg, jobs[: min(4, len(jobs))], 2)
    if args.harbor:
        _run_harbor(name, cfg, tasks[:2], 1, 2)
    _print_summary(name, _levels(name, cfg, jobs, tasks, runs, args))


def _levels(name: str, cfg, jobs, tasks, runs: int, args) -> list[Run]:
    """One row per runner and concurrency level, the runners alternating, so outside load hits both alike."""
    print(
        f"{'runner':7} {'conc':>4} {'episodes/s':>10} {'wall_s':>7} {'cpu_s/ep':>8} {'all_cpu':>8} {'load':>5} {'invalid':>7} {'unsolved':>8}   "
        + "  ".join(f"{p + '_s':>8}" for p in PHASES)
        + f"  {'other_s':>8}"
    )
    results: list[Run] = []
    for concurrency in args.concurrency:
        results.append(_run_tbexp(cfg, jobs, concurrency))
        _print_row(results[-1])
        if args.harbor:
            results.append(_run_harbor(name, cfg, tasks, runs, concurrency))
            _print_row(results[-1])
    return results


def _warm_up(cfg, tasks) -> None:
    """Start and stop every task's sandbox once, outside the timing: Docker builds the task images here."""
    from concurrent.futures import ThreadPoolExecutor

    from tbexp.sandboxes.base import make_sandbox

    def cycle(task) -> None:
        with make_sandbox(cfg.sandbox, task):
            pass

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(cycle, tasks))


def _run_tbexp(cfg, jobs, concurrency: int) -> Run:
    from tbexp.agents.base import make_agent
    from tbexp.episodes.policies import make_policy
    from tbexp.episodes.rollout import run_episode, run_episodes

    agent = make_agent(cfg.agent)

    def run_one(task, run):  # the eval stage's own run_one
        return run_episode(task, run, agent, lambda t, a: make_policy("oracle", t, a), cfg.sandbox, cfg.agent.max_turns)

    meter = CpuMeter()
    episodes = run_episodes(jobs, concurrency, run_one, desc="bench")
    wall, cpu, machine = meter.read()
    valid = [ep for ep in episodes if not ep.invalid]
    phases = {p: statistics.fmean(ep.time_s.get(p, 0.0) for ep in valid) if valid else math.nan for p in PHASES}
    return Run(
        "tbexp",
        concurrency,
        len(episodes),
        wall,
        cpu,
        machine,
        invalid=len(episodes) - len(valid),
        unsolved=sum(1 for ep in valid if not ep.report.strict),
        phase_s=phases,
        start_s=[ep.time_s["start"] for ep in valid if "start" in ep.time_s],
    )


def _run_harbor(name: str, cfg, tasks, runs: int, concurrency: int) -> Run:
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(cfg.sandbox, resolve=True)
    console = io.StringIO()  # Harbor's progress bar and log lines; shown only when a trial went wrong
    with (
        tempfile.TemporaryDirectory(prefix="tbexp-bench-harbor-") as jobs_dir,
        redirect_stdout(console),
        redirect_stderr(console),
    ):
        meter = CpuMeter()
        trials = asyncio.run(
            _harbor_job(ENVIRONMENTS[name], node, [t.path for t in tasks], runs, concurrency, Path(jobs_dir))
        )
        wall, cpu, machine = meter.read()
    valid = [t for t in trials if t.reward_valid]
    if len(valid) < len(trials):
        print(console.getvalue()[-3000:], file=sys.stderr)
    phases = {
        p: statistics.fmean(_harbor_phases(t)[p] for t in valid) if valid else math.nan for p in (*PHASES, "other")
    }
    return Run(
        "harbor",
        concurrency,
        len(trials),
        wall,
        cpu,
        machine,
        invalid=len(trials) - len(valid),
        unsolved=sum(1 for t in valid if t.verifier_result.rewards.get("reward") != 1.0),
        phase_s=phases,
        start_s=[_harbor_phases(t)["start"] for t in valid],
    )


async def _harbor_job(import_path: str, node: dict, task_dirs: list[Path], runs: int, concurrency: int, jobs_dir: Path):
    from harbor.job import Job
    from harbor.models.job.config import JobConfig
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig

    config = JobConfig(
        job_name=f"bench-{uuid.uuid4().hex[:8]}",
        jobs_dir=jobs_dir,
        n_attempts=runs,
        n_concurrent_trials=concurrency,
        quiet=True,
        agents=[AgentConfig(name="oracle")],
        environment=EnvironmentConfig(import_path=import_path, kwargs={"sandbox": node}),
        tasks=[TaskConfig(path=path) for path in task_dirs],
    )
    job = await Job.create(config)
    result = await job.run()
    return result.trial_results


def _harbor_phases(trial) -> dict[str, float]:
    """Harbor's timing records mapped onto tbexp's phases; `stop` is from the verifier's end to the trial's."""

    def span(timing) -> float:
        return (timing.finished_at - timing.started_at).total_seconds() if timing and timing.finished_at else 0.0

    total = (trial.finished_at - trial.started_at).total_seconds()
    phases = {
        "start": span(trial.environment_setup),
        "agent": span(trial.agent_execution),
        "verify": span(trial.verifier),
    }
    phases["stop"] = (trial.finished_at - trial.verifier.finished_at).total_seconds() if trial.verifier else 0.0
    phases["other"] = total - sum(phases.values())  # agent setup, log and artifact transfers
    return phases


class CpuMeter:
    """Wall time and CPU time from its creation to `read()`.

    Own CPU comes from a cpuacct cgroup this process moves into at the first
    use (children, bwrap sandboxes included, inherit it; Docker containers do
    not, they belong to the engine), so other users of the machine do not
    count. Machine CPU is all busy time in /proc/stat.
    """

    group: Path | None = None
    tried = False

    def __init__(self):
        self._join_cgroup()
        self.start = (time.perf_counter(), self._own(), _machine_cpu_s())

    def read(self) -> tuple[float, float, float]:
        wall, own, machine = self.start
        return time.perf_counter() - wall, self._own() - own, _machine_cpu_s() - machine

    def _own(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9 if self.group else math.nan

    @classmethod
    def _join_cgroup(cls) -> None:
        if cls.tried:
            return
        cls.tried = True
        root = Path("/sys/fs/cgroup/cpuacct")
        group = root / f"tbexp-bench-{os.getpid()}"
        try:
            group.mkdir()
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            return
        cls.group = group

        def leave() -> None:  # children still alive (the Docker sandbox's watchdog) leave with us
            try:
                for pid in [os.getpid(), *(group / "cgroup.procs").read_text().split()]:
                    (root / "cgroup.procs").write_text(str(pid))
                group.rmdir()
            except OSError:
                pass

        atexit.register(leave)


def _machine_cpu_s() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _print_row(run: Run) -> None:
    phases = "  ".join(f"{run.phase_s.get(p, math.nan):8.3f}" for p in PHASES)
    other = f"{run.phase_s['other']:8.3f}" if "other" in run.phase_s else f"{'':8}"
    print(
        f"{run.runner:7} {run.concurrency:4d} {run.per_s:10.2f} {run.wall_s:7.1f} {run.cpu_s / run.episodes:8.3f} {run.machine_cpu_s / run.episodes:8.3f} {run.load:5.1f} "
        f"{run.invalid:7d} {run.unsolved:8d}   {phases}  {other}",
        flush=True,
    )


def _print_summary(name: str, results: list[Run]) -> None:
    tbexp = max((r for r in results if r.runner == "tbexp"), key=lambda r: r.per_s)
    target = EPISODES_PER_S_TARGET[name]
    print(
        f"\nbest tbexp: {tbexp.per_s:.2f} episodes/s at concurrency {tbexp.concurrency}  (target >= {target:g}: {_verdict(tbexp.per_s >= target)})"
    )
    for label, run in (("concurrency 1", _at(results, "tbexp", 1)), (f"concurrency {tbexp.concurrency}", tbexp)):
        if run and run.start_s:
            p50, p95 = _percentile(run.start_s, 50) * 1000, _percentile(run.start_s, 95) * 1000
            goal = START_P50_TARGET_MS.get(name)
            verdict = f"  (target p50 < {goal:g} ms: {_verdict(p50 < goal)})" if goal else ""
            print(f"sandbox start at {label}: p50 {p50:.1f} ms, p95 {p95:.1f} ms{verdict}")
    total = sum(tbexp.phase_s.values())
    if total:
        shares = ", ".join(f"{p} {tbexp.phase_s[p] * 1000:.0f} ms ({tbexp.phase_s[p] / total:.0%})" for p in PHASES)
        print(f"where a tbexp episode's time goes at concurrency {tbexp.concurrency}: {shares}")
    own = tbexp.cpu_s / tbexp.episodes
    if name == "bwrap" and not math.isnan(
        own
    ):  # bwrap sandboxes are our children (Docker's are the engine's); NaN: no cgroup
        print(
            f"tbexp CPU per episode: {own * 1000:.0f} ms of this benchmark's own processes, so {os.cpu_count()} CPUs to itself would cap it near {os.cpu_count() / own:.1f} episodes/s"
        )
    harbor = [r for r in results if r.runner == "harbor"]
    if harbor:
        best = max(harbor, key=lambda r: r.per_s)
        ratio = tbexp.per_s / best.per_s
        print(
            f"best harbor: {best.per_s:.2f} episodes/s at concurrency {best.concurrency} (Harbor Job, oracle agent, same {name} sandbox)"
        )
        print(
            f"tbexp / harbor: {ratio:.2f}x  (target >= {HARBOR_RATIO_TARGET:g}x: {_verdict(ratio >= HARBOR_RATIO_TARGET)})"
        )
        if name == "bwrap" and not math.isnan(own):
            cpu = statistics.fmean(r.cpu_s / r.episodes for r in harbor) / statistics.fmean(
                r.cpu_s / r.episodes for r in results if r.runner == "tbexp"
            )
            print(
                f"CPU per episode, harbor / tbexp: {cpu:.2f}x over all levels (the throughput ratio on a machine the benchmark has to itself, once CPU-bound)"
            )
    _warn_unsolved(results)


def _warn_unsolved(results: list[Run]) -> None:
    bad = [r for r in results if r.invalid or r.unsolved]
    if bad:
        print(
            "warning: some oracle episodes were invalid or unsolved: "
            + ", ".join(f"{r.runner}@{r.concurrency}: {r.invalid} invalid, {r.unsolved} unsolved" for r in bad)
        )


def _at(results: list[Run], runner: str, concurrency: int) -> Run | None:
    return next((r for r in results if r.runner == runner and r.concurrency == concurrency), None)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# ---------------------------------------------------------------- the conformance suite's rows


def _main_suite(args) -> None:
    tasks = _suite_tasks(args.suite)
    if not tasks:
        print(f"{args.suite}: no scored task that tbexp loads; nothing to bench")
        return
    runs = math.ceil(args.episodes / len(tasks))
    print(
        f"conformance suite benchmark: {len(tasks)} scored tasks of {args.suite}, {len(tasks) * runs} oracle episodes "
        f"a run, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start"
    )
    for name in args.sandboxes:
        print(f"\n== {name}: conformance suite ==")
        if not _usable(name):
            continue
        tasks = _suite_tasks(args.suite, name)  # a task one sandbox cannot run by design (compose in bwrap) is left out
        runs = math.ceil(args.episodes / len(tasks))
        rootfs = _compose(name).sandbox.rootfs
        cold = {"tbexp": _cold_builds(name, tasks, rootfs, harbor=False)}
        if args.harbor:
            cold["harbor"] = _cold_builds(name, tasks, rootfs, harbor=True)
        for runner, seconds in cold.items():
            print(f"{runner:7} environment build, cold: {_cold_text(seconds, len(tasks))}")
        cfg = _compose(name)
        _warm_up(cfg, tasks)
        jobs = [(task, r) for r in range(runs) for task in tasks]
        results = _levels(name, cfg, jobs, tasks, runs, args)
        for runner in ("tbexp", "harbor"):
            mine = [r for r in results if r.runner == runner]
            if mine:
                best = max(mine, key=lambda r: r.per_s)
                verify_ms = statistics.fmean(r.phase_s["verify"] for r in mine) * 1000
                print(
                    f"{runner:7} warm: best {best.per_s:.2f} episodes/s at concurrency {best.concurrency}, "
                    f"verify {verify_ms:.0f} ms an episode (mean over levels)"
                )
        _warn_unsolved(results)


def _suite_tasks(root: Path, sandbox: str = ""):
    """The suite's tasks expected to be scored (in `sandbox`, where given) that tbexp loads; the others are named."""
    from conformance import load_suite

    from tbexp.tasks import TaskError, load_task

    tasks = []
    for e in load_suite(root):
        if (e.in_sandbox(sandbox) if sandbox else e).expect != "scored":
            continue
        try:
            tasks.append(load_task(e.path))
        except TaskError as err:
            print(f"suite: {e.name} left out: {err}")
    return tasks


def _cold_builds(name: str, tasks, rootfs: str, harbor: bool) -> dict[str, float | str]:
    """Seconds of each task's first sandbox start (or why it failed), with a fresh, empty TBEXP_CACHE.

    One task at a time, so each time is that environment's alone; a task whose environment an
    earlier task already built is quick, as it is in a real run. Harbor's times are its trials'
    environment set-up spans (a whole oracle trial runs, but only that span is counted).
    """
    from tbexp.sandboxes.base import make_sandbox

    before = os.environ.get("TBEXP_CACHE")
    with tempfile.TemporaryDirectory(prefix="tbexp-bench-cold-") as cache:
        os.environ["TBEXP_CACHE"] = cache
        try:
            cfg = _compose(name, f"sandbox.rootfs={rootfs}")  # only the base root is kept warm
            if harbor:
                return _harbor_cold(name, cfg, tasks)
            seconds: dict[str, float | str] = {}
            for task in tasks:
                start = time.perf_counter()
                try:
                    with make_sandbox(cfg.sandbox, task):
                        pass
                    seconds[task.name] = time.perf_counter() - start
                except Exception as err:  # a task whose environment cannot be built is reported, not fatal
                    seconds[task.name] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            return seconds
        finally:
            if before is None:
                os.environ.pop("TBEXP_CACHE", None)
            else:
                os.environ["TBEXP_CACHE"] = before


def _harbor_cold(name: str, cfg, tasks) -> dict[str, float | str]:
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(cfg.sandbox, resolve=True)
    console = io.StringIO()
    with (
        tempfile.TemporaryDirectory(prefix="tbexp-bench-harbor-") as jobs_dir,
        redirect_stdout(console),
        redirect_stderr(console),
    ):
        trials = asyncio.run(_harbor_job(ENVIRONMENTS[name], node, [t.path for t in tasks], 1, 1, Path(jobs_dir)))
    seconds: dict[str, float | str] = {}
    for trial in trials:
        failed = trial.exception_info and trial.environment_setup is None
        seconds[trial.task_name] = trial.exception_info.exception_type if failed else _harbor_phases(trial)["start"]
    return seconds


def _cold_text(seconds: dict[str, float | str], n_tasks: int) -> str:
    times = [v for v in seconds.values() if isinstance(v, float)]
    failed = [f"{k} ({v})" for k, v in seconds.items() if not isinstance(v, float)]
    text = f"{sum(times):.1f} s for {len(times)} of {n_tasks} tasks" if times else f"none of {n_tasks} tasks started"
    if times:
        text += f" (slowest {max(times):.1f} s, median {statistics.median(times):.2f} s)"
    return text + (f"; failed: {', '.join(failed)}" if failed else "")


if __name__ == "__main__":
    main()
