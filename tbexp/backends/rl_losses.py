"""The policy-gradient losses of the local backend, as sums over tokens (Tinker's convention: never a mean).

Every loss reads, per target position, the trainer's logp (with gradient), the
sampler's logprob q and the advantage A; r = exp(logp − q). A *sampled* token
is one whose advantage is non-zero: GRPO's datums (tbexp.episodes.advantages)
give prompts and observations A = 0 and q = 0, so those positions add nothing
to a loss and are left out of the per-sequence means and the penalty below.
The advantages already carry GRPO's normalisation (divided by the step's or the
episode's sampled tokens), which is why a sum here is the mean the papers write.

* `importance_sampling`: −Σ r·A (Tinker's).
* `ppo`: −Σ min(r·A, clip(r, lo, hi)·A), `clip_low_threshold` / `clip_high_threshold`
  as absolute ratio bounds, default 0.8 / 1.2 (Tinker's).
* `cispo` (MiniMax-M1's CISPO, as Tinker serves it): −Σ sg(clip(r, lo, hi))·logp·A with
  the same two keys and defaults as ppo: the clipped ratio only weighs the
  gradient, which flows through every token (PPO's clip zeroes it instead).
* `gspo` (GSPO, Zheng et al. 2025, in its GSPO-token form as verl's `gspo`): each datum's
  sequence ratio s = exp(mean over its sampled tokens of (logp − q)), the
  geometric mean of the token ratios; token t of the datum carries
  s_t = sg(s)·exp(logp_t − sg(logp_t)) (value s, gradient s·∇logp_t) in
  −Σ min(s_t·A, clip(s_t, lo, hi)·A). The same keys as ppo, with the paper's far
  tighter default band 1 − 3e-4 / 1 + 4e-4 (a length-normalised ratio moves little).
* `dppo` (DPPO-Binary-TV, Qi et al. 2026 "Rethinking the Trust Region in LLM RL", as
  prime-rl's default loss): a token is dropped when its *probability* has moved
  past the trust region in the direction its advantage pushes, p − exp(q) >
  `dppo_mask_high` with A > 0, or < −`dppo_mask_low` with A < 0 (defaults 0.2 /
  0.2, prime-rl's); the loss is −Σ keep·r·A + `dppo_kl_tau`·Σ (logp − q)² over
  sampled tokens (default 0: tbexp's own `grpo.kl_coef` penalises drift from the
  start weights). Unlike PPO's ratio clip, a rare token (small p) may change its
  ratio a lot and a common one only a little. verl's `dppo_tv` weighs
  sg(min(r, C))·logp instead of r: the same gradient below C, another loss value.
"""

from __future__ import annotations

import torch

# Each RL loss's loss_fn_config keys and their defaults; a key the caller leaves out takes its default.
LOSS_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "gspo": {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
    "dppo": {"dppo_mask_low": 0.2, "dppo_mask_high": 0.2, "dppo_kl_tau": 0.0},
}
RL_LOSSES = tuple(LOSS_CONFIG_DEFAULTS)


def settings(loss_fn: str, config: dict[str, float] | None) -> dict[str, float]:
    """The loss's parameters: its defaults overridden by `config`. A key no RL loss reads (a misspelling) is an
    error; one that another loss reads is ignored, so a loop may pass one config whichever loss it names."""
    known = {k for defaults in LOSS_CONFIG_DEFAULTS.values() for k in defaults}
    unknown = sorted(set(config or {}) - known)
    if unknown:
        raise ValueError(f"loss_fn_config keys {unknown} are read by no RL loss; the keys are {sorted(known)}")
    defaults = LOSS_CONFIG_DEFAULTS[loss_fn]
    return {**defaults, **{k: v for k, v in (config or {}).items() if k in defaults}}


def policy_loss(
    loss_fn: str, logp_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float] | None
) -> torch.Tensor:
    """The summed loss over N target positions; `inputs` holds `logprobs` (q), `advantages` and, for gspo,
    `datum` (which datum each position belongs to)."""
    c = settings(loss_fn, config)
    q_N, adv_N = inputs["logprobs"], inputs["advantages"]
    ratio_N = torch.exp(logp_N - q_N)
    if loss_fn == "importance_sampling":
        return -(ratio_N * adv_N).sum()
    low, high = c.get("clip_low_threshold"), c.get("clip_high_threshold")
    if loss_fn == "ppo":
        return -torch.minimum(ratio_N * adv_N, ratio_N.clamp(low, high) * adv_N).sum()
    if loss_fn == "cispo":
        return -(ratio_N.clamp(low, high).detach() * logp_N * adv_N).sum()
    if loss_fn == "gspo":
        seq_N = _sequence_ratio(logp_N, inputs)
        return -torch.minimum(seq_N * adv_N, seq_N.clamp(low, high) * adv_N).sum()
    if loss_fn == "dppo":
        keep_N = ~_dppo_masked(logp_N, inputs, c)
        sampled_N = adv_N != 0
        penalty = ((logp_N - q_N) ** 2 * sampled_N).sum()
        return -(keep_N * ratio_N * adv_N).sum() + c["dppo_kl_tau"] * penalty
    raise ValueError(f"unknown RL loss_fn {loss_fn!r}; the local backend has {RL_LOSSES}")


def policy_metrics(
    loss_fn: str, logp_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float] | None
) -> dict[str, float]:
    """Over the sampled tokens: the mean ratio, the sampler-minus-trainer logp gap, and the share the loss clipped
    (ppo, cispo: token ratio outside the band; gspo: sequence ratio outside) or masked (dppo)."""
    active = inputs["advantages"] != 0
    if len(logp_N) == 0 or not active.any():
        return {}
    c = settings(loss_fn, config)
    ratio_N = torch.exp(logp_N - inputs["logprobs"])
    metrics = {
        "ratio_mean": float(ratio_N[active].mean()),
        "sampler_minus_train_logp": float((inputs["logprobs"] - logp_N)[active].mean()),
    }
    if loss_fn in ("ppo", "cispo", "gspo"):
        tested_N = _sequence_ratio(logp_N, inputs).detach() if loss_fn == "gspo" else ratio_N
        outside = (tested_N < c["clip_low_threshold"]) | (tested_N > c["clip_high_threshold"])
        metrics["clip_fraction"] = float(outside[active].float().mean())
    if loss_fn == "dppo":
        metrics["masked_fraction"] = float(_dppo_masked(logp_N, inputs, c)[active].float().mean())
    return metrics


def _sequence_ratio(logp_N: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per position: its datum's geometric-mean ratio over the datum's sampled tokens, with the gradient of the
    position's own logp (GSPO-token: sg(s)·exp(logp − sg(logp)))."""
    datum_N = inputs["datum"].long()
    active_N = (inputs["advantages"] != 0).to(logp_N.dtype)
    n_datums = int(datum_N.max()) + 1 if len(datum_N) else 0
    log_ratio_sum = torch.zeros(n_datums, dtype=logp_N.dtype, device=logp_N.device)
    log_ratio_sum.index_add_(0, datum_N, ((logp_N - inputs["logprobs"]) * active_N).detach())
    count = torch.zeros(n_datums, dtype=logp_N.dtype, device=logp_N.device).index_add_(0, datum_N, active_N)
    mean_log_ratio = log_ratio_sum / count.clamp(min=1)
    return torch.exp(mean_log_ratio[datum_N] + logp_N - logp_N.detach())


def _dppo_masked(logp_N: torch.Tensor, inputs: dict[str, torch.Tensor], c: dict[str, float]) -> torch.Tensor:
    """Tokens whose probability left the trust region in their advantage's direction (no gradient flows)."""
    with torch.no_grad():
        moved_N = torch.exp(logp_N) - torch.exp(inputs["logprobs"])
        adv_N = inputs["advantages"]
        return ((adv_N > 0) & (moved_N > c["dppo_mask_high"])) | ((adv_N < 0) & (moved_N < -c["dppo_mask_low"]))
