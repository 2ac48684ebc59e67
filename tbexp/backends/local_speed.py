"""The local backend's speed and memory knobs (see local.py): all off by default.

`dtype` ("bfloat16") stores the frozen weights in that dtype and runs forward
passes (training and sampling) under autocast to it, while trainable weights
stay fp32 for the optimizer; peft's cast of each LoRA input to fp32 is
switched off, since autocast recasts it anyway (`_cast_weights`).
`compile_backend` ("inductor") torch.compiles each decoder layer for
gradient-taking passes only (one graph reused by every layer; sampling and
`forward` stay eager, where 1-token steps would only recompile), and fuses
the chunked log-softmax (`logprobs.py`), whose chunk is `logprob_chunk_tokens`
positions. `sdpa_backend` ("cudnn_attention") puts that SDPA kernel first for
training passes. `cuda_graph_sampling` decodes with a static KV cache and
replays one CUDA graph per token (`sampling.py`). `gradient_checkpointing`
trades a second forward of each decoder layer for its activations: a layer
keeps only its input for the backward (memory_plan.py counts both ways).

`packing`'s attention, `_packed_attention`, is registered with transformers
as PACKED_ATTENTION and installed only while forward_backward and forward
run (sampling keeps the model's own attention): each datum of a packed row
attends causally within itself through torch's Flash varlen kernel on CUDA,
or one SDPA call per datum elsewhere (also on CUDA where this torch has no
varlen kernel), so no compute goes to padding and no [T, T] mask is built.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager, nullcontext

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PACKED_ATTENTION = "tbexp_packed"  # the attention implementation that `packing` installs


def _enable_checkpointing(model) -> None:
    # Non-reentrant checkpointing works with frozen embeddings (LoRA) without forcing input grads.
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _cast_weights(model, frozen: torch.dtype, trainable: torch.dtype) -> None:
    """Floating-point weights that do not train to `frozen`, those that train to `trainable`."""
    for p in model.parameters():
        target = trainable if p.requires_grad else frozen
        if p.is_floating_point() and p.dtype != target:
            p.data = p.data.to(target)
    for (
        m
    ) in model.modules():  # peft casts each LoRA input to its fp32 weight's dtype; autocast makes that a wasted pass
        if hasattr(m, "cast_input_dtype_enabled"):
            m.cast_input_dtype_enabled = False


def _compile_layers(lm, backend: str) -> None:
    """torch.compile each decoder layer, used only when gradients are taken (training forward passes)."""
    layers = getattr(lm.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"compile_backend: {type(lm).__name__}'s decoder has no `layers` to compile")
    for layer in layers:
        layer.forward = functools.partial(
            _forward_compiled_with_grad, layer.forward, torch.compile(layer.forward, backend=backend)
        )


def _forward_compiled_with_grad(eager, compiled, *args, **kwargs):
    return compiled(*args, **kwargs) if torch.is_grad_enabled() else eager(*args, **kwargs)


def _sdpa_first(name: str | None):
    """SDPA tries kernel `name` (an `SDPBackend` name, any case) first, then its usual order; None: its usual order."""
    if name is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    first = getattr(SDPBackend, name.upper())  # a pybind enum: no [] lookup
    usual = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel([first] + [b for b in usual if b != first], set_priority=True)


def _register_packed_attention() -> None:
    """Make PACKED_ATTENTION an attention implementation that models can be switched to."""
    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)


@contextmanager
def _attention_implementation(lm, name: str | None):
    """Run the model with attention implementation `name` (None: leave it as it is)."""
    previous = lm.config._attn_implementation
    if name is not None:
        lm.set_attn_implementation(name)
    try:
        yield
    finally:
        if name is not None:
            lm.set_attn_implementation(previous)


def _packed_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    cu_seq_lens_q=None,
    max_length_q=None,
    **kwargs,
):
    """A transformers attention function: causal attention within each datum of one packed row [1, H, T, d]."""
    if cu_seq_lens_q is None:  # nothing packed (sampling, one prompt): plain SDPA
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    groups = query.shape[1] // key.shape[1]  # GQA: each K/V head serves `groups` query heads
    q_H_T_d, k_H_T_d, v_H_T_d = query[0], key[0].repeat_interleave(groups, 0), value[0].repeat_interleave(groups, 0)
    if query.is_cuda and _varlen_attn() is not None:
        varlen, causal = _varlen_attn()
        q_T_H_d, k_T_H_d, v_T_H_d = (t.transpose(0, 1).contiguous() for t in (q_H_T_d, k_H_T_d, v_H_T_d))
        out_T_H_d = varlen(
            q_T_H_d, k_T_H_d, v_T_H_d, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling, **causal
        )
    else:
        bounds = cu_seq_lens_q.tolist()
        parts = [
            torch.nn.functional.scaled_dot_product_attention(
                q_H_T_d[:, s:e], k_H_T_d[:, s:e], v_H_T_d[:, s:e], is_causal=True, scale=scaling
            )
            for s, e in zip(bounds, bounds[1:])
        ]
        out_T_H_d = torch.cat(parts, dim=1).transpose(0, 1)
    return out_T_H_d[None], None


@functools.cache
def _varlen_attn():
    """torch's Flash varlen attention and its causal argument (torch 2.10 took is_causal, later ones a window), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
