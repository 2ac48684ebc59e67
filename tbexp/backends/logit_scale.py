"""`model.logit_scale`: one trainable scalar that multiplies the logits, so RL can choose how sharply the policy acts.

Why it exists: a held-out eval samples at a fixed temperature, and a policy
scores better there when it is more certain of the replies it already ranks
first (the tiny model's seed-0 SFT checkpoint: held-out strict success 0.333
decoded greedily, 0.236 sampled at 0.7). LoRA cannot make it so: the
decoder's final RMSNorm fixes the scale of the hidden state the LM head reads,
and training the norm's per-dimension gains does not add up to a common
scale either (in GRPO they moved 4% in 12 steps: each gain's gradient
follows its own dimension, not the common factor). A single scale after the norm
gathers every token's push towards or away from certainty into one number.

The scale is exp(`log_scale`), starting at 1, so a model behaves as it
would without it until training moves it. It sits after the norm, where both the
teacher-forced logprobs and sampling read the hidden state, so the LM head's
weights and bias stay untouched (with a bias, the scale multiplies W·h only).
Which stage trains it, and how fast, is the optimizer's business
(`LocalBackend`'s `logit_scale_lr_factor`): GRPO does, SFT leaves it at 1.
"""

from __future__ import annotations

from typing import Any

import torch

PARAMETER = "log_scale"


class ScaledNorm(torch.nn.Module):
    """The decoder's final norm followed by a learnt scalar factor exp(log_scale)."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.norm = norm
        self.log_scale = torch.nn.Parameter(torch.zeros((), dtype=torch.float32))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden) * self.log_scale.exp().to(hidden.dtype)


def add_logit_scale(lm) -> None:
    """Wrap the final norm of causal LM `lm`'s decoder in place."""
    decoder = lm.get_decoder()
    if not isinstance(getattr(decoder, "norm", None), torch.nn.Module):
        raise ValueError(
            f"model.logit_scale needs a decoder with a final `norm` module; {type(decoder).__name__} has none: set model.logit_scale=false"
        )
    if not isinstance(decoder.norm, ScaledNorm):
        decoder.norm = ScaledNorm(decoder.norm)


def is_logit_scale(name: str) -> bool:
    return name.endswith(f"norm.{PARAMETER}")


class ScaledReference:
    """A sampler's weights at another backend's current logit scale: its logits times (the backend's scale now /
    its scale when this was made). GRPO's KL reference with grpo.kl_scaled_reference: the starting weights as
    sharp as the policy is now, so the penalty holds what the LoRA changed, not how sharply the policy samples."""

    def __init__(self, sampler: Any, backend: Any) -> None:
        self.sampler, self.backend = sampler, backend
        self.start_scale = backend.logit_scale()

    def compute_logprobs(self, prompt: Any) -> Any:
        return self.sampler.compute_logprobs(prompt, logit_scale=self.backend.logit_scale() / self.start_scale)
