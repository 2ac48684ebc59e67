"""The promotion gate on hand-made per-episode records: the difference is paired by (task, run), its standard error
is clustered by task, and the decision needs margin + z·s.e.

Three tasks, two runs each (strict success, incumbent → challenger):

    task a: [1, 1] → [1, 1]   differences 0, 0   task mean 0
    task b: [0, 1] → [1, 1]   differences 1, 0   task mean 0.5
    task c: [0, 0] → [0, 1]   differences 0, 1   task mean 0.5

Paired: d = 2/6 = 0.3333; the task means 0, 0.5, 0.5 have sd sqrt(1/12) = 0.288675, so s.e. = 0.288675/sqrt(3) =
0.166667 and with z = 1.96 the bar is 0.326667: promoted. Unpaired, the same two means (0.5 and 0.8333) would have
s.e. sqrt(0.3/6 + 0.16667/6) = 0.278887 and a bar of 0.546618: kept. So the decision below holds only with pairing.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from tbexp.episodes.promotion import episode_records, paired_difference, promotion, read_records, write_records
from tbexp.stages.eval import gate

INCUMBENT = {"a": [1, 1], "b": [0, 1], "c": [0, 0]}
CHALLENGER = {"a": [1, 1], "b": [1, 1], "c": [0, 1]}
METRIC = "eval/strict_success"


def records(table: dict[str, list[int]]) -> list[dict]:
    return [
        {"task": task, "run": run, "invalid": False, "strict": float(v), "reward": float(v), "turns": 2.0}
        for task, values in table.items()
        for run, v in enumerate(values)
    ]


def rows(incumbent: float = 0.5, challenger: float = 5 / 6) -> dict[str, dict[str, float]]:
    return {"sft": {METRIC: incumbent}, "rl": {METRIC: challenger}}


def test_paired_difference_and_task_clustered_stderr():
    paired = paired_difference(records(CHALLENGER), records(INCUMBENT), METRIC)
    assert paired["difference"] == pytest.approx(1 / 3)
    assert paired["stderr"] == pytest.approx(0.166667, abs=1e-6)
    assert (paired["pairs"], paired["tasks"]) == (6.0, 3.0)


def test_the_gate_promotes_on_the_paired_interval_where_an_unpaired_one_would_keep():
    verdict = promotion(rows(), METRIC, 0.0, 1.96, {"sft": records(INCUMBENT), "rl": records(CHALLENGER)})
    assert verdict["promoted"] and verdict["chosen"] == "rl" and verdict["incumbent"] == "sft"
    assert verdict["difference"] == pytest.approx(1 / 3) and verdict["stderr"] == pytest.approx(0.166667, abs=1e-6)
    assert verdict["message"].startswith("PROMOTE rl: rl +0.333 ± 0.167 eval/strict_success over sft")
    assert "paired on 6 episodes of 3 tasks" in verdict["message"]


def test_pairs_are_matched_by_task_and_run_not_by_position():
    shuffled = records(CHALLENGER)
    random.Random(0).shuffle(shuffled)
    paired = paired_difference(shuffled, records(INCUMBENT), METRIC)
    assert paired["difference"] == pytest.approx(1 / 3) and paired["stderr"] == pytest.approx(0.166667, abs=1e-6)
    # Task b's episodes paired with task c's and back: the same mean difference, but task means 0, 0, 1 and so
    # s.e. sqrt(1/3)/sqrt(3) = 0.333333: the s.e. is the pairing's.
    crossed = [dict(r, task={"b": "c", "c": "b"}.get(r["task"], r["task"])) for r in records(CHALLENGER)]
    assert paired_difference(crossed, records(INCUMBENT), METRIC)["stderr"] == pytest.approx(0.333333, abs=1e-6)


def test_an_episode_invalid_on_either_side_drops_its_pair():
    incumbent = records(INCUMBENT)
    incumbent[2] = dict(incumbent[2], invalid=True, strict=None)  # task b run 0: its difference 1 goes
    paired = paired_difference(records(CHALLENGER), incumbent, METRIC)
    assert paired["pairs"] == 5.0 and paired["difference"] == pytest.approx(1 / 5)
    # task means 0, 0 (b keeps only run 1), 0.5: sd 0.288675, s.e. 0.166667
    assert paired["stderr"] == pytest.approx(0.166667, abs=1e-6)


def test_a_difference_inside_the_interval_is_kept():
    verdict = promotion(rows(), METRIC, 0.1, 1.96, {"sft": records(INCUMBENT), "rl": records(CHALLENGER)})
    assert not verdict["promoted"] and verdict["chosen"] == "sft"  # bar 0.1 + 0.326667 = 0.426667
    assert "needs > margin 0.1 + 1.96 s.e. = 0.427" in verdict["message"]


def test_without_records_the_gate_says_it_is_unpaired():
    verdict = promotion(rows(), METRIC, 0.0, 1.96, {"sft": None, "rl": records(CHALLENGER)})
    assert verdict["promoted"] and math.isnan(verdict["stderr"]) and "unpaired" in verdict["message"]


def test_the_pipeline_gate_compares_with_the_row_before_the_last_or_the_named_incumbent():
    settings = SimpleNamespace(promote_by=METRIC, promote_margin=0.0, promote_z=1.96)
    all_rows = {"base": {METRIC: 0.0}, **rows()}
    got = records(CHALLENGER)
    verdict = gate(settings, all_rows, {"base": records({"a": [0, 0]}), "sft": records(INCUMBENT), "rl": got})
    assert verdict["incumbent"] == "sft" and verdict["promoted"]
    named = {"base": {METRIC: 0.0}, "sft": {METRIC: 0.5}, "incumbent": {METRIC: 5 / 6}, "rl": {METRIC: 5 / 6}}
    verdict = gate(settings, named, {"incumbent": records(CHALLENGER), "rl": got})
    assert verdict["incumbent"] == "incumbent" and not verdict["promoted"] and verdict["difference"] == 0.0


def test_eval_records_round_trip(tmp_path):
    def episode(task: str, run: int, strict: bool | None) -> SimpleNamespace:
        report = SimpleNamespace(strict=strict) if strict is not None else None
        task_ns = SimpleNamespace(name=task)
        tamper = ["planted: /logs/verifier/reward.txt"] if task == "b" else []
        return SimpleNamespace(task=task_ns, run=run, invalid=strict is None, report=report, turns=[1], tamper=tamper)

    episodes = [episode("b", 0, True), episode("a", 1, None), episode("a", 0, False)]
    rewards = {id(episodes[0]): 1.0, id(episodes[2]): 0.25}
    write_records(tmp_path, episode_records(episodes, rewards))
    assert read_records(tmp_path) == [
        {"task": "a", "run": 0, "invalid": False, "tamper": 0, "strict": 0.0, "reward": 0.25, "turns": 1.0},
        {"task": "a", "run": 1, "invalid": True, "tamper": 0, "strict": None, "reward": None, "turns": None},
        {"task": "b", "run": 0, "invalid": False, "tamper": 1, "strict": 1.0, "reward": 1.0, "turns": 1.0},
    ]
    assert read_records(tmp_path / "none") is None
