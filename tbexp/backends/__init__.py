"""Training backends: one interface (`base.TrainingBackend`), run locally or on Tinker."""

from tbexp.backends.base import LOSSES, Done, ForwardBackwardResult, Future, SampledSequence, Sampler, TrainingBackend

__all__ = ["LOSSES", "Done", "ForwardBackwardResult", "Future", "SampledSequence", "Sampler", "TrainingBackend"]
