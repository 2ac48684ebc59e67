"""GRPO's arithmetic (tbexp.episodes.advantages) against numbers worked out by hand in the comments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tbexp.episodes.advantages import group_advantages, grpo_datums
from tbexp.episodes.policies import SampledTokens, SampledTurn


def _episode(task: str, turns: list[SampledTurn], tokens: list[int], invalid: str = ""):
    return SimpleNamespace(task=SimpleNamespace(name=task), invalid=invalid, sampled=SampledTokens(tokens, turns))


def _advantages(datum) -> list[float]:
    return datum.loss_fn_inputs["advantages"].tolist()


def test_group_advantages_by_hand():
    # rewards 1, 0, 0: mean 1/3, so +2/3, -1/3, -1/3
    assert group_advantages([1.0, 0.0, 0.0]) == pytest.approx([0.6666667, -0.3333333, -0.3333333], abs=1e-7)
    # population std sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2/9) = 0.4714045, plus 1e-6 = 0.4714055:
    # 0.6666667 / 0.4714055 = 1.4142106 and -0.3333333 / 0.4714055 = -0.7071053
    assert group_advantages([1.0, 0.0, 0.0], scale_by_std=True) == pytest.approx(
        [1.4142106, -0.7071053, -0.7071053], abs=2e-7
    )
    # below the mean (0.5) only: -0.5 x 0.25
    assert group_advantages([1.0, 0.0], negative_weight=0.25) == pytest.approx([0.5, -0.125])
    assert group_advantages([0.7, 0.7, 0.7]) is None and group_advantages([1.0]) is None


def test_advantages_sit_on_the_sampled_tokens_divided_by_the_steps_sampled_tokens():
    # Prompt [1, 2], reply [3, 4] (sampled), observation [5], reply [6] (sampled): 3 sampled tokens an episode.
    turns = [SampledTurn(2, [3, 4], [-0.1, -0.2]), SampledTurn(5, [6], [-0.3])]
    tokens = [1, 2, 3, 4, 5, 6]
    win, lose = _episode("t", turns, tokens), _episode("t", turns, tokens)
    datums, counts = grpo_datums(
        [win, lose], {id(win): 1.0, id(lose): 0.0}, scale_by_std=False, reference=None, kl_coef=0.0
    )
    assert counts == {"groups": 1.0, "groups_skipped": 0.0, "datums": 2.0, "sampled_tokens": 6.0}
    d = datums[0].loss_fn_inputs
    assert datums[0].model_input.to_ints() == [1, 2, 3, 4, 5] and d["target_tokens"].tolist() == [2, 3, 4, 5, 6]
    # targets 3, 4 and 6 were sampled; +0.5 over the step's 6 sampled tokens = 0.0833333 each
    assert _advantages(datums[0]) == pytest.approx([0.0, 0.0833333, 0.0833333, 0.0, 0.0833333], abs=1e-7)
    assert d["logprobs"].tolist() == pytest.approx([0.0, -0.1, -0.2, 0.0, -0.3])
    assert _advantages(datums[1]) == pytest.approx([0.0, -0.0833333, -0.0833333, 0.0, -0.0833333], abs=1e-7)


def test_episode_normalisation_weighs_episodes_equally_whatever_their_length():
    short, long = [SampledTurn(1, [2], [-0.1])], [SampledTurn(1, [2, 3, 4], [-0.1, -0.2, -0.3])]
    win, lose = _episode("t", short, [1, 2]), _episode("t", long, [1, 2, 3, 4])
    datums, _ = grpo_datums([win, lose], {id(win): 1.0, id(lose): 0.0}, False, None, 0.0, normalize="episode")
    # share = 2 episodes x own sampled tokens: +0.5 / (2 x 1) = 0.25; -0.5 / (2 x 3) = -0.0833333
    assert _advantages(datums[0]) == pytest.approx([0.25])
    assert _advantages(datums[1]) == pytest.approx([-0.0833333] * 3, abs=1e-7)


def test_scale_by_std_and_negative_weight_reach_the_datums():
    turns = [SampledTurn(1, [2], [-0.1])]
    group = [_episode("t", turns, [1, 2]) for _ in range(3)]
    rewards = {id(group[0]): 1.0, id(group[1]): 0.0, id(group[2]): 0.0}
    datums, _ = grpo_datums(group, rewards, scale_by_std=True, reference=None, kl_coef=0.0, negative_weight=0.5)
    # 1.4142106 and -0.7071053 x 0.5 (see above), each over the step's 3 sampled tokens
    assert [_advantages(d)[0] for d in datums] == pytest.approx([0.4714035, -0.1178509, -0.1178509], abs=2e-7)


def test_constant_groups_single_episodes_and_invalid_episodes_teach_nothing():
    turns = [SampledTurn(1, [2], [-0.5])]
    same = [_episode("same", turns, [1, 2]) for _ in range(3)]
    alone = _episode("alone", turns, [1, 2])
    broken = _episode("mixed", turns, [1, 2], invalid="SandboxError: gone")
    mixed = [_episode("mixed", turns, [1, 2]), _episode("mixed", turns, [1, 2])]
    rewards = {id(ep): 1.0 for ep in same} | {id(alone): 1.0, id(mixed[0]): 1.0, id(mixed[1]): 0.0}
    datums, counts = grpo_datums([*same, alone, broken, *mixed], rewards, False, None, 0.0)
    assert counts == {"groups": 3.0, "groups_skipped": 2.0, "datums": 2.0, "sampled_tokens": 2.0}
    assert [_advantages(d) for d in datums] == [[0.25], [-0.25]]  # +-0.5 over 2 sampled tokens


def test_kl_penalty_lowers_the_advantage_where_the_policy_left_its_reference():
    turns = [SampledTurn(1, [2, 3], [-0.5, -0.5])]
    a, b = _episode("t", turns, [1, 2, 3]), _episode("t", turns, [1, 2, 3])
    reference = SimpleNamespace(compute_logprobs=lambda prompt: SimpleNamespace(result=lambda: [None, -1.5, -0.5]))
    datums, counts = grpo_datums([a, b], {id(a): 1.0, id(b): 0.0}, False, reference, kl_coef=0.1)
    # token 2: -0.5 - (-1.5) = 1.0 -> (0.5 - 0.1 x 1.0) / 4 = 0.1; token 3: no drift -> 0.5 / 4 = 0.125
    assert _advantages(datums[0]) == pytest.approx([0.1, 0.125])
    assert _advantages(datums[1]) == pytest.approx([-0.15, -0.125])  # (-0.5 - 0.1) / 4, -0.5 / 4
    assert counts["kl_start"] == pytest.approx(0.5)  # (1 + 0 + 1 + 0) / 4 sampled tokens


def test_a_damaged_episode_is_scored_zero_and_taught_against_not_dropped():
    # The agent broke its own sandbox (tbexp.episodes.verdicts): the episode is not invalid, its report is empty.
    from tbexp.episodes.rewards import per_test
    from tbexp.episodes.scoring import score_episodes
    from tbexp.episodes.verdicts import NO_RESULT
    from tbexp.episodes.verifier import TestReport

    turns = [SampledTurn(1, [2], [-0.5])]
    win, wrecked = _episode("t", turns, [1, 2]), _episode("t", turns, [1, 2])
    win.report, win.damage = TestReport({"a": "passed"}), ""
    wrecked.report, wrecked.damage = NO_RESULT, "the verifier gave no result after the agent's commands"
    for ep in (win, wrecked):
        ep.turns = [None]
    rewards = score_episodes([win, wrecked], per_test)
    assert rewards == {id(win): 1.0, id(wrecked): 0.0}
    datums, counts = grpo_datums([win, wrecked], rewards, scale_by_std=False, reference=None, kl_coef=0.0)
    assert counts["datums"] == 2 and counts["groups_skipped"] == 0
    assert _advantages(datums[1]) == pytest.approx([-0.5 / 2])  # below the group mean (0.5), over 2 sampled tokens
