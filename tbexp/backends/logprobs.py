"""Target-token log-probabilities from hidden states, a chunk of positions at a time.

logp[i] = h[i]·W[t_i] + b[t_i] − logsumexp_v(h[i]·W[v] + b[v])

The naive route (`lm_head(h)` → `log_softmax` → `gather`) holds full [N, V]
logits in fp32, plus the same again for the softmax and for each gradient:
at N = 32k positions and V = 200k that is tens of gigabytes. Here the
forward pass keeps only logp and the logsumexp per position; the backward
pass recomputes each chunk's logits and forms its gradient in place:

    ∂logp[i]/∂logits[i] = onehot(t_i) − softmax(logits[i])

so at any moment one chunk's [C, V] logits (and one temporary of that size)
are alive. The cost is a second matmul with the LM head in the backward
pass. Eagerly, each chunk's softmax takes several fp32 passes over [C, V];
with `compile_backend`, torch.compile fuses each direction's softmax into one
pass over the model-dtype logits (not for a biased head, which stays eager).
Small chunks starve the backward's [C, V] @ [V, D] matmul (a C × D output
over a long V), so on a GPU give `chunk_size` a thousand positions or more. Logits are accumulated in fp32 (fp64 if the inputs are fp64, which the
gradient check in the tests uses); no temperature, soft-capping or logit
scaling is applied (models that need one are refused by the backend).
"""

from __future__ import annotations

import functools

import torch

CHUNK_ELEMENTS = 2**25  # logits per chunk (128 MiB in fp32): 167 positions at V = 200k


def default_chunk_size(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


def target_logprobs(
    hidden_N_D: torch.Tensor,
    weight_V_D: torch.Tensor,
    targets_N: torch.Tensor,
    bias_V: torch.Tensor | None = None,
    chunk_size: int | None = None,
    compile_backend: str | None = None,
) -> torch.Tensor:
    """logp of `targets_N` under softmax(hidden @ weight.T + bias), differentiable in hidden, weight and bias."""
    if hidden_N_D.ndim != 2 or targets_N.shape != hidden_N_D.shape[:1]:
        raise ValueError(
            f"expected hidden [N, D] and targets [N], got {tuple(hidden_N_D.shape)} and {tuple(targets_N.shape)}"
        )
    chunk = chunk_size or default_chunk_size(weight_V_D.shape[0])
    # The head runs in the hidden states' dtype (bf16 activations against an fp32 head under autocast, say).
    weight_V_D, bias_V = weight_V_D.to(hidden_N_D.dtype), bias_V.to(hidden_N_D.dtype) if bias_V is not None else None
    fused = _fused_softmax(compile_backend) if compile_backend and bias_V is None else None
    return _ChunkedTargetLogprobs.apply(hidden_N_D, weight_V_D, bias_V, targets_N.long(), chunk, fused)


def naive_target_logprobs(
    hidden_N_D: torch.Tensor, weight_V_D: torch.Tensor, targets_N: torch.Tensor, bias_V: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: full logits, `log_softmax`, `gather` (for tests and the benchmark)."""
    logits_N_V = torch.nn.functional.linear(hidden_N_D, weight_V_D, bias_V).to(_acc_dtype(hidden_N_D))
    return torch.log_softmax(logits_N_V, dim=-1).gather(1, targets_N.long()[:, None]).squeeze(1)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_logits(h_C_D: torch.Tensor, weight_V_D: torch.Tensor, bias_V: torch.Tensor | None) -> torch.Tensor:
    # The matmul runs in the model's dtype (as the LM head would); the softmax in fp32.
    return torch.nn.functional.linear(h_C_D, weight_V_D, bias_V).to(_acc_dtype(h_C_D))


def _logp_and_lse(logits_C_V: torch.Tensor, targets_C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits_C_V = logits_C_V.to(_acc_dtype(logits_C_V))
    lse_C = torch.logsumexp(logits_C_V, dim=-1)
    return logits_C_V.gather(1, targets_C[:, None]).squeeze(1) - lse_C, lse_C


def _dlogits(logits_C_V: torch.Tensor, lse_C: torch.Tensor, g_C: torch.Tensor, targets_C: torch.Tensor) -> torch.Tensor:
    """g · (onehot(t) − softmax), returned in the logits' dtype (a fused kernel under torch.compile)."""
    probs_C_V = torch.exp(logits_C_V.to(lse_C.dtype) - lse_C[:, None])
    onehot_C_V = torch.arange(logits_C_V.shape[1], device=logits_C_V.device)[None] == targets_C[:, None]
    return (g_C[:, None] * (onehot_C_V.to(probs_C_V.dtype) - probs_C_V)).to(logits_C_V.dtype)


@functools.cache
def _fused_softmax(backend: str):
    return torch.compile(_logp_and_lse, backend=backend, dynamic=True), torch.compile(
        _dlogits, backend=backend, dynamic=True
    )


class _ChunkedTargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_N_D, weight_V_D, bias_V, targets_N, chunk, fused):
        n = hidden_N_D.shape[0]
        logp_N = hidden_N_D.new_empty(n, dtype=_acc_dtype(hidden_N_D))
        lse_N = torch.empty_like(logp_N)
        for s in range(0, n, chunk):
            if fused:  # the model-dtype logits go straight into one fused pass
                logits_C_V = torch.nn.functional.linear(hidden_N_D[s : s + chunk], weight_V_D)
                logp_N[s : s + chunk], lse_N[s : s + chunk] = fused[0](logits_C_V, targets_N[s : s + chunk])
                continue
            logits_C_V = _chunk_logits(hidden_N_D[s : s + chunk], weight_V_D, bias_V)
            lse_C = torch.logsumexp(logits_C_V, dim=-1)
            logp_N[s : s + chunk] = logits_C_V.gather(1, targets_N[s : s + chunk, None]).squeeze(1) - lse_C
            lse_N[s : s + chunk] = lse_C
            del logits_C_V
        ctx.chunk, ctx.fused = chunk, fused
        ctx.save_for_backward(hidden_N_D, weight_V_D, bias_V, targets_N, lse_N)
        return logp_N

    @staticmethod
    def backward(ctx, grad_N):
        hidden_N_D, weight_V_D, bias_V, targets_N, lse_N = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = lse_N.dtype
        grad_h = torch.empty_like(hidden_N_D) if need_h else None
        grad_w = torch.zeros(weight_V_D.shape, dtype=acc, device=weight_V_D.device) if need_w else None
        grad_b = torch.zeros(weight_V_D.shape[0], dtype=acc, device=weight_V_D.device) if need_b else None
        grad_N = grad_N.to(acc)
        for s in range(0, hidden_N_D.shape[0], ctx.chunk):
            h_C_D, g_C, t_C = (
                hidden_N_D[s : s + ctx.chunk],
                grad_N[s : s + ctx.chunk, None],
                targets_N[s : s + ctx.chunk, None],
            )
            if ctx.fused:
                dlogits_C_V = ctx.fused[1](
                    torch.nn.functional.linear(h_C_D, weight_V_D), lse_N[s : s + ctx.chunk], g_C[:, 0], t_C[:, 0]
                )
                if need_h:
                    grad_h[s : s + ctx.chunk] = dlogits_C_V @ weight_V_D
                if need_w:
                    grad_w.addmm_(dlogits_C_V.T.to(acc), h_C_D.to(acc))
                continue
            # d logp / d logits = onehot(t) − softmax; built in place in the logits buffer.
            dlogits_C_V = _chunk_logits(h_C_D, weight_V_D, bias_V)
            dlogits_C_V.sub_(lse_N[s : s + ctx.chunk, None]).exp_().mul_(-g_C)
            dlogits_C_V.scatter_add_(1, t_C, g_C)
            if need_b:
                grad_b += dlogits_C_V.sum(0)
            dlogits_C_V = dlogits_C_V.to(hidden_N_D.dtype)
            if need_h:
                grad_h[s : s + ctx.chunk] = dlogits_C_V @ weight_V_D
            if need_w:
                grad_w.addmm_(dlogits_C_V.T.to(acc), h_C_D.to(acc))
            del dlogits_C_V
        return (
            grad_h,
            grad_w.to(weight_V_D.dtype) if need_w else None,
            grad_b.to(bias_V.dtype) if need_b else None,
            None,
            None,
            None,
        )
