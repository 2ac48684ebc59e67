#!/usr/bin/env python
"""scripts/conformance.py: the conformance suite, each task scored by tbexp's eval stage and by Harbor's trial runner.

    .venv/bin/python scripts/conformance.py                           # every task under tests/conformance, in bwrap
    .venv/bin/python scripts/conformance.py --sandboxes bwrap,docker --harbor
    .venv/bin/python scripts/conformance.py --only basic-reward-txt,basic-partial-credit --out /tmp/conf

Every task directory of the suite holds a `conformance.toml` beside its task.toml (task.yaml for
Terminal-Bench 1) saying which published convention it exercises and what must come out:

    convention = "RUN apt-get install"  # the published convention it exercises
    expect = "scored"                   # scored | unrunnable (e.g. a build that fails)
    oracle_reward = 1.0                 # per-test reward the oracle must get (needed when scored)
    nop_reward = 0.0                    # per-test reward the do-nothing policy gets
    unrunnable_reason = "build failed"  # optional, with expect = "unrunnable": a regex the reason must match
    harbor_reward = 0.0  # optional, with expect = "unrunnable": Harbor's runner scores it (both policies), tbexp not
    unrunnable_in = ["bwrap"]           # optional, with expect = "scored": unrunnable in these sandboxes (the reason
                                        # matching unrunnable_reason), scored in the others

tbexp's numbers come from its own eval stage, run as a user runs it
(`python -m tbexp stage=eval tasks=dir eval.candidates=[oracle,nop] sandbox=…`, one run per
sandbox over the whole suite, from each candidate's `tasks.csv` and episode records), so they are what a user
would see, not a re-implementation. When such a run cannot finish (a task that cannot be
loaded may abort the set), it runs again without the task its error names, or else task by
task, so the rest still get numbers. A task
the stage could not load, or whose every episode is invalid, counts as *unrunnable*, with the
reason. With `--harbor`, Harbor's own `Trial` (its `oracle` and `nop` agents, its verifier) runs
the same tasks on the same sandboxes through `tbexp.sandboxes.harbor_env`; its per-test fraction is read
from the verifier logs Harbor downloaded, its own reward is shown beside it. Terminal-Bench 1
directories are converted for Harbor with Harbor's own mapper first.

The table has a row per task and sandbox, each cell `expected / got`; the last line counts the
expectations that held. The table is also written as `conformance.md` and `conformance.json`
under --out. Exit status: 0 all held, 1 one failed, 2 bad input (a conformance.toml, --only).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / "tests" / "conformance"
SANDBOXES = ("bwrap", "docker")
POLICIES = ("oracle", "nop")
EXPECTS = ("scored", "unrunnable")
REWARD_TOLERANCE = 0.005  # "0.333" in a conformance.toml means 1/3
RUN_TIMEOUT_S = 3600.0  # one eval-stage run over the suite; every task's own time-outs apply inside it
UNRUNNABLE = "unrunnable"


class ConformanceError(ValueError):
    """A suite directory or conformance.toml that cannot be used; the message names the file and key."""


@dataclass(frozen=True)
class Expectation:
    name: str  # the task's directory name
    path: Path
    convention: str
    expect: str  # scored | unrunnable
    oracle_reward: float | None = None
    nop_reward: float | None = None
    unrunnable_reason: str = ""  # a regex (case-insensitive) the reason must match; "" = any reason
    # where tbexp's verdict differs from Harbor's on purpose: what Harbor's runner gives both policies (a verifier
    # that ran no test is a valid 0 to Harbor, an infrastructure failure to tbexp); None = unrunnable there too
    harbor_reward: float | None = None
    unrunnable_in: tuple[str, ...] = ()  # sandboxes where a scored task must be unrunnable (a compose task in bwrap)

    def in_sandbox(self, sandbox: str) -> Expectation:
        """What must come out in `sandbox`: unrunnable there where `unrunnable_in` names it."""
        if sandbox not in self.unrunnable_in:
            return self
        return replace(self, expect=UNRUNNABLE, oracle_reward=None, nop_reward=None, unrunnable_in=())

    @property
    def oracle_strict(self) -> float | None:
        return None if self.oracle_reward is None else float(self.oracle_reward >= 1.0)


@dataclass
class Score:
    """One policy's result on one task: per-test fraction and strict success, or why it could not be scored."""

    unrunnable: str = ""  # the reason; "" when scored
    per_test: float = math.nan
    strict: float = math.nan
    rewards: dict[str, float] = field(default_factory=dict)  # the task's own reward file, where the runner gives it

    def cell(self, expected: float | None) -> str:
        got = UNRUNNABLE if self.unrunnable else f"{self.per_test:.3f}"
        return f"{'-' if expected is None else f'{expected:.3f}'} / {got}"


# ---------------------------------------------------------------- the suite and its conformance.toml files


def read_expectation(task_dir: Path) -> Expectation:
    """`task_dir/conformance.toml`, checked: unknown keys, missing fields and bad values name the file."""
    path = task_dir / "conformance.toml"
    if not path.is_file():
        raise ConformanceError(f"{path}: missing (every conformance task says what it exercises and expects)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConformanceError(f"{path}: broken TOML: {err}") from err
    known = {
        "convention",
        "expect",
        "oracle_reward",
        "nop_reward",
        "unrunnable_reason",
        "harbor_reward",
        "unrunnable_in",
    }
    if unknown := sorted(set(data) - known):
        raise ConformanceError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    for key in ("convention", "expect"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise ConformanceError(f"{path}: {key} is missing or not a non-empty string")
    if data["expect"] not in EXPECTS:
        raise ConformanceError(f"{path}: expect = {data['expect']!r}; choose one of {list(EXPECTS)}")
    rewards = {}
    for key in ("oracle_reward", "nop_reward"):
        value = data.get(key)
        if value is None and data["expect"] == "scored":
            raise ConformanceError(f'{path}: {key} is missing (needed when expect = "scored")')
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1
        ):
            raise ConformanceError(f"{path}: {key} = {value!r}; must be a number in [0, 1]")
        rewards[key] = None if value is None else float(value)
    reason = data.get("unrunnable_reason", "")
    unrunnable_in = data.get("unrunnable_in", [])
    if not isinstance(unrunnable_in, list) or not set(unrunnable_in) <= set(SANDBOXES):
        raise ConformanceError(f"{path}: unrunnable_in = {unrunnable_in!r}; a list of sandboxes from {list(SANDBOXES)}")
    if unrunnable_in and data["expect"] != "scored":
        raise ConformanceError(f'{path}: unrunnable_in is only for expect = "scored"')
    if reason and data["expect"] != UNRUNNABLE and not unrunnable_in:
        raise ConformanceError(f'{path}: unrunnable_reason is only for expect = "unrunnable" (or with unrunnable_in)')
    harbor = data.get("harbor_reward")
    if harbor is not None and (
        data["expect"] != UNRUNNABLE
        or isinstance(harbor, bool)
        or not isinstance(harbor, (int, float))
        or not 0 <= harbor <= 1
    ):
        raise ConformanceError(
            f'{path}: harbor_reward = {harbor!r}: a number in [0, 1], only for expect = "unrunnable"'
        )
    try:
        re.compile(reason)
    except (re.error, TypeError) as err:
        raise ConformanceError(f"{path}: unrunnable_reason = {reason!r}: not a regular expression ({err})") from err
    if not any((task_dir / name).is_file() for name in ("task.toml", "task.yaml")):
        raise ConformanceError(f"{task_dir}: holds conformance.toml but neither task.toml nor task.yaml")
    return Expectation(
        task_dir.name,
        task_dir.resolve(),
        data["convention"].strip(),
        data["expect"],
        **rewards,
        unrunnable_reason=reason,
        harbor_reward=None if harbor is None else float(harbor),
        unrunnable_in=tuple(unrunnable_in),
    )


def load_suite(root: Path, only: list[str] | None = None) -> list[Expectation]:
    """Every task directory under `root` (each must have a valid conformance.toml), or the `only` ones."""
    if not root.is_dir():
        raise ConformanceError(f"{root}: no such suite directory")
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    if only:
        if missing := sorted(set(only) - {d.name for d in dirs}):
            raise ConformanceError(f"--only: no task {missing} under {root}; have {[d.name for d in dirs]}")
        dirs = [d for d in dirs if d.name in only]
    if not dirs:
        raise ConformanceError(f"{root}: holds no task directories")
    return [read_expectation(d) for d in dirs]


def task_names(expectation: Expectation) -> set[str]:
    """The names the eval stage may give the task: task.toml's [task].name, the directory's name."""
    names = {expectation.name}
    toml = expectation.path / "task.toml"
    if toml.is_file():
        try:
            names.add(str(tomllib.loads(toml.read_text()).get("task", {}).get("name", expectation.name)))
        except tomllib.TOMLDecodeError:
            pass  # the eval stage reports a broken task.toml as the reason it is unrunnable
    return names


# ---------------------------------------------------------------- tbexp: its own eval stage


def run_tbexp(
    suite: list[Expectation], sandbox: str, out: Path, overrides: list[str], concurrency: int
) -> dict[tuple[str, str], Score]:
    """{(task, policy): Score} for the oracle and nop, from one eval-stage run over the whole suite.

    Both policies are the eval stage's candidates (`eval.candidates=[oracle,nop]`), so one process
    scores both. A run that stops before its tables (today one task that cannot be loaded ends
    the set) is run again without the task its error names, that task being unrunnable for that
    reason; an error that names no task makes each task run on its own.
    """
    scores: dict[tuple[str, str], Score] = {}
    left = list(suite)
    while left:
        dataset = _dataset(out / "datasets" / sandbox, left)
        run = out / "runs" / sandbox
        done = _eval_stage(dataset, run, sandbox, overrides, concurrency)
        if all(_tables(run).values()):
            return {**scores, **_scores_from_run(left, run, done)}
        error = _last_error(done)
        culprit = next(
            (e for e in left if f"{dataset}/{e.name}/" in error or error.rstrip(":").endswith(f"{dataset}/{e.name}")),
            None,
        )
        if culprit is None:
            break
        print(f"  {sandbox}: the run stopped at {culprit.name} ({error}); the rest run again", flush=True)
        scores.update({(culprit.name, policy): Score(unrunnable=error) for policy in POLICIES})
        left.remove(culprit)
    if not left:
        return scores
    print(f"  {sandbox}: the run stopped ({_last_error(done)}); running each task on its own", flush=True)
    for e in left:
        one = out / "runs" / f"{sandbox}-{e.name}"
        alone = _eval_stage(
            _dataset(out / "datasets" / f"{sandbox}-{e.name}", [e]), one, sandbox, overrides, concurrency
        )
        scores.update(_scores_from_run([e], one, alone))
    return scores


def _dataset(folder: Path, suite: list[Expectation]) -> Path:
    """A dataset folder of links to the chosen task directories (the suite folder itself holds other tasks)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for e in suite:
        (folder / e.name).symlink_to(e.path, target_is_directory=True)
    return folder


def _eval_stage(
    dataset: Path, run: Path, sandbox: str, overrides: list[str], concurrency: int
) -> subprocess.CompletedProcess:
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    argv = [
        sys.executable, "-m", "tbexp", "stage=eval", f"eval.candidates=[{','.join(POLICIES)}]", "tasks=dir",
        f"tasks.path={dataset}", f"sandbox={sandbox}", "eval.n_runs=1", f"eval.concurrency={concurrency}",
        "eval.save_episodes=100000", "logger=none", f"hydra.run.dir={run}", *overrides,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    env.setdefault("TQDM_DISABLE", "1")
    try:
        done = subprocess.run(
            argv, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as err:
        done = subprocess.CompletedProcess(
            argv, 124, err.stdout or "", f"{err.stderr or ''}\ntimed out after {RUN_TIMEOUT_S:g} s"
        )
    (run / "stage.log").write_text(f"$ {' '.join(argv)}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def _tables(run: Path) -> dict[str, Path | None]:
    """Each policy's folder of the run (`candidates/NN-<policy>/`, holding tasks.csv), or None where it is missing."""
    found = {}
    for policy in POLICIES:
        folders = sorted(run.glob(f"candidates/*-{policy}"))
        found[policy] = folders[0] if folders and (folders[0] / "tasks.csv").is_file() else None
    return found


def _scores_from_run(
    suite: list[Expectation], run: Path, done: subprocess.CompletedProcess
) -> dict[tuple[str, str], Score]:
    scores = {}
    for policy, folder in _tables(run).items():
        rows = {r["task"]: r for r in csv.DictReader((folder / "tasks.csv").open())} if folder else {}
        invalid = _invalid_reasons(folder / "episodes") if folder else {}
        for e in suite:
            scores[(e.name, policy)] = _score(e, rows, invalid, done)
    return scores


def _score(e: Expectation, rows: dict[str, dict], invalid: dict[str, str], done: subprocess.CompletedProcess) -> Score:
    name = next((n for n in task_names(e) if n in rows), None)
    if name is None:
        return Score(unrunnable=_why_missing(e, done))
    row = rows[name]
    runs, n_invalid = int(row["runs"]), int(row["invalid"])
    if n_invalid == runs:
        return Score(unrunnable=invalid.get(name, "every episode invalid"))
    if n_invalid:  # scored on the valid runs, but an invalid episode of a scorable task is a failure too
        return Score(unrunnable=f"{n_invalid} of {runs} episodes invalid: {invalid.get(name, '?')}")
    return Score(per_test=float(row["reward"]), strict=int(row["strict"]) / runs)


def _invalid_reasons(episodes: Path) -> dict[str, str]:
    reasons = {}
    for path in sorted(episodes.glob("*.json")) if episodes.is_dir() else []:
        record = json.loads(path.read_text())
        if record.get("invalid"):
            reasons[record["task"]] = record["invalid"].strip().splitlines()[0][:300]
    return reasons


def _why_missing(e: Expectation, done: subprocess.CompletedProcess) -> str:
    """A task the run did not score: the run's own words about it, else its last error."""
    lines = (done.stdout + "\n" + done.stderr).splitlines()
    about = [line.strip() for line in lines if any(n in line for n in task_names(e) | {str(e.path)})]
    return (about[-1] if about else f"not in the eval stage's tasks.csv ({_last_error(done)})")[:300]


def _last_error(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in (done.stdout + "\n" + done.stderr).splitlines() if line.strip()]
    tbexp = [line for line in lines if line.startswith("tbexp: ")]
    return (tbexp or lines or [f"exit {done.returncode}"])[-1][:300]


# ---------------------------------------------------------------- Harbor's trial runner on tbexp's sandboxes

HARBOR_ENVIRONMENTS = {
    "bwrap": "tbexp.sandboxes.harbor_env:BwrapEnvironment",
    "docker": "tbexp.sandboxes.harbor_env:DockerEnvironment",
}


def run_harbor(
    suite: list[Expectation], sandbox: str, node: dict, out: Path, concurrency: int
) -> dict[tuple[str, str], Score]:
    """Harbor's Trial with its oracle and nop agents on every task: {(task, policy): Score}."""
    import asyncio

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # harbor imports litellm, which goes online otherwise
    os.environ.setdefault("HARBOR_TELEMETRY", "0")
    trials = out / "harbor" / sandbox
    if trials.exists():
        shutil.rmtree(trials)
    trials.mkdir(parents=True)
    jobs = [(e, policy) for e in suite for policy in POLICIES]
    task_dirs = {e.name: _harbor_task_dir(e, out / "harbor" / "tasks") for e in suite}  # once: both agents share it

    async def all_trials():
        gate = asyncio.Semaphore(concurrency)
        return await asyncio.gather(
            *(_harbor_trial(task_dirs[e.name], policy, sandbox, node, trials, gate) for e, policy in jobs)
        )

    return {(e.name, policy): score for (e, policy), score in zip(jobs, asyncio.run(all_trials()))}


async def _harbor_trial(task_dir: Path | Score, policy: str, sandbox: str, node: dict, trials: Path, gate) -> Score:
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
    from harbor.trial.trial import Trial

    if isinstance(task_dir, Score):
        return task_dir  # Harbor's mapper refused it
    try:
        config = TrialConfig(
            task=TaskConfig(path=task_dir),
            agent=AgentConfig(name=policy),
            environment=EnvironmentConfig(import_path=HARBOR_ENVIRONMENTS[sandbox], kwargs={"sandbox": node}),
            trials_dir=trials / policy,
        )
        async with gate:
            result = await (await Trial.create(config)).run()
    except Exception as err:  # Harbor refusing the task (its model, the environment's checks) is its verdict on it
        return _refused(err)
    return harbor_score(result, trials / policy / result.trial_name)


def _refused(err: Exception) -> Score:
    message = str(err).strip()
    return Score(unrunnable=f"{type(err).__name__}: {message.splitlines()[0] if message else ''}"[:300])


def _harbor_task_dir(e: Expectation, converted: Path) -> Path | Score:
    """The task as Harbor reads it: a Terminal-Bench 1 directory goes through Harbor's own mapper first."""
    if (e.path / "task.toml").is_file() or not (e.path / "task.yaml").is_file():
        return e.path
    from harbor.mappers.terminal_bench import TerminalBenchMapper

    target = converted / e.name
    if target.exists():
        shutil.rmtree(target)
    converted.mkdir(parents=True, exist_ok=True)
    from harbor.models.task.config import NetworkMode

    # Terminal-Bench 1 never said whether a task needs the network (Harbor maps it to "public"); tbexp's
    # sandboxes have none, and tbexp.sandboxes.harbor_env refuses tasks that ask for it, so the copy says no-network.
    mapper = TerminalBenchMapper(environment_overrides={"network_mode": NetworkMode.NO_NETWORK})
    try:
        return mapper._map_task(e.path, target)  # what `harbor tasks migrate` runs for each task
    except Exception as err:  # the mapper refusing a directory is Harbor's verdict on it
        return _refused(err)


def harbor_score(result, trial_dir: Path) -> Score:
    """Harbor's own reward, and the per-test fraction of the verifier logs it downloaded (as tbexp reads them)."""
    from tbexp.episodes.verifier import VerifierError, read_results

    failures = [x for x in result.recorded_exceptions() if x is not None]
    if not result.reward_valid:
        why = failures[0] if failures else None
        return Score(
            unrunnable=f"{why.exception_type}: {why.exception_message.strip()[:250]}" if why else "no valid reward"
        )
    logs = (
        [trial_dir / "verifier"]
        if (trial_dir / "verifier").is_dir() and any((trial_dir / "verifier").iterdir())
        else []
    )
    logs = logs or sorted(trial_dir.glob("steps/*/verifier"))  # a multi-step trial keeps each step's logs apart
    try:
        reports = [read_results(d, result.task_name) for d in logs]
    except VerifierError as err:
        return Score(unrunnable=f"Harbor's verifier logs: {err}"[:300], rewards=dict(result.verifier_result.rewards))
    if not reports:
        return Score(unrunnable=f"no verifier logs under {trial_dir}", rewards=dict(result.verifier_result.rewards))
    per_test = sum(r.fraction_passed for r in reports) / len(reports)
    strict = float(all(r.strict for r in reports))
    return Score(per_test=per_test, strict=strict, rewards=dict(result.verifier_result.rewards))


# ---------------------------------------------------------------- expectations, table, files


@dataclass
class Row:
    task: str
    convention: str
    sandbox: str
    expect: str
    scores: dict[str, Score]  # "oracle", "nop", "harbor-oracle", "harbor-nop"
    failures: list[str] = field(default_factory=list)
    checks: int = 0


def check_row(e: Expectation, sandbox: str, scores: dict[str, Score]) -> Row:
    """Each of the row's expectations, held or not; the failures name what was expected and what came."""
    e = e.in_sandbox(sandbox)
    row = Row(e.name, e.convention, sandbox, e.expect, scores)
    for key, score in scores.items():
        policy = key.removeprefix("harbor-")
        who = f"{'Harbor' if key.startswith('harbor') else 'tbexp'} {policy}"
        if e.expect == UNRUNNABLE and key.startswith("harbor") and e.harbor_reward is not None:
            if score.unrunnable:
                row.checks += 1
                row.failures.append(
                    f"{who}: expected scored {e.harbor_reward:.3f} by Harbor, got unrunnable: {score.unrunnable}"
                )
            else:
                _expect_close(row, f"{who} per-test", e.harbor_reward, score.per_test)
            continue
        if e.expect == UNRUNNABLE:
            row.checks += 1
            if not score.unrunnable:
                row.failures.append(f"{who}: expected unrunnable, got scored (per-test {score.per_test:.3f})")
            elif not re.search(e.unrunnable_reason, score.unrunnable, re.IGNORECASE):
                row.failures.append(f"{who}: unrunnable, but not for /{e.unrunnable_reason}/: {score.unrunnable}")
            continue
        if score.unrunnable:
            row.checks += 1 + (policy == "oracle")
            row.failures.append(f"{who}: expected scored, got unrunnable: {score.unrunnable}")
            continue
        expected = e.oracle_reward if policy == "oracle" else e.nop_reward
        _expect_close(row, f"{who} per-test", expected, score.per_test)
        if policy == "oracle":
            _expect_close(row, f"{who} strict", e.oracle_strict, score.strict)
    return row


def _expect_close(row: Row, what: str, expected: float, got: float) -> None:
    row.checks += 1
    if not abs(expected - got) <= REWARD_TOLERANCE:  # NaN fails too
        row.failures.append(f"{what}: expected {expected:.3f}, got {got:.3f}")


def table(rows: list[Row], suite: dict[str, Expectation]) -> list[list[str]]:
    head = ["task", "convention", "sandbox", "expect", "oracle strict", "oracle per-test", "nop per-test"]
    harbor = any("harbor-oracle" in r.scores for r in rows)
    head += ["Harbor oracle", "Harbor nop"] if harbor else []
    lines = [[*head, "verdict"]]
    for r in rows:
        e, s = suite[r.task].in_sandbox(r.sandbox), r.scores
        oracle = s["oracle"]
        expected_strict = "-" if e.oracle_strict is None else f"{e.oracle_strict:.0f}"
        strict = f"{expected_strict} / {UNRUNNABLE if oracle.unrunnable else f'{oracle.strict:.0f}'}"
        cells = [
            r.task,
            r.convention,
            r.sandbox,
            r.expect,
            strict,
            oracle.cell(e.oracle_reward),
            s["nop"].cell(e.nop_reward),
        ]
        for policy in POLICIES if harbor else ():
            score = s[f"harbor-{policy}"]
            own = f" (reward {_rewards(score.rewards)})" if score.rewards and not score.unrunnable else ""
            cells.append(score.cell(e.oracle_reward if policy == "oracle" else e.nop_reward) + own)
        lines.append([*cells, "ok" if not r.failures else f"FAIL ({len(r.failures)})"])
    return lines


def _rewards(rewards: dict[str, float]) -> str:
    return ", ".join(f"{v:g}" if k == "reward" else f"{k}={v:g}" for k, v in rewards.items())


def render_text(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join([text[0], "-" * len(text[0]), *text[1:]])


def render_markdown(lines: list[list[str]]) -> str:
    cells = [[c.replace("|", "\\|") for c in line] for line in lines]
    return "\n".join(
        [
            "| " + " | ".join(cells[0]) + " |",
            "|" + "---|" * len(cells[0]),
            *("| " + " | ".join(c) + " |" for c in cells[1:]),
        ]
    )


def failure_lines(rows: list[Row]) -> list[str]:
    return [f"{r.task} ({r.sandbox}): {f}" for r in rows for f in r.failures]


def reason_lines(rows: list[Row]) -> list[str]:
    """Why each expected-unrunnable task was unrunnable: a reader checks it is the reason meant."""
    return [
        f"{r.task} ({r.sandbox}) {key}: {s.unrunnable}"
        for r in rows
        if r.expect == UNRUNNABLE
        for key, s in r.scores.items()
        if s.unrunnable
    ]


def summary_line(rows: list[Row], skipped: dict[str, str]) -> str:
    failed = sum(len(r.failures) for r in rows)
    passed = sum(r.checks for r in rows) - failed
    bad_rows = sum(1 for r in rows if r.failures)
    line = f"{passed} passed, {failed} failed ({len(rows) - bad_rows} of {len(rows)} task x sandbox rows hold)"
    return line + "".join(f"; {name} skipped: {why}" for name, why in skipped.items())


def write_report(out: Path, rows: list[Row], lines: list[list[str]], skipped: dict[str, str], summary: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    md = ["# Conformance suite", "", "Each cell: expected / got.", "", render_markdown(lines), "", summary, ""]
    for title, items in (("Failures", failure_lines(rows)), ("Expected unrunnable: the reasons", reason_lines(rows))):
        md += [f"## {title}", "", *(f"* {item}" for item in items), ""] if items else []
    (out / "conformance.md").write_text("\n".join(md))
    record = {
        "summary": summary,
        "skipped": skipped,
        "rows": [
            {
                **{k: v for k, v in asdict(r).items() if k != "scores"},
                "scores": {k: asdict(s) for k, s in r.scores.items()},
            }
            for r in rows
        ],
    }
    (out / "conformance.json").write_text(json.dumps(_without_nan(record), indent=1, default=str) + "\n")


def _without_nan(value):
    """JSON has no NaN: a number that is not there (unrunnable) is written as null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _without_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_nan(v) for v in value]
    return value


# ---------------------------------------------------------------- sandboxes, and the command line


def sandbox_node(sandbox: str, overrides: list[str]) -> dict:
    """The composed `sandbox` node (what the eval stage gets), for Harbor's environments and availability checks."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from tbexp.config import register

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"sandbox={sandbox}", *(o for o in overrides if o.startswith("sandbox."))])
    return OmegaConf.to_container(cfg.sandbox, resolve=True)


def sandbox_unavailable(sandbox: str, node: dict) -> str:
    """Why `sandbox` cannot run here ('' when it can); the Docker engine is started if it is installable."""
    if sandbox == "bwrap":
        if shutil.which("bwrap") is None:
            return "bwrap is not installed (apt-get install bubblewrap)"
        if not (Path(node["rootfs"]) / "usr/bin/python3").exists():
            return f"no root file system at {node['rootfs']} (scripts/build_rootfs.sh builds it)"
        return ""
    return docker_unavailable()


def docker_unavailable() -> str:
    """Why the Docker engine cannot be used here, or "" when it can (start_dockerd.sh, build_base_image.sh first)."""
    try:
        import tbexp.sandboxes.docker  # noqa: F401
    except ImportError as err:
        return f"tbexp.sandboxes.docker cannot be imported ({err})"
    for script in ("start_dockerd.sh", "build_base_image.sh"):
        path = REPO / "scripts" / script
        if path.exists():
            done = subprocess.run(["bash", str(path)], check=False, capture_output=True, text=True)
            if done.returncode != 0:
                return f"scripts/{script} failed: {done.stderr.strip()[-300:]}"
    try:
        answer = subprocess.run(["docker", "info"], check=False, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"the Docker engine does not answer ({err})"
    if answer.returncode != 0:
        return f"the Docker engine does not answer: {answer.stderr.strip()[-300:]}"
    return ""


def run_suite(
    suite: list[Expectation],
    sandboxes: list[str],
    out: Path,
    harbor: bool = False,
    overrides: list[str] | None = None,
    concurrency: int = 2,
) -> tuple[list[Row], dict[str, str]]:
    """Rows of checked expectations for every task in every available sandbox, and the sandboxes skipped (why)."""
    overrides = list(overrides or [])
    rows, skipped = [], {}
    for sandbox in sandboxes:
        node = sandbox_node(sandbox, overrides)
        if why := sandbox_unavailable(sandbox, node):
            skipped[sandbox] = why
            print(f"{sandbox}: skipped: {why}", flush=True)
            continue
        print(
            f"{sandbox}: {len(suite)} tasks, oracle and nop through the eval stage{' and Harbor' if harbor else ''}",
            flush=True,
        )
        scores = run_tbexp(suite, sandbox, out, overrides, concurrency)
        if harbor:
            scores.update(
                {(t, f"harbor-{p}"): s for (t, p), s in run_harbor(suite, sandbox, node, out, concurrency).items()}
            )
        for e in suite:
            keys = [*POLICIES, *(f"harbor-{p}" for p in POLICIES if harbor)]
            rows.append(check_row(e, sandbox, {k: scores[(e.name, k)] for k in keys}))
    return rows, skipped


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sandboxes",
        type=lambda s: [x for x in s.split(",") if x],
        default=["bwrap"],
        help="comma-separated: bwrap,docker",
    )
    parser.add_argument("--harbor", action="store_true", help="also run Harbor's trial runner (oracle and nop agents)")
    parser.add_argument(
        "--tasks", type=Path, default=SUITE, help=f"the suite directory (default {SUITE.relative_to(REPO)})"
    )
    parser.add_argument(
        "--only", type=lambda s: [x for x in s.split(",") if x], help="comma-separated task directory names"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "multirun" / "conformance", help="where runs and the table go"
    )
    parser.add_argument("--concurrency", type=int, default=2, help="episodes (and Harbor trials) at once")
    parser.add_argument(
        "overrides", nargs="*", help="extra config overrides for every eval-stage run, e.g. sandbox.rootfs=DIR"
    )
    args = parser.parse_args()
    if unknown := sorted(set(args.sandboxes) - set(SANDBOXES)):
        parser.error(f"--sandboxes: unknown {unknown}; choose from {list(SANDBOXES)}")
    try:
        suite = load_suite(args.tasks, args.only)
    except ConformanceError as err:
        print(f"conformance: {err}", file=sys.stderr)
        return 2
    rows, skipped = run_suite(suite, args.sandboxes, args.out.resolve(), args.harbor, args.overrides, args.concurrency)
    lines = table(rows, {e.name: e for e in suite})
    summary = summary_line(rows, skipped)
    print("\n" + render_text(lines) if rows else "")
    for line in reason_lines(rows):
        print(f"expected unrunnable: {line}")
    for line in failure_lines(rows):
        print(f"FAIL {line}")
    print(summary)
    write_report(args.out, rows, lines, skipped, summary)
    print(f"table: {args.out / 'conformance.md'}, {args.out / 'conformance.json'}")
    return 1 if any(r.failures for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
