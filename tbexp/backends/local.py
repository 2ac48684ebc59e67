"""`backend=local`: a transformers model (LoRA through peft, or full fine-tuning) trained in this process.

forward_backward: datums are sorted by length and grouped into micro-batches
of at most `microbatch_tokens` padded tokens, right-padded with an attention
mask (causal attention means real positions never see the padding, so each
datum's logprobs equal those of running it alone). The decoder gives hidden
states; the target logprobs come from the LM head a chunk of positions at a
time (`logprobs.py`), so [T, V] logits never exist whole. Each micro-batch's
loss — a sum over tokens, as Tinker defines it — is backpropagated at once,
and gradients add up until `optim_step`. The whole call runs eagerly; the
returned future is already done.

optim_step: torch AdamW with Tinker's `AdamParams` (decoupled weight decay,
global-norm clipping when `grad_clip_norm` > 0), hyperparameters set afresh
each step so a schedule lives with the caller.

sampler: a snapshot that costs nothing until the weights change; before the
next optim_step or load_state, live snapshots get a copy of the trainable
tensors (the LoRA weights, or every weight under full fine-tuning) and swap
them in while they sample. One lock serialises training and sampling.

save_state(name) writes `save_dir/name/`: `trainable.safetensors` (trainable
parameters by name), `optimizer.pt`, `state.pt` (step and the torch CPU/CUDA,
Python and NumPy RNG states) and `meta.json`. Frozen base weights are not
saved: `load_state` expects a backend built on the same base model.
The constructor takes ownership of `model` (peft modifies it in place);
`seed` seeds only the LoRA initialisation (the caller seeds the run).
"""

from __future__ import annotations

import json
import random
import threading
import warnings
import weakref
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from tinker import types

from tbexp.backends.base import LOSSES, Done, ForwardBackwardResult, Future, Sampler, SampledSequence, TrainingBackend
from tbexp.backends.logprobs import target_logprobs
from tbexp.backends.sampling import sample_sequences

RL_INPUTS = ("target_tokens", "logprobs", "advantages")


class LocalBackend(TrainingBackend):
    def __init__(self, model, tokenizer, *, lora_rank: int, lora_alpha: float, lora_dropout: float, lora_targets: list[str], device: str = "auto", seed: int = 0, save_dir: str | Path, microbatch_tokens: int = 8192, gradient_checkpointing: bool = False):
        _check_plain_lm_head(model.config)
        self.tokenizer = tokenizer
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device)
        self.save_dir = Path(save_dir)
        self.microbatch_tokens = microbatch_tokens
        self.lora_rank = lora_rank
        model = model.to(self.device)
        if gradient_checkpointing:
            _enable_checkpointing(model)
        if lora_rank > 0:
            config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=list(lora_targets), bias="none", task_type="CAUSAL_LM")
            with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
                torch.manual_seed(seed)  # LoRA's A init; the global RNG stream is left alone
                with warnings.catch_warnings():  # peft 0.21 reads a property transformers 5 deprecated
                    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
                    model = get_peft_model(model, config)
            self._lm = model.get_base_model()
        else:
            self._lm = model
        self.model = model
        self.model.train()
        if not isinstance(self._lm.get_output_embeddings(), torch.nn.Linear):
            raise ValueError("the LM head must be a plain nn.Linear (LoRA on lm_head is not supported)")
        self._params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(self._params.values(), lr=types.AdamParams().learning_rate)
        self.step = 0
        self._lock = threading.RLock()
        self._live_samplers: weakref.WeakSet[LocalSampler] = weakref.WeakSet()
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_token_ids = sorted({t for t in _as_list(gen_eos) + _as_list(getattr(tokenizer, "eos_token_id", None)) if t is not None})

    # ---- training ----

    def forward_backward(self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None) -> Future[ForwardBackwardResult]:
        return Done(self._run(data, loss_fn, loss_fn_config, backward=True))

    def forward(self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None) -> Future[ForwardBackwardResult]:
        with torch.no_grad():
            return Done(self._run(data, loss_fn, loss_fn_config, backward=False))

    def _run(self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict[str, float] | None, backward: bool) -> ForwardBackwardResult:
        if loss_fn not in LOSSES:
            raise ValueError(f"unknown loss_fn {loss_fn!r}; the local backend has {LOSSES}")
        rows = [_row(d, loss_fn) for d in data]
        logps: list[torch.Tensor | None] = [None] * len(rows)
        total = 0.0
        with self._lock:
            self.model.train(backward)  # eval mode (no dropout) for a forward-only pass
            for batch in _microbatches(rows, self.microbatch_tokens):
                logp_N, inputs = self._target_logprobs([rows[i] for i in batch])
                loss = _loss(loss_fn, logp_N, inputs, loss_fn_config or {})
                if backward:
                    loss.backward()
                total += loss.item()
                for i, logp in zip(batch, logp_N.detach().split([len(rows[i]["tokens"]) for i in batch])):
                    logps[i] = logp.cpu()
        flat = {k: torch.cat([r[k] for r in rows]) for k in rows[0] if k != "tokens"} if rows else {}
        logp_all = torch.cat(logps) if rows else torch.zeros(0)
        n_tokens = float(flat["weights"].sum()) if loss_fn == "cross_entropy" and rows else float(len(logp_all))
        return ForwardBackwardResult(loss=total, n_tokens=n_tokens, logprobs=[lp.tolist() for lp in logps], metrics=_metrics(loss_fn, logp_all, flat, loss_fn_config or {}))

    def _target_logprobs(self, rows: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """logp of each row's targets, rows concatenated, from one right-padded forward pass."""
        length = max(len(r["tokens"]) for r in rows)
        tokens_B_T = torch.zeros(len(rows), length, dtype=torch.long)
        mask_B_T = torch.zeros(len(rows), length, dtype=torch.long)
        for b, r in enumerate(rows):
            tokens_B_T[b, : len(r["tokens"])] = r["tokens"]
            mask_B_T[b, : len(r["tokens"])] = 1
        tokens_B_T, mask_B_T = tokens_B_T.to(self.device), mask_B_T.to(self.device)
        hidden_B_T_D = self._lm.get_decoder()(input_ids=tokens_B_T, attention_mask=mask_B_T, use_cache=False).last_hidden_state
        head = self._lm.get_output_embeddings()
        inputs = {k: torch.cat([r[k] for r in rows]).to(self.device) for k in rows[0] if k != "tokens"}
        logp_N = target_logprobs(hidden_B_T_D[mask_B_T.bool()], head.weight, inputs["target_tokens"], head.bias)
        return logp_N, inputs

    def optim_step(self, adam: types.AdamParams) -> Future[dict[str, float]]:
        with self._lock:
            self._detach_samplers()
            params = [p for p in self._params.values() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.tensor(0.0)
            if adam.grad_clip_norm > 0 and params:
                torch.nn.utils.clip_grads_with_norm_(params, adam.grad_clip_norm, grad_norm)
            for group in self.optimizer.param_groups:
                group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
        return Done({"grad_norm": float(grad_norm), "learning_rate": adam.learning_rate, "step": float(self.step)})

    # ---- sampling ----

    def sampler(self) -> LocalSampler:
        sampler = LocalSampler(self)
        with self._lock:
            self._live_samplers.add(sampler)
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
            save_file({n: p.detach().contiguous().cpu() for n, p in self._params.items()}, path / "trainable.safetensors")
            torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
            torch.save({"step": self.step, "rng": _rng_state()}, path / "state.pt")
            meta = {"step": self.step, "lora_rank": self.lora_rank, "trainable_parameters": sum(p.numel() for p in self._params.values())}
            (path / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        return str(path)

    def load_state(self, path: str) -> None:
        path = Path(path)
        weights = load_file(path / "trainable.safetensors", device=str(self.device))
        if set(weights) != set(self._params):
            missing, extra = sorted(set(self._params) - set(weights)), sorted(set(weights) - set(self._params))
            raise ValueError(f"{path}: trainable parameters differ from this backend's (missing {missing[:3]}, unexpected {extra[:3]}); same base model and LoRA settings?")
        with self._lock:
            self._detach_samplers()
            with torch.no_grad():
                for n, p in self._params.items():
                    p.copy_(weights[n])
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True))
            state = torch.load(path / "state.pt", weights_only=True)
            self.step = state["step"]
            _set_rng_state(state["rng"])

    def export_adapter(self, path: str) -> str:
        if not isinstance(self.model, PeftModel):
            raise NotImplementedError("full fine-tuning has no adapter to export; use save_state or the model's save_pretrained")
        with self._lock:
            self.model.save_pretrained(path)
        return str(path)


class LocalSampler(Sampler):
    def __init__(self, backend: LocalBackend):
        self._backend = backend
        self._weights: dict[str, torch.Tensor] | None = None  # None while the backend's weights are still these

    def sample(self, prompt: types.ModelInput, num_samples: int, params: types.SamplingParams) -> Future[list[SampledSequence]]:
        b = self._backend
        with b._lock, b._weights(self._weights):
            context = getattr(b._lm.config, "max_position_embeddings", None)
            return Done(sample_sequences(b.model, b.tokenizer, prompt.to_ints(), num_samples, params, b.eos_token_ids, context))


def _row(datum: types.Datum, loss_fn: str) -> dict[str, torch.Tensor]:
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
    return row


def _microbatches(rows: list[dict], budget_tokens: int) -> list[list[int]]:
    """Row indices grouped longest first, each group's padded size (rows × longest) within the budget."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]["tokens"]))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * len(rows[batches[-1][0]]["tokens"]) <= budget_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _loss(loss_fn: str, logp_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    """The summed loss, exactly as Tinker defines it (see base.py)."""
    if loss_fn == "cross_entropy":
        return -(inputs["weights"] * logp_N).sum()
    ratio_N = torch.exp(logp_N - inputs["logprobs"])
    adv_N = inputs["advantages"]
    if loss_fn == "importance_sampling":
        return -(ratio_N * adv_N).sum()
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    return -torch.minimum(ratio_N * adv_N, ratio_N.clamp(low, high) * adv_N).sum()


def _metrics(loss_fn: str, logp_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> dict[str, float]:
    if loss_fn == "cross_entropy" or len(logp_N) == 0:
        return {}
    ratio_N = torch.exp(logp_N - inputs["logprobs"])
    metrics = {"ratio_mean": float(ratio_N.mean()), "sampler_minus_train_logp": float((inputs["logprobs"] - logp_N).mean())}
    if loss_fn == "ppo":
        low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        active = inputs["advantages"] != 0
        clipped = ((ratio_N < low) | (ratio_N > high)) & active
        metrics["clip_fraction"] = float(clipped.sum() / active.sum().clamp(min=1))
    return metrics


def _check_plain_lm_head(config) -> None:
    # The chunked logprobs apply the LM head as a plain linear map.
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logits_scaling", 1) != 1 or getattr(config, "logit_scale", 1) != 1:
        raise ValueError(f"{type(config).__name__}: soft-capped or scaled logits are not supported by the local backend")


def _enable_checkpointing(model) -> None:
    # Non-reentrant checkpointing works with frozen embeddings (LoRA) without forcing input grads.
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


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
