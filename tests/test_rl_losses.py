"""The RL losses against a small case worked out by hand: values and gradients with respect to the trainer's logp.

Two datums. Position 0 is a prompt token (advantage 0, sampler logprob 0). The
sampled tokens, as probabilities p (trainer) and q (sampler), with advantages:

    datum 0: t1 q=0.5 p=0.55 A=+1 (r=1.1,  p-q=+0.05)   t2 q=0.5 p=0.25 A=+1 (r=0.5,  p-q=-0.25)
    datum 1: t3 q=0.2 p=0.5  A=-1 (r=2.5,  p-q=+0.3)    t4 q=0.4 p=0.1  A=-1 (r=0.25, p-q=-0.3)

Each expected number below was derived on paper from these (the clip and mask
decisions are written out beside it), not recomputed with the code's formula.
"""

from __future__ import annotations

import math

import pytest
import torch

from tbexp.backends.rl_losses import policy_loss, policy_metrics

P = [0.9, 0.55, 0.25, 0.5, 0.1]  # the prompt token's p is 0.9; it must not matter anywhere
Q = [0.0, math.log(0.5), math.log(0.5), math.log(0.2), math.log(0.4)]
A = [0.0, 1.0, 1.0, -1.0, -1.0]
DATUM = [0, 0, 0, 1, 1]


def run(loss_fn: str, config: dict | None = None) -> tuple[float, list[float], dict[str, float]]:
    logp = torch.tensor([math.log(p) for p in P], dtype=torch.float64, requires_grad=True)
    inputs = {
        "logprobs": torch.tensor(Q, dtype=torch.float64),
        "advantages": torch.tensor(A, dtype=torch.float64),
        "datum": torch.tensor(DATUM),
    }
    loss = policy_loss(loss_fn, logp, inputs, config)
    loss.backward()
    return loss.item(), logp.grad.tolist(), policy_metrics(loss_fn, logp.detach(), inputs, config)


def test_importance_sampling():
    # -(1.1 + 0.5 - 2.5 - 0.25); d/dlogp = -r·A
    loss, grad, _ = run("importance_sampling")
    assert loss == pytest.approx(1.15)
    assert grad == pytest.approx([0.0, -1.1, -0.5, 2.5, 0.25])


def test_ppo():
    # min(rA, clip(r)A): t1 1.1 (inside), t2 min(0.5, 0.8)=0.5, t3 min(-2.5, -1.2)=-2.5, t4 min(-0.25, -0.8)=-0.8
    # (clipped: no gradient); the sum is -1.7
    loss, grad, metrics = run("ppo")
    assert loss == pytest.approx(1.7)
    assert grad == pytest.approx([0.0, -1.1, -0.5, 2.5, 0.0])
    assert metrics["clip_fraction"] == pytest.approx(3 / 4)  # t2, t3, t4 lie outside [0.8, 1.2]


def test_cispo_weighs_logp_by_the_clipped_ratio_and_keeps_every_gradient():
    # clip(r) = 1.1, 0.8, 1.2, 0.8; loss = -(1.1·ln 0.55 + 0.8·ln 0.25 - 1.2·ln 0.5 - 0.8·ln 0.1)
    # = -(-0.657621 - 1.109035 + 0.831777 + 1.842068) = -0.907189
    loss, grad, metrics = run("cispo")
    assert loss == pytest.approx(-0.907189, abs=1e-6)
    assert grad == pytest.approx([0.0, -1.1, -0.8, 1.2, 0.8])  # -clip(r)·A, never zeroed
    assert metrics["clip_fraction"] == pytest.approx(3 / 4)


def test_cispo_band_from_config():
    # band [0.4, 3.0]: clip(r) = 1.1, 0.5, 2.5, 0.4; loss = -(1.1·ln 0.55 + 0.5·ln 0.25 - 2.5·ln 0.5 - 0.4·ln 0.1)
    loss, grad, _ = run("cispo", {"clip_low_threshold": 0.4, "clip_high_threshold": 3.0})
    assert loss == pytest.approx(-(-0.657621 - 0.693147 + 1.732868 + 0.921034), abs=1e-6)
    assert grad == pytest.approx([0.0, -1.1, -0.5, 2.5, 0.4])


def test_gspo_clips_each_datums_geometric_mean_ratio():
    # s0 = sqrt(1.1 · 0.5) = sqrt(0.55) = 0.741620, s1 = sqrt(2.5 · 0.25) = sqrt(0.625) = 0.790569.
    # band [0.8, 1.2]: datum 0 (A=+1): min(s0, 0.8) = s0, unclipped; datum 1 (A=-1): min(-s1, -0.8) = -0.8, clipped.
    # loss = -(2·0.741620 - 2·0.8) = 0.116760; gradient s0·(-A) on datum 0's tokens, none on datum 1's.
    loss, grad, metrics = run("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    assert loss == pytest.approx(0.116760, abs=1e-6)
    assert grad == pytest.approx([0.0, -0.741620, -0.741620, 0.0, 0.0], abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(1.0)  # both sequence ratios lie below 0.8


def test_gspo_sequence_ratio_ignores_the_prompt_and_the_other_datum():
    # band [0.5, 2.0] holds both: loss = -(2·s0 - 2·s1) = -(1.483240 - 1.581139) = 0.097899
    loss, grad, metrics = run("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})
    assert loss == pytest.approx(0.097899, abs=1e-6)
    assert grad == pytest.approx([0.0, -0.741620, -0.741620, 0.790569, 0.790569], abs=1e-6)
    assert metrics["clip_fraction"] == 0.0


def test_gspo_default_band_is_the_papers():
    # [1 - 3e-4, 1 + 4e-4]: datum 0 min(s0, 0.9997) = s0 (gradient), datum 1 min(-s1, -0.9997) = -0.9997 (clipped)
    loss, grad, _ = run("gspo")
    assert loss == pytest.approx(-(2 * 0.741620 - 2 * 0.9997), abs=1e-6)
    assert grad == pytest.approx([0.0, -0.741620, -0.741620, 0.0, 0.0], abs=1e-6)


def test_dppo_masks_tokens_whose_probability_left_the_trust_region():
    # delta 0.2 / 0.2: t1 (A>0, +0.05) kept; t2 (A>0, -0.25) kept (a fall is no violation for A>0);
    # t3 (A<0, +0.3) kept; t4 (A<0, -0.3 < -0.2) masked. loss = -(1.1 + 0.5 - 2.5) = 0.9
    loss, grad, metrics = run("dppo")
    assert loss == pytest.approx(0.9)
    assert grad == pytest.approx([0.0, -1.1, -0.5, 2.5, 0.0])  # -r·A where kept
    assert metrics["masked_fraction"] == pytest.approx(1 / 4)


def test_dppo_mask_high_and_penalty_from_config():
    # delta_high 0.04 also masks t1 (+0.05); loss = -(0.5 - 2.5) = 2.0, plus
    # tau · Σ (ln r)² over sampled tokens = 0.5·(0.009084 + 0.480453 + 0.839589 + 1.921812) = 1.625469
    # gradient adds 2·tau·ln r = ln r: ln 1.1, ln 0.5, ln 2.5, ln 0.25 (the prompt token stays 0).
    loss, grad, metrics = run("dppo", {"dppo_mask_high": 0.04, "dppo_kl_tau": 0.5})
    assert loss == pytest.approx(2.0 + 1.625469, abs=1e-6)
    assert grad == pytest.approx([0.0, 0.095310, -0.5 - 0.693147, 2.5 + 0.916291, -1.386294], abs=1e-6)
    assert metrics["masked_fraction"] == pytest.approx(2 / 4)


def test_a_misspelt_config_key_is_refused_naming_it():
    with pytest.raises(ValueError, match="clip_hi"):
        run("ppo", {"clip_hi": 1.3})
