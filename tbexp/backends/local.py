"""`backend=local`: a transformers model (LoRA through peft, or full fine-tuning) trained in this process.

This module holds the backend, its sampler, and how datums become micro-batches
and losses; the speed and memory knobs (bf16, compiled layers, the packed
attention kernel, SDPA's kernel choice, checkpointing) live in local_speed.py.

forward_backward: datums are sorted by length and grouped into micro-batches
of at most `microbatch_tokens` padded tokens, right-padded with an attention
mask (causal attention means real positions never see the padding, so each
datum's logprobs equal those of running it alone); a micro-batch of equal
lengths gets no mask, so SDPA runs its plain causal (flash) kernel. With
`packing`, a micro-batch is instead one row of concatenated datums (at most
`microbatch_tokens` real tokens) whose position_ids restart at each datum,
and during these passes the model's attention is local_speed.py's
`_packed_attention`: each datum attends only within itself, so no compute
goes to padding and no [T, T] mask is built. Sampling keeps the model's own
attention. The decoder gives hidden states; the target logprobs come from
the LM head a chunk of positions at a time (`logprobs.py`), so [T, V] logits
never exist whole. Each micro-batch's loss — a sum over tokens, as Tinker
defines it — is backpropagated at once, and gradients add up until
`optim_step`. Inputs go to the device before any work is queued and the
losses and logprobs stay there until the call's end, so a call syncs with
the device once. The whole call runs eagerly; the returned future is
already done. With `train_threads`, forward_backward, forward and optim_step
run on that many torch CPU threads (sampling keeps the process's setting; a
callable is asked before each call, so a job can follow its share of the cores):
the stages update only between rollouts, when the sandboxes' cores are free.

GPU knobs (`dtype`, `compile_backend`, `logprob_chunk_tokens`,
`sdpa_backend`, `cuda_graph_sampling`) are all off by default; local_speed.py
says what each does. On a GPU the backend plans its memory when it is built
(memory_plan.py): weights, the training pass of one micro-batch and the KV
pool within `gpu_memory_fraction` of the card, refused at once if they cannot
fit; `gradient_checkpointing=None` (per decoder layer) is then on where the
plan needs it, and off on a CPU, where no plan is made.
With `continuous_batching`, every request of every sampler (`sample`,
`sample_batch`, `request_queue`) joins the backend's one running batch
(continuous_batching.py: paged KV cache of `kv_cache_tokens`, by default what
the plan leaves, at most `max_concurrent_sequences` rows, LoRA merged once per
sampler snapshot).

optim_step: torch AdamW with Tinker's `AdamParams` (decoupled weight decay,
global-norm clipping when `grad_clip_norm` > 0), hyperparameters set afresh
each step so a schedule lives with the caller. With `logit_scale`
(logit_scale.py), that scalar is a second group whose lr is the step's times
`logit_scale_lr_factor` (0, the default, keeps it at 1), and each step reports it.

sampler: a snapshot that costs nothing until the weights change; before the
next optim_step or load_state, live snapshots get a copy of the trainable
tensors (the LoRA weights, or every weight under full fine-tuning) and swap
them in while they sample. One lock serialises training and sampling.

export_checkpoint(checkpoint, folder): that checkpoint as a PEFT adapter (or,
under full fine-tuning, a whole Hugging Face model), the logit scale folded
in (adapters.py).

save_state(name) writes `save_dir/name/`: `trainable.safetensors` (trainable
parameters by name), `optimizer.pt`, `state.pt` (step and the torch CPU/CUDA,
Python and NumPy RNG states) and `meta.json`. Frozen base weights are not
saved: `load_state` expects a backend built on the same base model.
The constructor takes ownership of `model` (peft modifies it in place);
`seed` seeds only the LoRA initialisation (the caller seeds the run).
"""

from __future__ import annotations

import copy
import json
import logging
import random
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from tinker import types

from tbexp.backends import memory_plan
from tbexp.backends.base import (
    LOSSES,
    Done,
    Export,
    ForwardBackwardResult,
    Future,
    SampledSequence,
    Sampler,
    TrainingBackend,
)
from tbexp.backends.batch_sampling import BatchQueue, Request, sample_batch
from tbexp.backends.continuous_batching import SEED_STRIDE, ContinuousBatcher, sequence_limit
from tbexp.backends.local_speed import (
    PACKED_ATTENTION,
    _attention_implementation,
    _cast_weights,
    _compile_layers,
    _enable_checkpointing,
    _register_packed_attention,
    _sdpa_first,
)
from tbexp.backends.logit_scale import add_logit_scale, is_logit_scale
from tbexp.backends.logprobs import target_logprobs
from tbexp.backends.rl_losses import policy_loss, policy_metrics
from tbexp.backends.sampling import sample_sequences

RL_INPUTS = ("target_tokens", "logprobs", "advantages")
log = logging.getLogger(__name__)


class LocalBackend(TrainingBackend):
    def __init__(
        self,
        model,
        tokenizer,
        *,
        lora_rank: int,
        lora_alpha: float,
        lora_dropout: float,
        lora_targets: list[str],
        lora_target_parameters: list[str] | None = None,
        logit_scale: bool = False,
        logit_scale_lr_factor: float = 0.0,
        merge_for_sampling: bool | None = None,
        device: str = "auto",
        seed: int = 0,
        save_dir: str | Path,
        microbatch_tokens: int = 8192,
        gradient_checkpointing: bool | None = None,
        packing: bool = False,
        dtype: str | None = None,
        compile_backend: str | None = None,
        logprob_chunk_tokens: int | None = None,
        sdpa_backend: str | None = None,
        cuda_graph_sampling: bool = False,
        train_threads: int | Callable[[], int] | None = None,
        continuous_batching: bool = False,
        kv_cache_tokens: int = 0,
        max_concurrent_sequences: int = 256,
        max_sequence_tokens: int = 0,
        gpu_memory_fraction: float = memory_plan.DEFAULT_FRACTION,
    ):
        _check_plain_lm_head(model.config)
        self.tokenizer = tokenizer
        self.device = torch.device(
            "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
        )
        self.save_dir = Path(save_dir)
        self.microbatch_tokens = microbatch_tokens
        self.lora_rank = lora_rank
        self.packing = packing
        # A private merged copy per sampler pays off where per-layer overhead dominates: small models on a CPU.
        small = sum(p.numel() for p in model.parameters()) < 50_000_000
        self.merge_for_sampling = (
            (self.device.type == "cpu" and small) if merge_for_sampling is None else merge_for_sampling
        )
        self.compile_backend, self.logprob_chunk_tokens, self.sdpa_backend = (
            compile_backend,
            logprob_chunk_tokens,
            sdpa_backend,
        )
        self.cuda_graph_sampling = cuda_graph_sampling
        self.train_threads = train_threads
        self.continuous_batching = continuous_batching
        # The running batch's longest sequence is the model config's context limit (model.max_length_tokens), not
        # the checkpoint's max_position_embeddings: a terminus-2 conversation may outgrow the latter.
        self._batcher_options = {
            "kv_cache_tokens": kv_cache_tokens,
            "max_batch": max_concurrent_sequences,
            "max_seq_tokens": max_sequence_tokens,
        }
        self._batcher: ContinuousBatcher | None = None  # built by the first sampler needing it; kept across snapshots
        self.dtype = getattr(torch, dtype) if dtype else None
        if self.dtype is not None:  # before the move, so the device never holds the wider copy
            base_dtype = self.dtype if lora_rank > 0 else torch.float32  # under full fine-tuning every weight trains
            _cast_weights(model, frozen=base_dtype, trainable=base_dtype)
        model = model.to(self.device)
        # On a GPU, one budget for training and sampling (memory_plan.py): refused here, before any step, if it
        # cannot fit; `gradient_checkpointing=None` lets the plan decide (never on a CPU).
        self.memory_plan, self.gradient_checkpointing = memory_plan.for_backend(
            model.config,
            weight_bytes=(self.dtype or next(model.parameters()).dtype).itemsize,
            training=memory_plan.Training(
                microbatch_tokens,
                bool(gradient_checkpointing),
                lora_rank,
                tuple(lora_targets),
                logprob_chunk_tokens or 0,
                longest_datum_tokens=sequence_limit(model.config, max_sequence_tokens),
            ),
            sampling=memory_plan.Sampling(
                continuous_batching,
                max_concurrent_sequences,
                sequence_limit(model.config, max_sequence_tokens),
                kv_cache_tokens,
            ),
            card_bytes=_card_bytes(self.device),
            fraction=gpu_memory_fraction,
            checkpointing=gradient_checkpointing,
        )
        if self.memory_plan is not None:
            log.info("GPU memory: %s", self.memory_plan.describe())
        if self.gradient_checkpointing:
            _enable_checkpointing(model)
        if lora_rank > 0:
            # target_parameters reaches weights that are not nn.Linear modules (gpt-oss's 3-D expert tensors).
            config = LoraConfig(
                r=lora_rank,
                lora_alpha=lora_alpha,
                lora_dropout=lora_dropout,
                target_modules=list(lora_targets),
                target_parameters=list(lora_target_parameters or []) or None,
                bias="none",
                task_type="CAUSAL_LM",
            )
            with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
                torch.manual_seed(seed)  # LoRA's A init; the global RNG stream is left alone
                with warnings.catch_warnings():  # peft 0.21 reads a property transformers 5 deprecated
                    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
                    model = get_peft_model(model, config)
            self._lm = model.get_base_model()
        else:
            self._lm = model
        if logit_scale:
            add_logit_scale(self._lm)
        self.model = model
        self.model.train()
        if self.dtype is not None:
            _cast_weights(model, frozen=self.dtype, trainable=torch.float32)
        if packing:
            _register_packed_attention()
        if compile_backend:
            _compile_layers(self._lm, compile_backend)
        if not isinstance(self._lm.get_output_embeddings(), torch.nn.Linear):
            raise ValueError("the LM head must be a plain nn.Linear (LoRA on lm_head is not supported)")
        self._params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        # The trainable weights as built (on the CPU): `restart` and the base model's sampler go back to them.
        self._initial = {n: p.detach().cpu().clone() for n, p in self._params.items()}
        self._scale_name = next((n for n in self._params if is_logit_scale(n)), None)
        # lr factor of each optimizer group: the adapters (or every weight), then the logit scale. Kept here, not in
        # the groups, so that a saved optimizer state never brings its own (or lacks one).
        self._lr_factors = (1.0, logit_scale_lr_factor)
        self.optimizer = self._new_optimizer()
        self.step = 0
        self._lock = threading.RLock()
        self._live_samplers: weakref.WeakSet[LocalSampler] = weakref.WeakSet()
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_token_ids = sorted(
            {t for t in _as_list(gen_eos) + _as_list(getattr(tokenizer, "eos_token_id", None)) if t is not None}
        )

    # ---- training ----

    def forward_backward(
        self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> Future[ForwardBackwardResult]:
        with _torch_threads(self._train_threads()):
            return Done(self._run(data, loss_fn, loss_fn_config, backward=True))

    def forward(
        self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> Future[ForwardBackwardResult]:
        with torch.no_grad(), _torch_threads(self._train_threads()):
            return Done(self._run(data, loss_fn, loss_fn_config, backward=False))

    def _train_threads(self) -> int | None:
        """The updates' torch threads; a callable (the job's share of its cores) is asked afresh each time."""
        return self.train_threads() if callable(self.train_threads) else self.train_threads

    def _run(
        self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, float] | None, backward: bool
    ) -> ForwardBackwardResult:
        if loss_fn not in LOSSES:
            raise ValueError(f"unknown loss_fn {loss_fn!r}; the local backend has {LOSSES}")
        rows = [_row(d, loss_fn, i) for i, d in enumerate(data)]
        batches = _microbatches(rows, self.microbatch_tokens, packed=self.packing)
        # A copy from pageable host memory waits for the device's queue: copy everything before queueing work.
        batch_inputs = [
            _to_device(_batch_inputs([rows[i] for i in batch], self.packing), self.device) for batch in batches
        ]
        losses, logp_parts = [], []
        with (
            self._lock,
            self._autocast(),
            _attention_implementation(self._lm, PACKED_ATTENTION if self.packing else None),
            _sdpa_first(self.sdpa_backend),
        ):
            self.model.train(backward)  # eval mode (no dropout) for a forward-only pass
            for inputs in batch_inputs:
                logp_N = self._target_logprobs(inputs)
                loss = _loss(loss_fn, logp_N, inputs["loss"], loss_fn_config or {})
                if backward:
                    loss.backward()
                losses.append(loss.detach())
                logp_parts.append(logp_N.detach())
        # The call's one device-to-host copy: every logprob (in micro-batch order), then each micro-batch's loss.
        host = (
            torch.cat([*logp_parts, *[x[None] for x in losses]]).double().cpu()
            if rows
            else torch.zeros(0, dtype=torch.float64)
        )
        order = [i for batch in batches for i in batch]
        logps: list[torch.Tensor | None] = [None] * len(rows)
        for i, logp in zip(order, host[: len(host) - len(losses)].split([len(rows[i]["tokens"]) for i in order])):
            logps[i] = logp.to(logp_parts[0].dtype)
        total = sum(host[len(host) - len(losses) :].tolist())
        flat = {k: torch.cat([r[k] for r in rows]) for k in rows[0] if k != "tokens"} if rows else {}
        logp_all = torch.cat(logps) if rows else torch.zeros(0)
        n_tokens = float(flat["weights"].sum()) if loss_fn == "cross_entropy" and rows else float(len(logp_all))
        return ForwardBackwardResult(
            loss=total,
            n_tokens=n_tokens,
            logprobs=[lp.tolist() for lp in logps],
            metrics=_metrics(loss_fn, logp_all, flat, loss_fn_config or {}),
        )

    def _target_logprobs(self, inputs: dict) -> torch.Tensor:
        """logp of each row's targets, rows concatenated, from one forward pass over the micro-batch."""
        hidden = self._lm.get_decoder()(**inputs["model"], use_cache=False).last_hidden_state
        hidden_N_D = (
            hidden.flatten(0, 1) if inputs["index"] is None else hidden.flatten(0, 1).index_select(0, inputs["index"])
        )
        head = self._lm.get_output_embeddings()
        return target_logprobs(
            hidden_N_D,
            head.weight,
            inputs["loss"]["target_tokens"],
            head.bias,
            self.logprob_chunk_tokens,
            self.compile_backend,
        )

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype) if self.dtype is not None else nullcontext()

    def optim_step(self, adam: types.AdamParams) -> Future[dict[str, float]]:
        with self._lock, _torch_threads(self._train_threads()):
            self._detach_samplers()
            groups = list(zip(self.optimizer.param_groups, self._lr_factors))
            params = [
                p for g, factor in groups if factor > 0 for p in g["params"] if p.grad is not None
            ]  # a frozen group neither moves nor counts in the norm
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.tensor(0.0)
            if adam.grad_clip_norm > 0 and params:
                torch.nn.utils.clip_grads_with_norm_(params, adam.grad_clip_norm, grad_norm)
            for group, factor in groups:
                group.update(
                    lr=adam.learning_rate * factor,
                    betas=(adam.beta1, adam.beta2),
                    eps=adam.eps,
                    weight_decay=adam.weight_decay,
                )
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            stats = {"grad_norm": float(grad_norm), "learning_rate": adam.learning_rate, "step": float(self.step)}
            if self._scale_name:
                stats["logit_scale"] = self.logit_scale()
        return Done(stats)

    def logit_scale(self) -> float:
        """The learnt logit scale of the live weights (model.logit_scale); 1.0 for a model without one."""
        if not self._scale_name:
            return 1.0
        with self._lock:
            return float(self._params[self._scale_name].detach().exp())

    def restart(self, save_dir: str | Path, logit_scale_lr_factor: float = 0.0) -> None:
        """A new training run on the loaded base model, as a newly built backend starts it: the initial trainable
        weights, a fresh optimizer, step 0, checkpoints under `save_dir`. Samplers handed out keep their weights."""
        self.save_dir = Path(save_dir)
        self._lr_factors = (1.0, logit_scale_lr_factor)
        with self._lock:
            self._set_weights(self._initial_weights())
            self.optimizer = self._new_optimizer()
            self.step = 0

    def _initial_weights(self) -> dict[str, torch.Tensor]:
        return {n: t.to(self.device) for n, t in self._initial.items()}

    def _new_optimizer(self) -> torch.optim.AdamW:
        """AdamW over the trainable tensors; the logit scale, if any, in a second group (its lr factor: `_lr_factors`)."""
        rest = [p for n, p in self._params.items() if n != self._scale_name]
        groups = [{"params": rest}] + ([{"params": [self._params[self._scale_name]]}] if self._scale_name else [])
        return torch.optim.AdamW(groups, lr=types.AdamParams().learning_rate)

    # ---- sampling ----

    def sampler(self) -> LocalSampler:
        if self.merge_for_sampling and not self.continuous_batching:  # the batcher merges into its own buffers
            with self._lock:
                merged = copy.deepcopy(self.model)
                merged = merged.merge_and_unload() if isinstance(merged, PeftModel) else merged
            return LocalSampler(self, merged.eval())
        sampler = LocalSampler(self)
        with self._lock:
            self._live_samplers.add(sampler)
        return sampler

    def _continuous_batcher(self, sampler: LocalSampler) -> ContinuousBatcher:
        """The backend's one running batch, built from `sampler`'s weights the first time."""
        with self._lock:
            if self._batcher is None:
                options = {**self._batcher_options, "kv_cache_tokens": self._kv_cache_tokens()}
                with sampler._model() as (_, lm):
                    self._batcher = ContinuousBatcher(
                        lm, self.tokenizer, self.eos_token_ids, snapshot=sampler, **options
                    )
            return self._batcher

    def _kv_cache_tokens(self) -> int:
        """The pool: as set, else the memory plan's (within what the card still has free), else 64k tokens (CPU)."""
        plan = self.memory_plan
        if plan is None:
            return self._batcher_options["kv_cache_tokens"] or 65536
        if self.device.type != "cuda":  # a plan for a card this backend is not on (the tests' stand-in card)
            return plan.kv_tokens
        free, _ = torch.cuda.mem_get_info(self.device)
        unused = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        longest = sequence_limit(self._lm.config, self._batcher_options["max_seq_tokens"])
        return memory_plan.pool_on_device(plan, free + unused, longest)

    def checkpoint_sampler(self, path: str = "") -> LocalSampler:
        """A sampler over the weights `save_state` wrote to `path` ("" = the initial ones: the base model's
        behaviour), read without touching the training state: no optimizer, step or random state is restored."""
        weights = self._read_weights(path, scale_optional=True) if path else self._initial_weights()
        if self.merge_for_sampling:
            with self._lock, self._weights(weights):  # swapped in for the copy, then back
                merged = copy.deepcopy(self.model)
            merged = merged.merge_and_unload() if isinstance(merged, PeftModel) else merged
            return LocalSampler(self, merged.eval())
        sampler = LocalSampler(self)
        sampler._weights = weights  # never the live weights, so training later cannot change it
        return sampler

    def _detach_samplers(self) -> None:
        """Give every sampler that still reads the live weights its own copy, before they change."""
        live = list(self._live_samplers)
        if live:
            frozen = {n: p.detach().clone() for n, p in self._params.items()}
            for s in live:
                s._weights = frozen
        self._live_samplers = weakref.WeakSet()

    @contextmanager
    def _weights(self, weights: dict[str, torch.Tensor] | None):
        """Swap `weights` (None = the live ones) into the model and put it in eval mode, for sampling."""
        was_training = self.model.training
        swapped = weights is not None
        if swapped:
            for n, p in self._params.items():
                p.data, weights[n] = weights[n], p.data
        self.model.eval()
        try:
            with self._autocast():
                yield
        finally:
            if swapped:
                for n, p in self._params.items():
                    p.data, weights[n] = weights[n], p.data
            self.model.train(was_training)

    # ---- checkpoints ----

    def save_state(self, name: str) -> str:
        path = self.save_dir / name
        path.mkdir(parents=True, exist_ok=True)
        with self._lock:
            save_file(
                {n: p.detach().contiguous().cpu() for n, p in self._params.items()}, path / "trainable.safetensors"
            )
            torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
            torch.save({"step": self.step, "rng": _rng_state()}, path / "state.pt")
            meta = {
                "step": self.step,
                "lora_rank": self.lora_rank,
                "trainable_parameters": sum(p.numel() for p in self._params.values()),
            }
            (path / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        return str(path)

    def load_state(self, path: str) -> None:
        weights = self._read_weights(path)
        with self._lock:
            self._set_weights(weights)
            self.optimizer.load_state_dict(
                torch.load(Path(path) / "optimizer.pt", map_location=self.device, weights_only=True)
            )
            state = torch.load(Path(path) / "state.pt", weights_only=True)
            self.step = state["step"]
            _set_rng_state(state["rng"])

    def load_weights(self, path: str) -> None:
        weights = self._read_weights(path, scale_optional=True)
        with self._lock:
            self._set_weights(weights)
            self.optimizer = self._new_optimizer()
            self.step = 0

    def _read_weights(self, path: str, scale_optional: bool = False) -> dict[str, torch.Tensor]:
        """The saved tensors; with `scale_optional`, a checkpoint trained without model.logit_scale starts it at 1."""
        weights = load_file(Path(path) / "trainable.safetensors", device=str(self.device))
        if scale_optional and self._scale_name and self._scale_name not in weights:
            weights[self._scale_name] = torch.zeros_like(self._params[self._scale_name])
        if set(weights) != set(self._params):
            missing, extra = sorted(set(self._params) - set(weights)), sorted(set(weights) - set(self._params))
            raise ValueError(
                f"{path}: trainable parameters differ from this backend's (missing {missing[:3]}, unexpected {extra[:3]}); same base model, LoRA settings and model.logit_scale?"
            )
        # Same names, other shapes: a checkpoint of another LoRA rank (swapping .data would accept it silently).
        shapes = [(n, tuple(w.shape), tuple(self._params[n].shape)) for n, w in weights.items()]
        wrong = [(n, saved, here) for n, saved, here in shapes if saved != here]
        if wrong:
            name, saved, here = wrong[0]
            raise ValueError(
                f"{path}: trainable parameters differ from this backend's ({len(wrong)} of other shapes, e.g. {name} "
                f"{list(saved)} saved, {list(here)} here); same base model and LoRA settings (model.lora_rank)?"
            )
        return weights

    def _set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self._detach_samplers()
        with torch.no_grad():
            for n, p in self._params.items():
                p.copy_(weights[n])
        self.optimizer.zero_grad(set_to_none=True)

    def export_checkpoint(self, checkpoint: str, folder: str) -> Export:
        """A PEFT adapter in `folder/adapter` (LoRA), or the whole model in `folder/hf_model` (full fine-tuning)."""
        from tbexp.backends.adapters import export_local

        return export_local(self, checkpoint, Path(folder))


class LocalSampler(Sampler):
    """Samples from a snapshot of the backend's weights.

    Normally the snapshot is the live weights until they change (then a copy of
    the trainable tensors, swapped in while sampling). With `merged`, a model of
    its own with the LoRA weights folded in: no peft layers to run at every
    token and no backend lock, so it samples about twice as fast on a CPU, at
    the cost of a copy of the model (chosen only for small models on CPU).
    """

    def __init__(self, backend: LocalBackend, merged=None):
        self._backend = backend
        self._weights: dict[str, torch.Tensor] | None = None  # None while the backend's weights are still these
        self._merged = merged
        self._merged_lock = threading.Lock()

    @contextmanager
    def _model(self):
        """(model to call, its causal LM) with the snapshot's weights in place."""
        b = self._backend
        if self._merged is not None:
            with self._merged_lock, torch.no_grad():
                yield self._merged, self._merged
        else:
            with b._lock, b._weights(self._weights):
                yield b.model, b._lm

    @property
    def tokenizer(self):
        return self._backend.tokenizer

    def sample(
        self, prompt: types.ModelInput, num_samples: int, params: types.SamplingParams
    ) -> Future[list[SampledSequence]]:
        b = self._backend
        if b.continuous_batching:
            seeds = (
                None if params.seed is None else [(params.seed + i * SEED_STRIDE) % 2**63 for i in range(num_samples)]
            )
            return Done(self._continuous([Request(prompt.to_ints(), params)] * num_samples, seeds))
        with self._model() as (model, lm):
            context = getattr(lm.config, "max_position_embeddings", None)
            return Done(
                sample_sequences(
                    model,
                    b.tokenizer,
                    prompt.to_ints(),
                    num_samples,
                    params,
                    b.eos_token_ids,
                    context,
                    static_decode=b.cuda_graph_sampling and self._merged is None,
                )
            )

    def compute_logprobs(self, prompt: types.ModelInput, logit_scale: float = 1.0) -> Future[list[float | None]]:
        """Each token's logprob given the ones before it; `logit_scale` multiplies W·h of the head, as
        model.logit_scale's factor does (a reference at another policy's scale: grpo.kl_scaled_reference)."""
        tokens_T = torch.tensor(prompt.to_ints(), dtype=torch.long, device=self._backend.device)
        with self._model() as (_, lm), torch.no_grad():
            hidden_T_D = lm.get_decoder()(input_ids=tokens_T[None], use_cache=False).last_hidden_state[0]
            if logit_scale != 1.0:
                hidden_T_D = hidden_T_D * logit_scale
            head = lm.get_output_embeddings()
            logp_T = target_logprobs(hidden_T_D[:-1], head.weight, tokens_T[1:], head.bias)
        return Done([None] + logp_T.float().cpu().tolist())

    def sample_batch(self, requests: list[Request]) -> list[SampledSequence]:
        """One reply per request, all in one batched decode (see batch_sampling.py)."""
        b = self._backend
        if b.continuous_batching:
            return self._continuous(requests)
        with self._model() as (model, _):
            return sample_batch(model, b.tokenizer, requests, b.eos_token_ids)

    def request_queue(self):
        """What concurrent episodes submit their requests to: the running batch, or a queue of `sample_batch` calls."""
        return _ContinuousQueue(self) if self._backend.continuous_batching else BatchQueue(self.sample_batch)

    def _continuous(self, requests: list[Request], seeds: list[int] | None = None) -> list[SampledSequence]:
        """Answers from the backend's running batch (continuous_batching.py), with this snapshot's weights."""
        return self._backend._continuous_batcher(self).submit_all(
            requests, snapshot=self, load=self._load_into, seeds=seeds
        )

    def _load_into(self, batcher: ContinuousBatcher) -> None:
        with self._model() as (_, lm):
            batcher.load(lm, self)


class _ContinuousQueue:
    """Requests straight into the running batch; `busy_s` is the wall time any of them was in it (the stages'
    sampling share, as `BatchQueue.busy_s` is for batches run one at a time)."""

    def __init__(self, sampler: LocalSampler):
        self.sampler = sampler
        self.busy_s = 0.0
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0

    def submit(self, request: Request) -> SampledSequence:
        with self._lock:
            if self._in_flight == 0:
                self._since = time.perf_counter()
            self._in_flight += 1
        try:
            return self.sampler._continuous([request])[0]
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self.busy_s += time.perf_counter() - self._since


def _row(datum: types.Datum, loss_fn: str, index: int) -> dict[str, torch.Tensor]:
    names = ("target_tokens", "weights") if loss_fn == "cross_entropy" else RL_INPUTS
    missing = [k for k in names if k not in datum.loss_fn_inputs]
    if missing:
        raise ValueError(f"{loss_fn} needs loss_fn_inputs {names}; this datum lacks {missing}")
    row = {"tokens": torch.tensor(datum.model_input.to_ints(), dtype=torch.long)}
    for k in names:
        row[k] = datum.loss_fn_inputs[k].to_torch().reshape(-1)
        row[k] = row[k].long() if k == "target_tokens" else row[k].float()
        if len(row[k]) != len(row["tokens"]):
            raise ValueError(f"loss_fn_inputs[{k!r}] has {len(row[k])} entries for {len(row['tokens'])} input tokens")
    if loss_fn != "cross_entropy":  # which datum each position is of: gspo's ratio is per sequence
        row["datum"] = torch.full((len(row["tokens"]),), index, dtype=torch.long)
    return row


@contextmanager
def _torch_threads(n: int | None):
    """torch's CPU threads set to `n` (None: left alone) for the block; the stages call updates only between
    rollouts, so the cores the sandboxes need while sampling are free then."""
    previous = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n:
            torch.set_num_threads(previous)


def _microbatches(rows: list[dict], budget_tokens: int, packed: bool = False) -> list[list[int]]:
    """Row indices grouped longest first, each group's size within the budget: rows × longest, or (packed) Σ lengths."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]["tokens"]))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            longest = len(rows[batches[-1][0]]["tokens"])
            size = (
                sum(len(rows[j]["tokens"]) for j in batches[-1]) + len(rows[i]["tokens"])
                if packed
                else (len(batches[-1]) + 1) * longest
            )
            if size <= budget_tokens:
                batches[-1].append(i)
                continue
        batches.append([i])
    return batches


def _batch_inputs(rows: list[dict], packed: bool) -> dict:
    """The decoder's inputs for one micro-batch, the flat positions of its real tokens (None = all) and the loss inputs."""
    lengths = [len(r["tokens"]) for r in rows]
    loss = {k: torch.cat([r[k] for r in rows]) for k in rows[0] if k != "tokens"}
    if packed:
        # Rotary positions restart at each datum; cu_seq_lens tells `_packed_attention` where datums begin.
        cu_seq_lens = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
        model = {
            "input_ids": torch.cat([r["tokens"] for r in rows])[None],
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
            "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": max(lengths),
            "max_length_k": max(lengths),
        }
        return {"model": model, "index": None, "loss": loss}
    length = max(lengths)
    tokens_B_T = torch.zeros(len(rows), length, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens_B_T[b, : lengths[b]] = r["tokens"]
    if min(lengths) == length:  # no padding: no mask, so attention can take its causal fast path
        return {"model": {"input_ids": tokens_B_T}, "index": None, "loss": loss}
    mask_B_T = (torch.arange(length)[None] < torch.tensor(lengths)[:, None]).long()
    index = torch.cat([b * length + torch.arange(n) for b, n in enumerate(lengths)])
    return {"model": {"input_ids": tokens_B_T, "attention_mask": mask_B_T}, "index": index, "loss": loss}


def _to_device(tree, device: torch.device):
    if isinstance(tree, dict):
        return {k: _to_device(v, device) for k, v in tree.items()}
    return tree.to(device) if isinstance(tree, torch.Tensor) else tree


def _loss(
    loss_fn: str, logp_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """The summed loss, exactly as Tinker defines it (see base.py; the RL losses in rl_losses.py)."""
    if loss_fn == "cross_entropy":
        return -(inputs["weights"] * logp_N).sum()
    return policy_loss(loss_fn, logp_N, inputs, config)


def _metrics(
    loss_fn: str, logp_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> dict[str, float]:
    return {} if loss_fn == "cross_entropy" else policy_metrics(loss_fn, logp_N, inputs, config)


def _card_bytes(device: torch.device) -> int | None:
    """The GPU's memory, which the memory plan divides; None on a CPU (no plan)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def _check_plain_lm_head(config) -> None:
    # The chunked logprobs apply the LM head as a plain linear map.
    if (
        getattr(config, "final_logit_softcapping", None)
        or getattr(config, "logits_scaling", 1) != 1
        or getattr(config, "logit_scale", 1) != 1
    ):
        raise ValueError(
            f"{type(config).__name__}: soft-capped or scaled logits are not supported by the local backend"
        )


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
