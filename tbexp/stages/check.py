"""The check stage: what a task set gives here, before anyone trains on it.

    python -m tbexp stage=check tasks=dir tasks.path=DIR                  # bwrap
    python -m tbexp stage=check tasks=dir tasks.path=DIR sandbox=docker

load the set (tasks that cannot be loaded are listed with why) → build each distinct environment once (a task
whose environment cannot be built is unrunnable, with the build's error) → run every runnable task once with the
oracle and once with the do-nothing policy (`check.n_runs` each), in the chosen sandbox, through the episodes'
own verdicts → a manifest, `check.json`, and the table printed, one row per task:

* runnable or not, and why: not loadable, environment not built, or every episode invalid (the reason of the
  first; a test.sh that needs the network or a package that cannot be had offline says so);
* the oracle's and the do-nothing run's per-test reward and strict success;
* what it asks of the network (task.toml's network mode where the sandbox does not give it, or a download that
  made it unrunnable);
* `usable`: runnable, the oracle passes every test, and the do-nothing run does not pass (a do-nothing pass means
  the task is broken or hackable: its tests hold for an agent that did nothing); `problem` says which failed.

`tasks.manifest=check.json` in any later job (eval, filter, GRPO) keeps only the usable tasks and lists the
others, with why, in the eval's `excluded_tasks.json`: RL never trains on a task whose oracle fails here.
Re-running in the same run directory reuses nothing: the check is cheap next to what it protects (docs/check.md
has its time on the conformance suite, cold and warm).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from tbexp.build import run_policy
from tbexp.jobs.tracking import write_summary
from tbexp.sandboxes.environments import prepare_environments

MANIFEST_VERSION = 1
NETWORK_HINTS = ("network", "offline", "fetches", "ProvisionError", "could not have")


def run(job: Any) -> dict[str, float]:
    cfg, out = job.cfg, job.run_dir
    started = time.perf_counter()
    tasks = job.tasks("heldout")
    unrunnable = prepare_environments(list(tasks), job.sandbox_settings)
    runnable = [t for t in tasks if t.name not in unrunnable]
    episodes = {}
    for policy in ("oracle", "nop"):
        episodes[policy] = run_policy(
            job, runnable, cfg.check.n_runs, cfg.check.concurrency, policy, desc=f"check {policy}"
        )
    rows = {t.name: _row(t, unrunnable.get(t.name, ""), episodes) for t in tasks}
    for task_dir, reason in tasks.unloadable.items():
        rows[Path(task_dir).name] = {
            "path": task_dir,
            "runnable": False,
            "why": f"not loadable: {reason}",
            "usable": False,
        }
    manifest = {
        "version": MANIFEST_VERSION,
        "tasks_path": str(cfg.tasks.path),
        "sandbox": cfg.sandbox.name,
        "seconds": round(time.perf_counter() - started, 1),
        "tasks": dict(sorted(rows.items())),
    }
    path = Path(cfg.check.manifest) if cfg.check.manifest else out / "check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1))
    metrics = _metrics(manifest)
    print(table(manifest))
    print(f"manifest: {path}  (use it with tasks.manifest={path})")
    write_summary(out, metrics)
    return metrics


def _row(task: Any, unrunnable: str, episodes: dict[str, list[Any]]) -> dict[str, Any]:
    mine = {p: [ep for ep in eps if ep.task.name == task.name] for p, eps in episodes.items()}
    row: dict[str, Any] = {"path": str(task.path), "runnable": not unrunnable, "why": unrunnable}
    for policy, eps in mine.items():
        scored = [ep for ep in eps if not ep.invalid]
        row[policy] = {
            "reward": _mean([ep.report.fraction_passed for ep in scored]),
            "strict": _mean([float(ep.report.strict) for ep in scored]),
            "source": scored[0].report.source if scored else "",
            "invalid": [ep.invalid.splitlines()[0] for ep in eps if ep.invalid],
            "tamper": sorted({t for ep in eps for t in ep.tamper}),
        }
        if eps and not scored and row["runnable"]:
            row["runnable"], row["why"] = False, f"every {policy} episode invalid: {row[policy]['invalid'][0]}"
    row["network"] = _network(task, row, [ep for eps in mine.values() for ep in eps])
    row["problem"] = _problem(row)
    row["usable"] = row["runnable"] and not row["problem"]
    return row


def _network(task: Any, row: dict[str, Any], eps: list[Any]) -> str:
    """What the task asks of the network: its network mode where the sandbox did not give it, or a download."""
    why = row["why"] if any(h in row["why"] for h in NETWORK_HINTS) else ""
    asked = next((ep.network for ep in eps if ep.network), "")
    return "; ".join(s for s in (why, asked) if s)


def _problem(row: dict[str, Any]) -> str:
    if not row["runnable"]:
        return ""
    oracle, nop = row["oracle"], row["nop"]
    if not oracle["strict"] >= 1.0:
        return f"the oracle does not pass (per-test {oracle['reward']:.3f})"
    if nop["strict"] > 0.0:
        return "the do-nothing run passes: the task is broken or hackable"
    if oracle["tamper"]:
        return f"the task's own solution touches what the verifier reads: {oracle['tamper'][0]}"
    return ""


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _metrics(manifest: dict[str, Any]) -> dict[str, float]:
    rows = list(manifest["tasks"].values())
    runnable = [r for r in rows if r["runnable"]]
    return {
        "check/tasks": float(len(rows)),
        "check/runnable": float(len(runnable)),
        "check/oracle_passes": float(sum(r["oracle"]["strict"] >= 1.0 for r in runnable)),
        "check/nop_passes": float(sum(r["nop"]["strict"] > 0.0 for r in runnable)),
        "check/needs_network": float(sum(bool(r.get("network")) for r in rows)),
        "check/usable": float(sum(r["usable"] for r in rows)),
        "check/seconds": float(manifest["seconds"]),
    }


def table(manifest: dict[str, Any]) -> str:
    """The manifest as the printed table: one row per task, then the counts."""
    head = f"{'task':40} {'runnable':>8} {'oracle':>13} {'nop':>13} {'usable':>6}  why / problem / network"
    lines = [head, "-" * len(head)]
    for name, r in manifest["tasks"].items():
        cells = [_score(r.get("oracle")), _score(r.get("nop"))] if r["runnable"] else ["-", "-"]
        note = "; ".join(s for s in (r.get("why", ""), r.get("problem", ""), r.get("network", "")) if s)
        note = " ".join(note.split())  # a build's error spans lines
        flag = "yes" if r["usable"] else "no"
        lines.append(
            f"{name[-40:]:40} {'yes' if r['runnable'] else 'no':>8} {cells[0]:>13} {cells[1]:>13} {flag:>6}  {note[:160]}"
        )
    m = _metrics(manifest)
    lines.append("-" * len(head))
    lines.append(
        f"{m['check/tasks']:.0f} tasks: {m['check/runnable']:.0f} runnable, oracle passes {m['check/oracle_passes']:.0f}, "
        f"do-nothing passes {m['check/nop_passes']:.0f}, ask for the network {m['check/needs_network']:.0f}, "
        f"usable {m['check/usable']:.0f} ({manifest['sandbox']}, {manifest['seconds']:.0f} s)"
    )
    return "\n".join(lines)


def _score(cell: dict[str, Any] | None) -> str:
    if not cell or math.isnan(cell["reward"]):
        return "invalid"
    return f"{cell['reward']:.2f} / {'pass' if cell['strict'] >= 1.0 else 'fail'}"
