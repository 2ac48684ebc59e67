"""The default recipe (`python -m tbexp`) at a small size gives the numbers recorded in tests/golden/.

A refactoring keeps behaviour: this test runs collect -> sft -> filter -> grpo -> eval
on a few built-in tasks of four families, in a fresh cache, and compares the job's
`summary.json`, and the losses and rollout numbers of its SFT and GRPO steps
(`metrics.jsonl`; wall times left out), with the ones recorded. The built-in tasks, the sandboxes and the
verifier all decide these numbers, so a change there that moves a result shows
here too. Every part runs one episode at a time: the sampler batches concurrent
requests, and a batched matrix product rounds differently from a single one
(backends/batch_sampling.py), so the recording would hold the rounding of batches
that a change of batching (sampling.lockstep, batch sizes) moves. At one a time two runs agree
bit for bit, and so must this one with the recording, except the keys in TOLERANCES.
The other source of run-to-run change is the commands themselves: what several
processes write to one pipe arrives in scheduling order, so the settings below are
ones whose episodes were checked to give the same observations in repeated runs.

A change that alters the numbers on purpose (a new random stream, a new default)
re-records: `TBEXP_RECORD_GOLDEN=1 python -m pytest tests/test_recipe_golden.py`,
and says so in its commit. The recording is of one machine's float arithmetic
(torch's CPU kernels, 2 threads); another machine differs in the last digits of its
losses (FLOAT_RTOL below), never in an episode.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

GOLDEN = Path(__file__).resolve().parent / "golden" / "recipe.json"
SMALL = [
    "tasks.families=[file-move,needle-file,json-sum,log-errors]",
    "tasks.train_per_family=4",  # four train tasks a family (half for SFT, half for RL) and one held out
    "tasks.heldout_per_family=1",
    "sft.steps=12",
    "sft.batch_size=4",
    "sft.eval_every=6",
    "sft.val_fraction=0.25",
    "task_filter.lower=0.0",  # keep every rated candidate: a small k cannot rate a task inside (0.1, 0.8) reliably
    "task_filter.upper=1.0",
    "task_filter.k=2",
    "task_filter.max_tasks=4",
    "grpo.steps=2",
    "grpo.groups_per_step=2",
    "grpo.group_size=4",
    # GRPO samples at its default temperature: after 12 SFT steps every group scores alike and no update runs, so
    # this checks the rollouts' numbers and tests/test_advantages.py the update's arithmetic. Hotter sampling (1.5)
    # made the model type pipelines of two unknown commands, whose error lines reach the pipe in either order
    # (two processes, one pipe): the next observation, and from there the next reply, changed from run to run.
    "grpo.eval_every=2",
    "grpo.eval_at_start=false",  # the one eval point is the last step, so the rl row scores what GRPO trained
    "grpo.eval_n_runs=1",
    "eval.n_runs=1",
    "sampling.max_tokens=48",
    "agent.max_turns=3",
    "collect.concurrency=1",  # one episode at a time: see the module docstring
    "eval.concurrency=1",
    "grpo.concurrency=1",
]
TOLERANCES: dict[str, float] = {}  # summary key (dotted) -> absolute tolerance; empty: everything bit for bit
# Another CPU's float arithmetic: torch picks its vectorised kernels by the CPU (ATen's AVX2 or AVX-512 paths), so
# a machine other than the recording's gives the training losses and norms in other last bits. Measured 2026-12-03
# on an AVX-512-FP16 Xeon: 20 SFT floats moved, by at most 1.4e-6 relative; every episode, reward, count and the
# GRPO rows stayed bit for bit. A behaviour change moves a loss far more than this, or an episode's outcome, which
# moves a count (compared exactly) or a reward by at least one episode's share. TBEXP_GOLDEN_EXACT=1 asks for bit
# for bit, as on the recording's machine.
FLOAT_RTOL = 0.0 if os.environ.get("TBEXP_GOLDEN_EXACT") == "1" else 1e-5


def _flat(tree: dict | list, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items() if isinstance(tree, dict) else enumerate(tree):
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list)):
            flat.update(_flat(value, name + "."))
        else:
            flat[name] = value
    return flat


def _steps(metrics: Path) -> list[dict]:
    """A training loop's per-step rows without the wall times (a step's numbers, not the machine's speed)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [
        {k: v for k, v in r.items() if k != "time" and not k.startswith("time/")}
        for r in rows
        if "train/nll" in r or "rollout/reward_mean" in r
    ]


def _portable(numbers: dict, roots: dict[str, Path]) -> dict:
    """The numbers with this run's folders written as <run> and <cache>, so the recording holds anywhere; a cached
    result is named by its content key (tbexp.content_key), which covers the code too, so it is written <key>."""
    text = json.dumps(numbers)
    for name, root in roots.items():
        text = text.replace(str(root), f"<{name}>")
    text = re.sub(r"<cache>/(sft|evals)/[0-9a-f]{20}/", r"<cache>/\1/<key>/", text)
    return json.loads(re.sub(r"(<cache>/trajectories/oracle-[\w-]+tasks-)[0-9a-f]{16}\.jsonl", r"\1<key>.jsonl", text))


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.timeout(3600)  # measured on 2 shared cores: 1.6 minutes at a light load, 8-16 at load average 15-20
def test_the_default_recipe_gives_the_recorded_numbers(rootfs, tmp_path):
    run, cache = tmp_path / "run", tmp_path / "cache"
    env = {**os.environ, "TBEXP_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "tbexp", *SMALL, f"sandbox.rootfs={rootfs}", f"hydra.run.dir={run}"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = {
        "summary.json": json.loads((run / "summary.json").read_text()),
        "sft steps": _steps(run / "sft" / "metrics.jsonl"),
        "grpo steps": _steps(run / "grpo" / "metrics.jsonl"),
    }
    numbers = _portable(result, {"run": run, "cache": cache})
    if os.environ.get("TBEXP_RECORD_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(numbers, indent=2, sort_keys=True) + "\n")
        pytest.skip(f"recorded {GOLDEN}")
    assert GOLDEN.exists(), f"no recording: run with TBEXP_RECORD_GOLDEN=1 to write {GOLDEN}"
    got, want = _flat(numbers), _flat(json.loads(GOLDEN.read_text()))
    assert sorted(got) == sorted(want), (
        f"keys differ: missing {sorted(set(want) - set(got))}, new {sorted(set(got) - set(want))}"
    )
    moved = {}
    for key, value in want.items():
        tolerance = TOLERANCES.get(key, 0.0)
        same = got[key] == value or (isinstance(value, float) and math.isnan(value) and math.isnan(got[key]))
        close = (
            isinstance(value, float)
            and isinstance(got[key], float)
            and math.isclose(got[key], value, rel_tol=FLOAT_RTOL)
        )
        if not same and not close and not (tolerance and abs(got[key] - value) <= tolerance):
            moved[key] = (value, got[key])
    assert not moved, "recorded -> now: " + json.dumps(moved, indent=1)
