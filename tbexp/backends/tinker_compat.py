"""Where the tinker SDK tbexp ships and a Tinker-API server disagree, tbexp copes here, each case named by its pair.

Seen with tinker SDK 0.38.0 (requirements.lock) against SkyRL 0.4.0's Tinker server (which pins SDK 0.25.0), its JAX
backend (tests/test_tinker_server.py runs them all against that server):

* sample replies: SDK 0.38 stamps each sampled sequence with the `sample_sequence_ids` that the submission's
  promise carries and asserts they are there; SkyRL 0.4.0 sends none, so every `sample` and `compute_logprobs`
  failed. `allow_replies_without_sequence_ids` stamps made-up ids instead (tbexp never reads them).
* `compute_logprobs`: Tinker gives one logprob per prompt token, None first (nothing predicts the first token);
  SkyRL 0.4.0 sends the n - 1 real ones only, so each would sit one token early (GRPO's KL to the reference read
  the wrong tokens' logprobs). `aligned_prompt_logprobs` puts the None back.
* sampling seeds: SkyRL 0.4.0 takes seeds below 2**31 only; tbexp's per-reply seeds are crc32 values, up to 2**32.
  `fold_seed` folds them in (the draw stays a fixed function of task, run and turn).
* `ServiceClient.create_training_client_from_state[_with_optimizer]` (SDK 0.38) sends `load_weights` with a
  `model_seq_id`; SkyRL 0.4.0 wants a `model_id` and answers 422. `training_client_from_state` falls back to a new
  LoRA client of the checkpoint's run (its base model and rank) and the older `load_state[_with_optimizer]`.
* `forward_backward` metrics: SkyRL 0.4.0 sends no `loss:sum`, only each datum's `elementwise_loss` (already weighted
  and masked, as Tinker defines it); `summed_loss` adds them up.
* the export (`save_weights_external`): 404 on SkyRL 0.4.0; adapters.export_tinker's caller keeps the checkpoint
  and says so (tinker_backend.TinkerBackend.export_checkpoint).
* `gspo`: SkyRL 0.4.0's JAX backend answers 400; tinker_backend.probe_loss refuses it by name before any work.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Callable

log = logging.getLogger(__name__)

SEED_LIMIT = 2**31  # SkyRL 0.4.0 refuses sampling seeds from here up


def fold_seed(seed: int | None) -> int | None:
    """`seed` below 2**31, unchanged when it already is.

    >>> fold_seed(5), fold_seed(2**31 + 5), fold_seed(None)
    (5, 5, None)
    """
    return None if seed is None else seed % SEED_LIMIT


def aligned_prompt_logprobs(logprobs: list[float | None], n_tokens: int) -> list[float | None]:
    """One logprob per prompt token, None first, whether the server sent n_tokens of them or the n_tokens - 1 after
    the first.

    >>> aligned_prompt_logprobs([-1.0, -2.0], 3), aligned_prompt_logprobs([None, -1.0, -2.0], 3)
    ([None, -1.0, -2.0], [None, -1.0, -2.0])
    """
    if len(logprobs) == n_tokens - 1:
        return [None, *logprobs]
    if len(logprobs) != n_tokens:
        raise ValueError(f"the server sent {len(logprobs)} prompt logprobs for {n_tokens} tokens")
    return list(logprobs)


def allow_replies_without_sequence_ids() -> None:
    """Let SDK 0.38's sampling client accept replies without `sample_sequence_ids` (SkyRL 0.4.0 sends none). Replies
    that carry them are stamped exactly as before. Idempotent."""
    from tinker.lib.public_interfaces import sampling_client

    attach = sampling_client._attach_sequence_ids
    if getattr(attach, "tbexp_compat", False):
        return

    def attach_or_make_up(response: Any, sample_sequence_ids: list[str] | None) -> Any:
        if sample_sequence_ids is None:
            sample_sequence_ids = [f"tbexp-{uuid.uuid4().hex}" for _ in response.sequences]
        return attach(response, sample_sequence_ids)

    attach_or_make_up.tbexp_compat = True  # type: ignore[attr-defined]
    sampling_client._attach_sequence_ids = attach_or_make_up


def summed_loss(output: Any) -> float:
    """The batch's summed loss: the server's `loss:sum`, else the sum of every datum's `elementwise_loss`."""
    metrics = dict(output.metrics or {})
    if "loss:sum" in metrics:
        return float(metrics["loss:sum"])
    parts = [o["elementwise_loss"].tolist() for o in output.loss_fn_outputs if "elementwise_loss" in o]
    return float(sum(sum(p) for p in parts)) if parts else float("nan")


def training_client_from_state(service: Any, rest: Callable[[], Any], path: str, optimizer: bool, **lora: Any) -> Any:
    """A training client on `path`'s weights (and its optimizer state with `optimizer`), through the SDK's
    `create_training_client_from_state[_with_optimizer]`; where the server refuses that call's shape (422, SkyRL
    0.4.0), a new LoRA client of the checkpoint's run (`rest()`: a RestClient, which tells its base model and rank; `lora`: the
    create call's other switches) loaded the older way."""
    import tinker

    create = (
        service.create_training_client_from_state_with_optimizer
        if optimizer
        else service.create_training_client_from_state
    )
    try:
        return _resolved(create(path))
    except tinker.UnprocessableEntityError as err:
        log.info("the server refused create_training_client_from_state (%s); loading %s into a new client", err, path)
    run = _resolved(rest().get_training_run_by_tinker_path(path))
    client = _resolved(service.create_lora_training_client(run.base_model, rank=run.lora_rank, **lora))
    (client.load_state_with_optimizer if optimizer else client.load_state)(path).result()
    return client


def _resolved(value: Any) -> Any:
    return value.result() if hasattr(value, "result") else value
