"""The training-backend interface, shaped like Tinker's primitives.

Training loops are written once against this interface and run unchanged
on `backend=local` (transformers + peft in this process) and
`backend=tinker` (the Tinker service). Data is `tinker.types`: a `Datum`
holds `model_input` (tokens[:-1]) and `loss_fn_inputs` (`target_tokens`,
`weights` for cross-entropy; `target_tokens`, `logprobs`, `advantages` for
the RL losses). Position i of `model_input` predicts `target_tokens[i]`.

Calls return futures (objects with `.result()`), as Tinker's do, so a loop
can submit `forward_backward` and `optim_step` before waiting on either; a
local backend may do the work eagerly and return a finished future. Losses
are **sums** over tokens, never means, exactly as Tinker defines them:

* `cross_entropy`: −Σ w·logp(target)
* `importance_sampling`: −Σ exp(logp − q)·A, with q the sampler's logprobs
* `ppo`: −Σ min(r·A, clip(r, 1−ε_low, 1+ε_high)·A), r = exp(logp − q);
  thresholds from `loss_fn_config` (`clip_low_threshold`, `clip_high_threshold`,
  default 0.8 / 1.2 as absolute ratio bounds).
* `cispo`, `gspo` (served by Tinker too) and `dppo` (the local backend only):
  rl_losses.py states each definition and its `loss_fn_config` keys.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from tinker import types

T = TypeVar("T")
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "dppo")


class Future(Protocol[T]):
    def result(self) -> T: ...


@dataclass
class Done(Generic[T]):
    """A future that is already resolved (local work runs eagerly)."""

    value: T

    def result(self) -> T:
        return self.value


@dataclass
class ForwardBackwardResult:
    loss: float  # the summed loss of the batch
    n_tokens: float  # Σ weights (cross_entropy) or number of target tokens (RL losses)
    logprobs: list[list[float]] = field(default_factory=list)  # per datum, logp of each target token
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Export:
    """A checkpoint written for use without tbexp (`export_checkpoint`; backends/adapters.py says how)."""

    path: str
    kind: str  # "adapter": PeftModel.from_pretrained(base, path) loads it; "hf_model": a whole model (full fine-tuning)
    base_model: str  # the base model's Hub id or directory, as the adapter's config names it
    error: str = ""  # kind "none": the export failed with this, and nothing was written; `checkpoint` is still there
    checkpoint: str = ""

    def describe(self) -> str:
        """What was written and the lines that load it."""
        if self.kind == "none":
            return f"export failed ({self.error}); the trained checkpoint is kept: {self.checkpoint}"
        if self.kind == "adapter":
            return (
                f"PEFT adapter: {self.path}\n  load it with PeftModel.from_pretrained("
                f"AutoModelForCausalLM.from_pretrained({self.base_model!r}), {self.path!r})"
            )
        return (
            f"full fine-tuning has no adapter to export; the whole model in Hugging Face format: {self.path}\n"
            f"  load it with AutoModelForCausalLM.from_pretrained({self.path!r})"
        )


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]  # logp of each sampled token under the *untempered* model (as Tinker reports)
    stop_reason: str  # "stop" (a stop sequence or EOS) | "length"


class Sampler(abc.ABC):
    """Samples from a fixed set of weights (a snapshot: later training does not change it)."""

    tokenizer: Any  # the base model's tokenizer, which the renderer needs

    @abc.abstractmethod
    def sample(
        self, prompt: types.ModelInput, num_samples: int, params: types.SamplingParams
    ) -> Future[list[SampledSequence]]: ...

    @abc.abstractmethod
    def compute_logprobs(self, prompt: types.ModelInput) -> Future[list[float | None]]:
        """logp of each prompt token given the ones before it (None for the first), as Tinker's SamplingClient."""


class TrainingBackend(abc.ABC):
    """One trainable model (LoRA or full) plus its optimizer state."""

    tokenizer: Any  # a Hugging Face tokenizer for the base model

    @abc.abstractmethod
    def forward_backward(
        self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> Future[ForwardBackwardResult]:
        """Add this batch's gradients (they accumulate until `optim_step`)."""

    @abc.abstractmethod
    def forward(
        self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> Future[ForwardBackwardResult]:
        """The same loss and logprobs without gradients (held-out NLL)."""

    @abc.abstractmethod
    def optim_step(self, adam: types.AdamParams) -> Future[dict[str, float]]:
        """One AdamW step with Tinker's `AdamParams` fields; clears the gradients."""

    @abc.abstractmethod
    def sampler(self) -> Sampler:
        """A sampler over the current weights (Tinker: save_weights_and_get_sampling_client)."""

    @abc.abstractmethod
    def save_state(self, name: str) -> str:
        """Save weights, optimizer state, step and RNG; return a path or `tinker://` URI."""

    @abc.abstractmethod
    def load_state(self, path: str) -> None:
        """Restore what `save_state` saved, exactly."""

    @abc.abstractmethod
    def load_weights(self, path: str) -> None:
        """Only the weights of a saved state, with a fresh optimizer: a new stage starting from a checkpoint."""

    def delete_checkpoint(self, checkpoint: str) -> None:
        """Remove a superseded `save_state` checkpoint (a local directory here; a service's stored copy on Tinker)."""
        import shutil

        shutil.rmtree(checkpoint, ignore_errors=True)

    def export_checkpoint(self, checkpoint: str, folder: str) -> Export:
        """Write `checkpoint` (a `save_state` path or URI) for use without tbexp: a PEFT adapter in `folder/adapter`
        that `PeftModel.from_pretrained(base, folder/adapter)` loads, or, where there is no adapter (full
        fine-tuning), the whole model in Hugging Face format in `folder/hf_model`."""
        raise NotImplementedError(f"{type(self).__name__} cannot export checkpoints")
