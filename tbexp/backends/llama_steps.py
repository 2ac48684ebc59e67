"""A Llama decoder's sampling forward passes without transformers' per-call machinery, for small models on the CPU.

On the CPU a small model's decode step is mostly overhead: for the tiny model
(4 layers, width 128) transformers' `LlamaForCausalLM.forward` spent about
10 ms a step at batch 4, of which the matrix products were under 2 ms; the
rest was mask building, cache objects, hub-kernel wrappers and module calls.
`LlamaSteps` runs the same operations as transformers' eager-module, SDPA
path, in the same order and on tensors of the same shapes, so its logits are
bitwise those of `model(...)` (tests/test_llama_steps.py compares them, and
the tokens and logprobs `sample_batch` draws with and without it):

* embedding → per layer: RMSNorm (in float32), q/k/v projections, rotary
  embedding (cos/sin of position × inv_freq, computed per call), the keys and
  values so far (the numbers transformers' cache holds, in buffers that grow by
  doubling instead of a copy every step), `scaled_dot_product_attention` with the mask
  transformers would pass (none without padding, `is_causal` for a prefill;
  else its boolean causal-and-padding mask), the output projection, residual;
  RMSNorm, SiLU-gated MLP, residual → the final norm (times the learnt
  `model.logit_scale` where the model carries one) → the LM head on the last
  position.

It takes only what it can reproduce exactly: a plain `LlamaForCausalLM` (LoRA
merged in), float32, SDPA attention, default RoPE, no biases, as many key/value
heads as query heads; `LlamaSteps.supports(model)` says whether a model is one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tbexp.backends.logit_scale import ScaledNorm


class LlamaSteps:
    """One batch's prefill and decode steps; rows can leave the batch (`keep`) between steps."""

    def __init__(self, model):
        self.embed = model.model.embed_tokens.weight
        self.layers = model.model.layers
        norm = model.model.norm
        self.final_norm, self.log_scale = (norm.norm, norm.log_scale) if isinstance(norm, ScaledNorm) else (norm, None)
        self.head = model.lm_head.weight
        self.inv_freq = model.model.rotary_emb.inv_freq.float()
        self.head_dim = model.config.head_dim
        self.scaling = self.head_dim**-0.5
        self.keys: list[torch.Tensor | None] = []  # per layer: B x heads x capacity x head_dim, filled to lengths[i]
        self.values: list[torch.Tensor | None] = []
        self.lengths: list[int] = []
        self.padding_B_T: torch.Tensor | None = None  # every position seen so far, 1 = a real token

    enabled = True  # `transformers_only()` turns it off: to time the difference, or to rule it out

    @staticmethod
    def supports(model) -> bool:
        """Whether `model` is one this class computes exactly as transformers does."""
        from transformers import LlamaForCausalLM

        if not LlamaSteps.enabled or type(model) is not LlamaForCausalLM:
            return False
        c = model.config
        norm = model.model.norm
        return (
            next(model.parameters()).dtype == torch.float32
            and next(model.parameters()).device.type == "cpu"
            and getattr(c, "_attn_implementation", "") == "sdpa"
            and (c.rope_parameters or {}).get("rope_type", "default") == "default"
            and getattr(model.model.rotary_emb, "attention_scaling", 1.0) == 1.0
            and not c.attention_bias
            and not c.mlp_bias
            and c.num_key_value_heads == c.num_attention_heads
            and getattr(c, "pretraining_tp", 1) == 1
            and c.hidden_act == "silu"
            and (not isinstance(norm, ScaledNorm) or type(norm.norm).__name__ == "LlamaRMSNorm")
        )

    @torch.no_grad()
    def prefill(self, tokens_B_T: torch.Tensor, padding_B_T: torch.Tensor, positions_B_T: torch.Tensor) -> torch.Tensor:
        """The last position's logits after `tokens_B_T` (left-padded: `padding_B_T` is 1 on real tokens)."""
        self.padding_B_T = padding_B_T
        self.keys, self.values = [None] * len(self.layers), [None] * len(self.layers)
        self.lengths = [0] * len(self.layers)
        return self._forward(tokens_B_T, positions_B_T)

    @torch.no_grad()
    def decode(self, tokens_B: torch.Tensor, positions_B: torch.Tensor) -> torch.Tensor:
        """The logits after one more token a row."""
        ones = torch.ones(len(tokens_B), 1, dtype=self.padding_B_T.dtype, device=self.padding_B_T.device)
        self.padding_B_T = torch.cat([self.padding_B_T, ones], dim=1)
        return self._forward(tokens_B[:, None], positions_B[:, None])

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows go on (as transformers' `Cache.batch_select_indices`)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.padding_B_T = self.padding_B_T[rows]

    def _forward(self, tokens_B_T: torch.Tensor, positions_B_T: torch.Tensor) -> torch.Tensor:
        B, T = tokens_B_T.shape
        hidden = F.embedding(tokens_B_T, self.embed)
        cos, sin = self._rotary(positions_B_T)
        mask = self._mask(T)
        for i, layer in enumerate(self.layers):
            residual = hidden
            hidden = _rms_norm(hidden, layer.input_layernorm)
            hidden = self._attention(i, layer.self_attn, hidden, cos, sin, mask)
            hidden = residual + hidden
            residual = hidden
            hidden = _rms_norm(hidden, layer.post_attention_layernorm)
            mlp = layer.mlp
            hidden = F.linear(
                F.silu(F.linear(hidden, mlp.gate_proj.weight)) * F.linear(hidden, mlp.up_proj.weight),
                mlp.down_proj.weight,
            )
            hidden = residual + hidden
        hidden = _rms_norm(hidden, self.final_norm)
        if self.log_scale is not None:  # ScaledNorm.forward
            hidden = hidden * self.log_scale.exp().to(hidden.dtype)
        return F.linear(hidden[:, -1:, :], self.head)[:, -1]

    def _rotary(self, positions_B_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions_B_T[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]

    def _mask(self, q_length: int) -> torch.Tensor | None:
        """What transformers passes to SDPA: None without padding, else causal-and-padding, True = attend."""
        padding = self.padding_B_T.bool()
        if bool(padding.all()):
            return None
        kv_length = padding.shape[1]
        q_positions = torch.arange(kv_length - q_length, kv_length, device=padding.device)
        causal = torch.arange(kv_length, device=padding.device)[None, :] <= q_positions[:, None]
        return causal[None, None] & padding[:, None, None, :]

    def _attention(self, i: int, attn, hidden: torch.Tensor, cos, sin, mask) -> torch.Tensor:
        B, T, _ = hidden.shape
        shape = (B, T, -1, self.head_dim)
        q = F.linear(hidden, attn.q_proj.weight).view(shape).transpose(1, 2)
        k = F.linear(hidden, attn.k_proj.weight).view(shape).transpose(1, 2)
        v = F.linear(hidden, attn.v_proj.weight).view(shape).transpose(1, 2)
        q, k = (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)
        k, v = self._cached(i, k, v)
        is_causal = T > 1 and mask is None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scaling, is_causal=is_causal
        )
        out = out.transpose(1, 2).contiguous().reshape(B, T, -1).contiguous()
        return F.linear(out, attn.o_proj.weight)

    def _cached(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position's keys and values so far: views of buffers that grow by doubling, where transformers'
        cache concatenates (copying the whole cache) every step; the views hold the same numbers."""
        n, T = self.lengths[i], k.shape[2]
        buffer = self.keys[i]
        if buffer is None or n + T > buffer.shape[2]:
            capacity = max(2 * (n + T), 64)
            grown = [k.new_empty(k.shape[0], k.shape[1], capacity, k.shape[3]) for _ in range(2)]
            if buffer is not None:
                grown[0][:, :, :n] = buffer[:, :, :n]
                grown[1][:, :, :n] = self.values[i][:, :, :n]
            self.keys[i], self.values[i] = grown
        self.keys[i][:, :, n : n + T] = k
        self.values[i][:, :, n : n + T] = v
        self.lengths[i] = n + T
        return self.keys[i][:, :, : n + T], self.values[i][:, :, : n + T]


@contextlib.contextmanager
def transformers_only() -> Iterator[None]:
    """Inside, the batched sampler runs every model through transformers' forward (the same numbers, slower)."""
    before, LlamaSteps.enabled = LlamaSteps.enabled, False
    try:
        yield
    finally:
        LlamaSteps.enabled = before


def _rms_norm(hidden: torch.Tensor, norm) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, for float32."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return norm.weight * (hidden * torch.rsqrt(variance + norm.variance_epsilon))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
