"""GRPO's arithmetic: group-relative advantages and the datums a policy-gradient loss trains on.

A group is the valid episodes of one task in a step. Each episode's advantage is
its reward minus the group's mean, divided by the group's population standard
deviation (+1e-6) with `scale_by_std`; below-mean advantages are multiplied by
`negative_weight` (1 = plain GRPO, 0 = learn from the above-mean episodes only).
A group whose rewards are all equal (or that has one episode) teaches nothing and
is skipped.

One datum per advantaged episode, on the episode's tokens exactly as sampled
(`Episode.sequences`; a multi-step episode gives one datum per step, each step
being a conversation of its own, all with the episode's advantage): position i
predicts token i+1; the sampled tokens carry the
sampler's logprob and the advantage, prompts and observations carry 0. The
advantage is divided by a share so the summed loss Tinker defines is a mean:
`normalize="token"` divides by the step's sampled tokens (every token weighs the
same), `"episode"` by (advantaged episodes x this episode's sampled tokens)
(every episode weighs the same, whatever its length). With `kl_coef` > 0, each
sampled token's advantage is lowered by kl_coef * (logp_sampler - logp_reference)
before the division: a per-token estimate of the KL to the reference weights.
`loss_fn_config` maps the grpo config's loss parameters to the keys the chosen loss
reads (tbexp/backends/rl_losses.py has the definitions).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from tbexp.episodes.policies import sampled_sequences

STD_EPSILON = 1e-6  # keeps a group with a tiny spread from blowing its advantages up


def group_advantages(
    scores: list[float], scale_by_std: bool = False, negative_weight: float = 1.0
) -> list[float] | None:
    """Each score's advantage within its group, or None when the group teaches nothing (fewer than two, all equal).

    >>> group_advantages([1.0, 0.0, 0.5, 0.5])
    [0.5, -0.5, 0.0, 0.0]
    >>> group_advantages([1.0, 0.0], negative_weight=0.0)
    [0.5, -0.0]
    >>> group_advantages([0.3, 0.3]) is None
    True
    """
    if len(scores) < 2 or max(scores) == min(scores):
        return None
    mean = statistics.fmean(scores)
    scale = (statistics.pstdev(scores) + STD_EPSILON) if scale_by_std else 1.0
    return [(s - mean) / scale * (negative_weight if s < mean else 1.0) for s in scores]


def grpo_datums(
    episodes: list,
    rewards: dict[int, float],
    scale_by_std: bool,
    reference: Any,
    kl_coef: float,
    normalize: str = "token",
    negative_weight: float = 1.0,
) -> tuple[list, dict[str, float]]:
    """The step's datums and counts (groups, groups_skipped, datums, sampled_tokens, and kl_start with a reference).

    `rewards` is keyed by id(episode) (tbexp.episodes.scoring.score_episodes); `reference` is a sampler over the
    weights the KL is measured against (None: no penalty).
    """
    from tinker import types

    groups: dict[str, list] = defaultdict(list)
    for ep in episodes:
        if not ep.invalid and any(seq.turns for seq in sampled_sequences(ep)):
            groups[ep.task.name].append(ep)
    advantaged, skipped = [], 0
    for group in groups.values():
        advantages = group_advantages([rewards[id(ep)] for ep in group], scale_by_std, negative_weight)
        if advantages is None:
            skipped += 1  # every advantage would be 0
            continue
        advantaged += list(zip(group, advantages))
    n_sampled = sum(seq.n_sampled for ep, _ in advantaged for seq in sampled_sequences(ep))
    sequences = [(seq, ep, a) for ep, a in advantaged for seq in sampled_sequences(ep) if seq.turns]
    # Every reference request is submitted before any is awaited: a remote sampler (Tinker) works on them together.
    refs = [
        reference.compute_logprobs(types.ModelInput.from_ints(s.tokens)) if reference is not None else None
        for s, _, _ in sequences
    ]
    datums, kl_sum = [], 0.0
    # A multi-step episode: one datum per step, all with the episode's advantage.
    for (seq, ep, advantage), ref in zip(sequences, refs):
        episode_sampled = sum(seq.n_sampled for seq in sampled_sequences(ep))
        share = n_sampled if normalize == "token" else len(advantaged) * episode_sampled
        datum, kl = _datum(seq, advantage, share, kl_coef, ref.result() if ref is not None else None, types)
        datums.append(datum)
        kl_sum += kl
    counts = {
        "groups": float(len(groups)),
        "groups_skipped": float(skipped),
        "datums": float(len(datums)),
        "sampled_tokens": float(n_sampled),
    }
    if reference is not None and n_sampled:
        counts["kl_start"] = kl_sum / n_sampled
    return datums, counts


def _datum(seq, advantage: float, share: float, kl_coef: float, ref, types) -> tuple:
    """One sampled sequence as a training datum, and the sum of its tokens' KL to the reference (`ref`: the
    reference's logprob of each token, None without one)."""
    tokens = seq.tokens
    logprobs, token_advantages = [0.0] * len(tokens), [0.0] * len(tokens)
    kl_sum = 0.0
    for turn in seq.turns:
        for i, logp in enumerate(turn.logprobs):
            at = turn.offset + i
            logprobs[at] = logp
            kl = logp - ref[at] if ref is not None else 0.0
            kl_sum += kl
            token_advantages[at] = (advantage - kl_coef * kl) / share
    inputs = {"target_tokens": tokens[1:], "logprobs": logprobs[1:], "advantages": token_advantages[1:]}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs), kl_sum


def loss_fn_config(grpo: Any) -> dict[str, float]:
    """The `loss_fn_config` for `grpo.loss_fn`, from the grpo config's fields (Tinker's key names).

    >>> from types import SimpleNamespace
    >>> loss_fn_config(SimpleNamespace(loss_fn="gspo", gspo_clip_low_threshold=0.99, gspo_clip_high_threshold=1.01))
    {'clip_low_threshold': 0.99, 'clip_high_threshold': 1.01}
    """
    g = grpo
    if g.loss_fn in ("ppo", "cispo"):
        return {"clip_low_threshold": g.clip_low_threshold, "clip_high_threshold": g.clip_high_threshold}
    if g.loss_fn == "gspo":
        return {"clip_low_threshold": g.gspo_clip_low_threshold, "clip_high_threshold": g.gspo_clip_high_threshold}
    if g.loss_fn == "dppo":
        return {"dppo_mask_low": g.dppo_mask_low, "dppo_mask_high": g.dppo_mask_high, "dppo_kl_tau": g.dppo_kl_tau}
    return {}
