"""`backend=tinker`: the Tinker service through its SDK, behind tbexp's backend interface.

The SDK already has the right shape; this adapter only maps its outputs to
`ForwardBackwardResult` / `SampledSequence`, keeps futures unresolved so a
loop can pipeline `forward_backward` and `optim_step`, and refuses settings
the service cannot honour (full fine-tuning, LoRA dropout, a logit scale,
per-module targets beyond attention / MLP / unembedding) instead of
ignoring them.
Losses: cross_entropy, importance_sampling, ppo, cispo and gspo are Tinker's own
server-side losses, sent with every `loss_fn_config` key filled in (rl_losses.py's
defaults), so a run means the same thing on both backends. `dppo` is refused by
name: Tinker does not serve it, and emulating it through `forward_backward_custom`
would cost a second forward pass a step.
Checkpoints are `tinker://` URIs; a run resumes from one with its optimizer.
`export_checkpoint` downloads one and writes it as a PEFT adapter (adapters.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tinker import types

from tbexp.backends import tinker_compat
from tbexp.backends.base import (
    Export,
    ForwardBackwardResult,
    Future,
    SampledSequence,
    Sampler,
    TrainingBackend,
)
from tbexp.backends.rl_losses import settings
from tbexp.errors import TbexpError

ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP = {"gate_proj", "up_proj", "down_proj", "mlp", "experts"}
TTL_RANGE_S = (3600, 315_360_000)  # a saved checkpoint's time to live, as tinker 0.38's save_state documents it
log = logging.getLogger(__name__)
TINKER_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "gspo")  # served by Tinker itself


class BackendError(TbexpError, RuntimeError):
    """A backend that cannot start with these settings; the message says what to change."""


@dataclass
class _Mapped:
    """A future whose result is converted when it is finally asked for."""

    future: Any
    convert: Callable[[Any], Any]

    def result(self) -> Any:
        return self.convert(self.future.result())


class TinkerBackend(TrainingBackend):
    def __init__(
        self,
        base_model: str,
        *,
        lora_rank: int,
        lora_dropout: float = 0.0,
        lora_targets: list[str] | None = None,
        lora_target_parameters: list[str] | None = None,
        logit_scale: bool = False,
        seed: int = 0,
        base_url: str = "",
        load_checkpoint: str = "",
        checkpoint_ttl_s: int = 0,
        service_client: Any = None,
    ):
        if lora_rank <= 0:
            raise BackendError("backend=tinker trains LoRA adapters only: set model.lora_rank > 0")
        if lora_dropout:
            raise BackendError(f"backend=tinker has no LoRA dropout: set model.lora_dropout=0 (got {lora_dropout})")
        if logit_scale:
            raise BackendError(
                "backend=tinker trains LoRA adapters only, not a logit scale: set model.logit_scale=false"
            )
        if checkpoint_ttl_s and not TTL_RANGE_S[0] <= checkpoint_ttl_s <= TTL_RANGE_S[1]:
            raise BackendError(
                f"backend.checkpoint_ttl_s={checkpoint_ttl_s}: the service keeps a checkpoint from {TTL_RANGE_S[0]} s "
                f"(an hour) to {TTL_RANGE_S[1]} s (ten years); 0 keeps it until it is deleted"
            )
        self.ttl_s = checkpoint_ttl_s or None  # None: the SDK's "never expires"
        unknown = set(lora_targets or ()) - ATTENTION - MLP - {"lm_head", "unembed"}
        if unknown:
            raise BackendError(
                f"backend=tinker chooses LoRA modules only as attention / MLP / unembedding; cannot target {sorted(unknown)}"
            )
        if service_client is None:
            service_client = _connect(base_url)
        self.service, self.base_model = service_client, base_model  # export_checkpoint needs both
        self.base_url = base_url
        # Tinker's defaults (attention, MLP and unembedding) unless the model names its modules. A model whose MLP
        # weights are not nn.Linear modules names them in lora_target_parameters (gpt-oss's experts): MLP too.
        named = set(lora_targets or ()) | {p.split(".")[0] for p in lora_target_parameters or ()}
        self.lora = (
            {}
            if lora_targets is None
            else {
                "train_attn": bool(named & ATTENTION),
                "train_mlp": bool(named & MLP),
                "train_unembed": bool(named & {"lm_head", "unembed"}),
            }
        )
        self.lora_rank, self.seed = lora_rank, seed
        self._client: Any = None  # made at first use: from a checkpoint when load_* comes first (one client, not two)
        self._tokenizer: Any = None
        if load_checkpoint.startswith("tinker://"):
            self.load_state(load_checkpoint)

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = self.service.create_lora_training_client(
                self.base_model, rank=self.lora_rank, seed=self.seed, **self.lora
            ).result()
        return self._client

    @property
    def tokenizer(self) -> Any:  # type: ignore[override]
        if self._tokenizer is None:
            self._tokenizer = self.client.get_tokenizer()
        return self._tokenizer

    def forward_backward(
        self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> Future[ForwardBackwardResult]:
        config = _tinker_loss_config(loss_fn, loss_fn_config)
        n_tokens = sum(_n_tokens(d, loss_fn) for d in data)
        data = _with_sequence_ratio_mask(data) if loss_fn == "gspo" else data
        return _Mapped(self.client.forward_backward(data, loss_fn, config), lambda out: _fb_result(out, n_tokens))

    def forward(
        self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> Future[ForwardBackwardResult]:
        config = _tinker_loss_config(loss_fn, loss_fn_config)
        n_tokens = sum(_n_tokens(d, loss_fn) for d in data)
        data = _with_sequence_ratio_mask(data) if loss_fn == "gspo" else data
        return _Mapped(self.client.forward(data, loss_fn, config), lambda out: _fb_result(out, n_tokens))

    def optim_step(self, adam: types.AdamParams) -> Future[dict[str, float]]:
        return _Mapped(self.client.optim_step(adam), lambda out: dict(out.metrics or {}))

    def sampler(self) -> Sampler:
        return TinkerSampler(self.client.save_weights_and_get_sampling_client().result())

    def save_state(self, name: str) -> str:
        """The state (weights and optimizer) at `tinker://…/weights/name`, and the weights for sampling beside it
        at `…/sampler_weights/name`, where `sampling_client` finds them: an eval then needs no training client."""
        sampler_save = self.client.save_weights_for_sampler(name, ttl_seconds=self.ttl_s)
        path = self.client.save_state(name, ttl_seconds=self.ttl_s).result().path
        sampler_save.result()
        return path

    def load_state(self, path: str) -> None:
        if not path.startswith("tinker://"):
            raise BackendError(f"backend=tinker resumes only from tinker:// checkpoints, not {path!r}")
        self._from_state(path, optimizer=True)

    def load_weights(self, path: str) -> None:
        if not path.startswith("tinker://"):
            raise BackendError(f"backend=tinker starts only from tinker:// checkpoints, not {path!r}")
        self._from_state(path, optimizer=False)

    def _from_state(self, path: str, optimizer: bool) -> None:
        """A new training client on `path` through create_training_client_from_state* (SDK 0.38 deprecates loading
        into an existing client); a client made before (a resumed run's reference sampler came from it) is left to
        the service's session time-out."""
        import tinker

        self._client = tinker_compat.training_client_from_state(
            self.service,
            lambda: tinker.RestClient(base_url=self.base_url or None),
            path,
            optimizer,
            seed=self.seed,
            **self.lora,
        )

    def delete_checkpoint(self, checkpoint: str) -> None:
        """The service's copies of `checkpoint` (its state and the sampler weights beside it) deleted: stored
        checkpoints are kept, and billed, until deleted. A failure is logged, not raised: the run goes on."""
        import tinker

        if not checkpoint.startswith("tinker://"):
            raise BackendError(f"backend=tinker deletes only tinker:// checkpoints, not {checkpoint!r}")
        for path in (checkpoint, checkpoint.replace("/weights/", "/sampler_weights/", 1)):
            try:
                tinker.RestClient(base_url=self.base_url or None).delete_checkpoint_from_tinker_path(path).result()
            except Exception as err:  # noqa: BLE001 - a copy left behind costs storage, not the run
                log.warning("could not delete %s from the Tinker service (%s)", path, err)

    def export_checkpoint(self, checkpoint: str, folder: str) -> Export:
        """`checkpoint` downloaded from the service and written as a PEFT adapter in `folder/adapter`."""
        from tbexp.backends.adapters import export_tinker

        try:
            return export_tinker(self.service, checkpoint, Path(folder), self.base_model, self.tokenizer, self.base_url)
        except Exception as err:  # noqa: BLE001 - the trained checkpoint is the stage's result; the export a copy
            return Export("", "none", self.base_model, error=f"{type(err).__name__}: {err}", checkpoint=checkpoint)


def sampling_client(service_client: Any, base_model: str, checkpoint: str = "") -> TinkerSampler:
    """A sampling client over `checkpoint`'s weights ("" = `base_model`'s), made by the service, with no training
    client behind it. A checkpoint is a `save_state` URI; its sampler weights were saved beside it (`save_state`)."""
    if not checkpoint:
        return TinkerSampler(service_client.create_sampling_client(base_model=base_model).result())
    if not checkpoint.startswith("tinker://") or "/weights/" not in checkpoint:
        raise BackendError(
            f"backend=tinker samples from tinker://…/weights/… checkpoints (saved by save_state), not {checkpoint!r}"
        )
    return TinkerSampler(
        service_client.create_sampling_client(
            model_path=checkpoint.replace("/weights/", "/sampler_weights/", 1)
        ).result()
    )


class TinkerSampler(Sampler):
    def __init__(self, client: Any):
        self.client = client

    @property
    def tokenizer(self) -> Any:
        return self.client.get_tokenizer()

    def sample(
        self, prompt: types.ModelInput, num_samples: int, params: types.SamplingParams
    ) -> Future[list[SampledSequence]]:
        def convert(response: Any) -> list[SampledSequence]:
            return [
                SampledSequence(list(s.tokens), list(s.logprobs or []), str(s.stop_reason)) for s in response.sequences
            ]

        if params.seed is not None:
            params = params.model_copy(update={"seed": tinker_compat.fold_seed(params.seed)})
        return _Mapped(self.client.sample(prompt=prompt, num_samples=num_samples, sampling_params=params), convert)

    def compute_logprobs(self, prompt: types.ModelInput) -> Future[list[float | None]]:
        n_tokens = prompt.length
        return _Mapped(
            self.client.compute_logprobs(prompt), lambda out: tinker_compat.aligned_prompt_logprobs(out, n_tokens)
        )


def _connect(base_url: str) -> Any:
    """A ServiceClient, once the SDK has found a credential its own way: TINKER_API_KEY, TINKER_CREDENTIAL_CMD, or the
    key `tinker auth login` stored. A ServiceClient looks only at its first call, after a job's first stage; the SDK's
    resolver (private in 0.38) looks now, without the network."""
    import tinker
    from tinker.lib._auth_token_provider import resolve_auth_provider

    try:
        resolve_auth_provider(None, enforce_cmd=False)
    except tinker.TinkerError as err:
        raise BackendError(
            f"backend=tinker found no Tinker credential ({err}): export TINKER_API_KEY=tml-... (from the Tinker "
            "console), run `tinker auth login`, or set TINKER_CREDENTIAL_CMD; or use backend=local"
        ) from None
    tinker_compat.allow_replies_without_sequence_ids()
    return tinker.ServiceClient(base_url=base_url or None)


def probe_service(service: Any, base_url: str, base_model: str, losses: list[str]) -> None:
    """BackendError, naming what to change, when the service at `base_url` does not serve `base_model` or refuses
    one of `losses` (each tried as one forward pass on a two-token datum, through a training client made for it)."""
    import tinker

    served = [
        m.model_name
        for m in tinker.RestClient(base_url=base_url or None).get_server_capabilities().result().supported_models
    ]
    if base_model not in served:
        raise BackendError(
            f"the Tinker service {base_url or '(default)'} does not serve model {base_model!r}; it serves: "
            + ", ".join(served)
        )
    rl = [loss for loss in losses if loss != "cross_entropy"]
    if not rl:
        return
    for loss in rl:
        _tinker_loss_config(loss, None)  # refused here already when no Tinker server has it (dppo)
    client = service.create_lora_training_client(base_model, rank=1).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([0, 0]),
        loss_fn_inputs={"target_tokens": [0, 0], "logprobs": [0.0, 0.0], "advantages": [0.0, 0.0]},
    )
    for loss in rl:
        try:
            client.forward([datum], loss, _tinker_loss_config(loss, None)).result()
        except Exception as err:  # noqa: BLE001 - the SDK wraps the server's 400 in a ValueError after its retries
            raise BackendError(
                f"grpo.loss_fn={loss}: the Tinker service {base_url or '(default)'} refuses it ({err}); "
                "choose another loss it serves (SkyRL's JAX backend: importance_sampling, ppo, cispo)"
            ) from None


def _tinker_loss_config(loss_fn: str, config: dict[str, float] | None) -> dict[str, float] | None:
    """The loss's config for Tinker's server, every key it reads filled in; a loss Tinker lacks is refused."""
    if loss_fn == "dppo":
        raise BackendError(
            "loss_fn=dppo runs on backend=local only: Tinker serves no DPPO loss. "
            "Set grpo.loss_fn to one Tinker serves: " + ", ".join(TINKER_LOSSES[1:])
        )
    if loss_fn not in TINKER_LOSSES:
        raise ValueError(f"loss_fn={loss_fn!r}: choose one of {TINKER_LOSSES}")
    return config if loss_fn == "cross_entropy" else settings(loss_fn, config)


def _with_sequence_ratio_mask(data: list[types.Datum]) -> list[types.Datum]:
    """gspo's datums with `sequence_ratio_mask` (a loss_fn_inputs key of SDK 0.38): 1 on the sampled tokens, the
    ones with an advantage, as rl_losses.py's gspo averages its sequence ratio over. Without it a server may
    average over every position, prompt and observations included, where tbexp sends a logprob of 0."""
    out = []
    for d in data:
        inputs = dict(d.loss_fn_inputs)
        if "sequence_ratio_mask" not in inputs and "advantages" in inputs:
            inputs["sequence_ratio_mask"] = [float(a != 0) for a in inputs["advantages"].tolist()]
        out.append(types.Datum(model_input=d.model_input, loss_fn_inputs=inputs))
    return out


def _n_tokens(datum: types.Datum, loss_fn: str) -> float:
    inputs = datum.loss_fn_inputs
    if loss_fn == "cross_entropy" and "weights" in inputs:
        return float(sum(inputs["weights"].tolist()))
    return float(len(inputs["target_tokens"].tolist()))


def _fb_result(output: Any, n_tokens: float) -> ForwardBackwardResult:
    metrics = dict(output.metrics or {})
    logprobs = [o["logprobs"].tolist() for o in output.loss_fn_outputs if "logprobs" in o]
    return ForwardBackwardResult(
        loss=tinker_compat.summed_loss(output), n_tokens=n_tokens, logprobs=logprobs, metrics=metrics
    )
