"""The decode step's building blocks over a paged KV cache, each twice: a torch reference and a fused Triton kernel.

`continuous_batching.py` runs a decoder layer as a handful of these calls
instead of the ~60 small kernels an eager transformers layer launches; on
a GPU the Triton versions (one launch each) are what its CUDA graphs
replay, elsewhere the torch versions run (CPU, and tests of the kernels
against them). Both compute the same function in fp32 and round once to the
activations' dtype, so they agree to that dtype's rounding.

The cache of one layer is `[pages, kv_heads, page_tokens, head_dim]`: a
token at cache slot s lives in page s // page_tokens at offset
s % page_tokens, so one page of one head is a contiguous tile. A sequence's
pages are listed in its row of the block table.

* `add_rmsnorm`: the residual sum (in the activations' dtype, as an eager
  layer adds) and its RMS norm, in one pass.
* `qk_norm_rope_store`: split the fused QKV projection, RMS-normalise q and
  k per head (Qwen3; skipped when the model has no such norms), rotate them
  (RoPE, rotate-half convention, cos/sin looked up per token), write k and
  v into the cache slot of each token and return q.
* `paged_decode_attention`: one query token per row against its sequence's
  cached keys (split-K "flash decoding": each of `splits` programs per row
  and KV head runs an online softmax over its share of the pages, a second
  kernel merges the shares; with one split the first writes the output),
  GQA by loading each KV head once for its group of query heads.
* `silu_mul`: SwiGLU's silu(gate) * up over the fused gate/up projection.
* `sample_tokens`: Gumbel-max sampling and the untempered logprob of the
  pick, in one pass over each row's logits (on a GPU, one pass over each
  share of the vocabulary, then a merge of each row's shares, so that a
  small batch still fills the SMs). The noise is a counter-based
  hash of (request seed, token index, vocabulary id), not a stateful
  generator: a request draws the same noise whichever batch it is in, and
  the torch and Triton versions draw the same numbers.
* `advance`: the next decode step's inputs from the tokens just sampled
  (token, position, cache slot, length, token index), in place, on the
  device: one launch on a GPU instead of a dozen small torch ops.

Simplified: no top-k/top-p in the fused sampler (the caller filters the
logits first when a request asks for them, see `filter_logits`), and the
attention kernel needs page_tokens ≥ 16 (the minimum tile of a tensor-core
product) and a power-of-two head_dim.
"""

from __future__ import annotations

import functools

import torch

M32 = 0xFFFFFFFF
MIX_A, MIX_B = 0x7FEB352D, 0x846CA68B  # lowbias32 (C. Wellons): a full-avalanche 32-bit mixer
SEED_SALT, STEP_SALT = 0x9E3779B9, 0x85EBCA6B


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# ---- torch references ----


def add_rmsnorm_torch(x_N_D: torch.Tensor, residual_N_D: torch.Tensor | None, weight_D: torch.Tensor, eps: float):
    """(norm(x + residual) * weight, x + residual); residual None: norm of x alone, x returned as the residual."""
    total = x_N_D if residual_N_D is None else x_N_D + residual_N_D
    xf = total.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight_D.float()).to(x_N_D.dtype), total


def _head_rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if weight is None:
        return x
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _rope(x_N_H_d: torch.Tensor, cos_N_d: torch.Tensor, sin_N_d: torch.Tensor) -> torch.Tensor:
    half = x_N_H_d.shape[-1] // 2
    rotated = torch.cat([-x_N_H_d[..., half:], x_N_H_d[..., :half]], dim=-1)
    return x_N_H_d * cos_N_d[:, None] + rotated * sin_N_d[:, None]


def qk_norm_rope_store_torch(
    qkv_N_F, cos_N_d, sin_N_d, q_norm, k_norm, eps, k_cache, v_cache, slots_N, n_q_heads, n_kv_heads
):
    """q [N, Hq, d] ready for attention; k and v written into the cache at `slots_N`."""
    n, d = qkv_N_F.shape[0], cos_N_d.shape[-1]
    q, k, v = qkv_N_F.float().split([n_q_heads * d, n_kv_heads * d, n_kv_heads * d], dim=-1)
    q = _rope(_head_rms(q.view(n, n_q_heads, d), q_norm, eps), cos_N_d.float(), sin_N_d.float())
    k = _rope(_head_rms(k.view(n, n_kv_heads, d), k_norm, eps), cos_N_d.float(), sin_N_d.float())
    page_tokens = k_cache.shape[2]
    page_N, offset_N = slots_N // page_tokens, slots_N % page_tokens
    k_cache[page_N, :, offset_N] = k.to(k_cache.dtype)
    v_cache[page_N, :, offset_N] = v.view(n, n_kv_heads, d).to(v_cache.dtype)
    return q.to(qkv_N_F.dtype)


def gather_pages(cache, pages_P: torch.Tensor, length: int) -> torch.Tensor:
    """[kv_heads, length, d]: one sequence's cached keys or values, its pages laid end to end."""
    tiles = cache[pages_P]  # [P, H, page, d]
    return tiles.permute(1, 0, 2, 3).reshape(cache.shape[1], -1, cache.shape[3])[:, :length]


def paged_decode_attention_torch(q_N_H_d, k_cache, v_cache, block_tables, seq_lens_N, scale: float, splits: int = 1):
    """softmax(q·K/√d)·V per row over its first seq_lens[row] cached tokens; [N, Hq·d]. (`splits`: kernel only.)"""
    n, heads, d = q_N_H_d.shape
    page_tokens = k_cache.shape[2]
    longest = int(seq_lens_N.max())
    pages = block_tables[:n, : -(-longest // page_tokens)].long()
    k = k_cache[pages].permute(0, 2, 1, 3, 4).reshape(n, k_cache.shape[1], -1, d)[:, :, :longest]
    v = v_cache[pages].permute(0, 2, 1, 3, 4).reshape(n, v_cache.shape[1], -1, d)[:, :, :longest]
    mask = (torch.arange(longest, device=q_N_H_d.device)[None] < seq_lens_N[:, None])[:, None, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q_N_H_d[:, :, None].float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[:, :, 0].reshape(n, heads * d).to(q_N_H_d.dtype)


def silu_mul_torch(gate_up_N_F: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up_N_F.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up_N_F.dtype)


def _mix_torch(x: torch.Tensor) -> torch.Tensor:
    # int64 holding uint32 values: products wrap past 2^63, but their low 32 bits (all that is kept) are exact.
    x = x ^ (x >> 16)
    x = (x * MIX_A) & M32
    x = x ^ (x >> 15)
    x = (x * MIX_B) & M32
    return x ^ (x >> 16)


def gumbel_noise_torch(seeds_B: torch.Tensor, steps_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] Gumbel(0, 1) noise, a function of (seed, step, token id) alone."""
    seeds_B, steps_B = seeds_B.long(), steps_B.long()
    row = _mix_torch((seeds_B & M32) ^ _mix_torch(((seeds_B >> 32) & M32) ^ SEED_SALT))
    row = _mix_torch(row ^ ((steps_B * STEP_SALT) & M32))
    u = _mix_torch(row[:, None] ^ torch.arange(vocab, device=seeds_B.device)[None])
    uniform = ((u >> 8).float() + 0.5) * (1.0 / 16777216.0)  # 24 bits: exact in fp32, never 0 or 1
    return -torch.log(-torch.log(uniform))


def sample_tokens_torch(logits_B_V, temperatures_B, seeds_B, steps_B, filtered_B_V=None):
    """(token [B] int64, logp [B] fp32): argmax of logits/T + Gumbel noise (T = 0: argmax), logp untempered.

    `filtered_B_V` (top-k/top-p masked logits, -inf outside) replaces the logits in the draw only.
    """
    logits_B_V = logits_B_V.float()
    draw = (filtered_B_V if filtered_B_V is not None else logits_B_V).float()
    hot = temperatures_B > 0
    scaled = draw / torch.where(hot, temperatures_B, 1.0)[:, None] + torch.where(
        hot[:, None], gumbel_noise_torch(seeds_B, steps_B, draw.shape[1]), 0.0
    )
    tokens_B = scaled.argmax(dim=-1)
    logp_B = logits_B_V.gather(1, tokens_B[:, None]).squeeze(1) - torch.logsumexp(logits_B_V, dim=-1)
    return tokens_B, logp_B


# ---- Triton kernels (CUDA) ----


def _kernels():
    from tbexp.backends import paged_triton as k

    return {
        "add_rmsnorm": k.add_rmsnorm_kernel,
        "qk_rope_store": k.qk_rope_store_kernel,
        "paged_attn": k.paged_attn_kernel,
        "merge_splits": k.merge_splits_kernel,
        "silu_mul": k.silu_mul_kernel,
        "sample_part": k.sample_part_kernel,
        "sample_merge": k.sample_merge_kernel,
        "advance": k.advance_kernel,
    }


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def add_rmsnorm_triton(x_N_D, residual_N_D, weight_D, eps: float):
    out = torch.empty_like(x_N_D)
    res_out = torch.empty_like(x_N_D) if residual_N_D is not None else x_N_D
    n, d = x_N_D.shape
    _kernels()["add_rmsnorm"][(n,)](
        x_N_D,
        residual_N_D if residual_N_D is not None else x_N_D,
        weight_D,
        out,
        res_out,
        d,
        eps,
        HAS_RES=residual_N_D is not None,
        BLOCK_D=_pow2(d),
    )
    return out, res_out


def qk_norm_rope_store_triton(
    qkv_N_F, cos_N_d, sin_N_d, q_norm, k_norm, eps, k_cache, v_cache, slots_N, n_q_heads, n_kv_heads
):
    n, d = qkv_N_F.shape[0], cos_N_d.shape[-1]
    q = torch.empty(n, n_q_heads, d, dtype=qkv_N_F.dtype, device=qkv_N_F.device)
    has_norm = q_norm is not None
    _kernels()["qk_rope_store"][(n, n_q_heads + n_kv_heads)](
        qkv_N_F,
        cos_N_d,
        sin_N_d,
        q_norm if has_norm else cos_N_d,
        k_norm if has_norm else cos_N_d,
        q,
        k_cache,
        v_cache,
        slots_N,
        eps,
        HQ=n_q_heads,
        HKV=n_kv_heads,
        HEAD_D=d,
        PAGE=k_cache.shape[2],
        HAS_NORM=has_norm,
    )
    return q


# Pages a step (CHUNK), warps and pipelining stages of the attention kernel (scripts/tune_paged_attention.py).
# Measured on an H200 for the Qwen3-1.7B shape at 16, 64 and 256 rows (1,280-token contexts, each sequence's
# pages in order as a live cache mostly has them, graph-replayed): the best at each, 1-3.5% faster than 4 pages a
# step (28, 84 and 301 us a layer: 3.0, 4.0 and 4.5 TB/s of K/V read).
ATTENTION_LAUNCH: dict = {"CHUNK": 2, "num_warps": 4, "num_stages": 3}


def paged_decode_attention_triton(
    q_N_H_d, k_cache, v_cache, block_tables, seq_lens_N, scale: float, splits: int = 1, launch: dict | None = None
):
    n, heads, d = q_N_H_d.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty(n, heads * d, dtype=q_N_H_d.dtype, device=q_N_H_d.device)
    direct = splits == 1  # the kernel writes the output; no partial results to merge
    acc = out if direct else torch.empty(n, heads, splits, d, dtype=torch.float32, device=q_N_H_d.device)
    ml = out if direct else torch.empty(n, heads, splits, 2, dtype=torch.float32, device=q_N_H_d.device)
    kernels = _kernels()
    kernels["paged_attn"][(n, kv_heads, splits)](
        q_N_H_d,
        k_cache,
        v_cache,
        block_tables,
        seq_lens_N,
        acc,
        ml,
        out,
        scale,
        block_tables.stride(0),
        splits,
        HQ=heads,
        HKV=kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, _pow2(group)),
        HEAD_D=d,
        PAGE=k_cache.shape[2],
        DIRECT=direct,
        **{"CHUNK": 1, **(ATTENTION_LAUNCH if launch is None else launch)},
    )
    if not direct:
        kernels["merge_splits"][(n * heads,)](acc, ml, out, splits, SPLITS_PAD=_pow2(splits), HEAD_D=d)
    return out


def silu_mul_triton(gate_up_N_F):
    n, f = gate_up_N_F.shape
    out = torch.empty(n, f // 2, dtype=gate_up_N_F.dtype, device=gate_up_N_F.device)
    block = 1024
    _kernels()["silu_mul"][(n, -(-(f // 2) // block))](gate_up_N_F, out, f // 2, BLOCK=block)
    return out


# The sampler's share of the vocabulary a program: SAMPLE_BLOCKS blocks of SAMPLE_BLOCK_V ids (151,936 ids:
# 10 shares a row), so that a batch of 16-64 rows spreads over every SM instead of one program a row.
SAMPLE_BLOCK_V, SAMPLE_BLOCKS = 4096, 4


def sample_tokens_triton(logits_B_V, temperatures_B, seeds_B, steps_B, filtered_B_V=None):
    if filtered_B_V is not None:  # the filtered draw needs both logit sets: the reference does it
        return sample_tokens_torch(logits_B_V, temperatures_B, seeds_B, steps_B, filtered_B_V)
    b, v = logits_B_V.shape
    logits_B_V = logits_B_V.contiguous()
    parts = -(-v // (SAMPLE_BLOCK_V * SAMPLE_BLOCKS))
    shares = torch.empty(b, parts, 4, dtype=torch.float32, device=logits_B_V.device)
    tokens = torch.empty(b, dtype=torch.long, device=logits_B_V.device)
    logp = torch.empty(b, dtype=torch.float32, device=logits_B_V.device)
    kernels = _kernels()
    kernels["sample_part"][(b, parts)](
        logits_B_V,
        temperatures_B.float().contiguous(),
        seeds_B,
        steps_B,
        shares,
        v,
        parts,
        BLOCKS=SAMPLE_BLOCKS,
        BLOCK_V=SAMPLE_BLOCK_V,
    )
    kernels["sample_merge"][(b,)](logits_B_V, shares, tokens, logp, v, parts, PARTS_PAD=max(2, _pow2(parts)))
    return tokens, logp


def advance_torch(step_inputs_4_B, sample_inputs_2_B, block_tables, tokens_N, page_tokens: int):
    """The next decode step's inputs of rows 0..N-1, in place: feed the sampled token one position on.

    step_inputs rows: token, position, cache slot, length; sample_inputs rows: seed, token index. A row one step
    past its end (its token is dropped) may point past its pages, where its block table holds the scratch page
    (past the table's last column, to which its page is clamped).
    """
    n = tokens_N.shape[0]
    token, position, slot, length = step_inputs_4_B[:, :n]
    token.copy_(tokens_N)
    position += 1
    length += 1
    page = (position // page_tokens).clamp_(max=block_tables.shape[1] - 1)
    slot.copy_(block_tables[:n].gather(1, page[:, None]).squeeze(1) * page_tokens)
    slot += position % page_tokens
    sample_inputs_2_B[1, :n] += 1


def advance_triton(step_inputs_4_B, sample_inputs_2_B, block_tables, tokens_N, page_tokens: int):
    n, stride = tokens_N.shape[0], step_inputs_4_B.stride(0)
    assert sample_inputs_2_B.stride(0) == stride and step_inputs_4_B.is_contiguous()
    block = 256
    _kernels()["advance"][(-(-n // block),)](
        step_inputs_4_B,
        sample_inputs_2_B,
        block_tables,
        tokens_N,
        n,
        stride,
        block_tables.stride(0),
        block_tables.shape[1],
        PAGE=page_tokens,
        BLOCK=block,
    )


OPS = {
    "torch": {
        "add_rmsnorm": add_rmsnorm_torch,
        "qk_norm_rope_store": qk_norm_rope_store_torch,
        "attention": paged_decode_attention_torch,
        "silu_mul": silu_mul_torch,
        "sample": sample_tokens_torch,
        "advance": advance_torch,
    },
    "triton": {
        "add_rmsnorm": add_rmsnorm_triton,
        "qk_norm_rope_store": qk_norm_rope_store_triton,
        "attention": paged_decode_attention_triton,
        "silu_mul": silu_mul_triton,
        "sample": sample_tokens_triton,
        "advance": advance_triton,
    },
}
