"""The Triton kernels behind `paged_kernels.py`'s `*_triton` functions (imported only where Triton is installed).

paged_kernels.py's docstring says what each computes; each matches its torch
reference there to the activations' dtype's rounding.
"""

import triton
import triton.language as tl


@triton.jit
def add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, D, eps, HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * D + offs, mask=mask, other=0.0)  # summed in the activations' dtype
        tl.store(res_out_ptr + row * D + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + offs, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def qk_rope_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    qn_ptr,
    kn_ptr,
    q_out_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_D: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    half = tl.arange(0, HEAD_D // 2)
    row = qkv_ptr + n * (HQ + 2 * HKV) * HEAD_D + h * HEAD_D
    x1 = tl.load(row + half).to(tl.float32)
    x2 = tl.load(row + HEAD_D // 2 + half).to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_D + eps)
        is_q = h < HQ  # both norms' weights are loaded (a few bytes): no branch on a pointer
        w1 = tl.where(is_q, tl.load(qn_ptr + half), tl.load(kn_ptr + half)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qn_ptr + HEAD_D // 2 + half), tl.load(kn_ptr + HEAD_D // 2 + half)).to(tl.float32)
        x1 = x1 * rstd * w1
        x2 = x2 * rstd * w2
    c1 = tl.load(cos_ptr + n * HEAD_D + half)
    c2 = tl.load(cos_ptr + n * HEAD_D + HEAD_D // 2 + half)
    s1 = tl.load(sin_ptr + n * HEAD_D + half)
    s2 = tl.load(sin_ptr + n * HEAD_D + HEAD_D // 2 + half)
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
    if h < HQ:
        out = q_out_ptr + (n * HQ + h) * HEAD_D
        tl.store(out + half, y1.to(q_out_ptr.dtype.element_ty))
        tl.store(out + HEAD_D // 2 + half, y2.to(q_out_ptr.dtype.element_ty))
    else:
        kh = h - HQ
        slot = tl.load(slots_ptr + n)
        dst = ((slot // PAGE) * HKV + kh) * PAGE * HEAD_D + (slot % PAGE) * HEAD_D
        tl.store(kc_ptr + dst + half, y1.to(kc_ptr.dtype.element_ty))
        tl.store(kc_ptr + dst + HEAD_D // 2 + half, y2.to(kc_ptr.dtype.element_ty))
        full = tl.arange(0, HEAD_D)
        v = tl.load(qkv_ptr + n * (HQ + 2 * HKV) * HEAD_D + (HQ + HKV + kh) * HEAD_D + full)
        tl.store(vc_ptr + dst + full, v.to(vc_ptr.dtype.element_ty))


@triton.jit
def paged_attn_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    lens_ptr,
    acc_ptr,
    ml_ptr,
    out_ptr,
    scale,
    bt_stride,
    SPLITS,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_D: tl.constexpr,
    PAGE: tl.constexpr,
    CHUNK: tl.constexpr,
    DIRECT: tl.constexpr,
):
    # One program: one sequence, one KV head, one split of its pages, walked CHUNK pages (CHUNK·PAGE tokens) an
    # iteration: each token's page comes from the block table, so a tile spans several scattered pages.
    n = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + n)
    chunks = tl.cdiv(length, PAGE * CHUNK)
    per_split = tl.cdiv(chunks, SPLITS)
    c0 = split * per_split
    c1 = tl.minimum(c0 + per_split, chunks)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_D)
    t = tl.arange(0, PAGE * CHUNK)
    heads = kh * GROUP + g
    q = tl.load(q_ptr + (n * HQ + heads)[:, None] * HEAD_D + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_D], tl.float32)
    for c in range(c0, c1):
        token = c * PAGE * CHUNK + t
        live = token < length
        page = tl.load(bt_ptr + n * bt_stride + token // PAGE, mask=live, other=0).to(tl.int64)
        tile = ((page * HKV + kh) * PAGE + token % PAGE)[:, None] * HEAD_D + d[None, :]
        k = tl.load(kc_ptr + tile, mask=live[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        prob = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(prob, axis=1)
        v = tl.load(vc_ptr + tile, mask=live[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v)
        m = m_new
    keep = g < GROUP
    if DIRECT:  # one split: the output itself (what merge_splits_kernel gives for one split: acc / l)
        out = (acc / l[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (n * HQ + heads)[:, None] * HEAD_D + d[None, :], out, mask=keep[:, None])
    else:
        part = (n * HQ + heads) * SPLITS + split
        tl.store(acc_ptr + part[:, None] * HEAD_D + d[None, :], acc, mask=keep[:, None])
        tl.store(ml_ptr + part * 2, m, mask=keep)
        tl.store(ml_ptr + part * 2 + 1, l, mask=keep)


@triton.jit
def merge_splits_kernel(acc_ptr, ml_ptr, out_ptr, SPLITS, SPLITS_PAD: tl.constexpr, HEAD_D: tl.constexpr):
    nh = tl.program_id(0)  # row * HQ + head
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_D)
    valid = s < SPLITS
    m = tl.load(ml_ptr + (nh * SPLITS + s) * 2, mask=valid, other=float("-inf"))
    l = tl.load(ml_ptr + (nh * SPLITS + s) * 2 + 1, mask=valid, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(valid & (m > float("-inf")), tl.exp(m - top), 0.0)
    acc = tl.load(acc_ptr + (nh * SPLITS + s)[:, None] * HEAD_D + d[None, :], mask=valid[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + nh * HEAD_D + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, INTER, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(gu_ptr + n * 2 * INTER + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + n * 2 * INTER + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * INTER + offs, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def mix(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def sample_part_kernel(
    logits_ptr, temp_ptr, seed_ptr, step_ptr, part_ptr, V, PARTS, BLOCKS: tl.constexpr, BLOCK_V: tl.constexpr
):
    # One program: one row's share of the vocabulary (BLOCKS blocks of BLOCK_V ids): its running max and sum of
    # exp (the logsumexp), and its best Gumbel-perturbed id; sample_merge_kernel combines a row's shares.
    row = tl.program_id(0)
    part = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    seed = tl.load(seed_ptr + row).to(tl.int64)
    step = tl.load(step_ptr + row).to(tl.int64)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = mix(lo ^ mix(hi ^ 0x9E3779B9))
    key = mix(key ^ ((step * 0x85EBCA6B) & 0xFFFFFFFF).to(tl.uint32))
    hot = temp > 0
    inv_t = 1.0 / tl.where(hot, temp, 1.0)
    run_m = float("-inf")
    run_s = 0.0
    best_z = float("-inf")
    best_i = 0
    for j in tl.static_range(BLOCKS):
        v0 = (part * BLOCKS + j) * BLOCK_V
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.load(logits_ptr + row.to(tl.int64) * V + offs, mask=mask, other=float("-inf")).to(tl.float32)
        block_m = tl.max(x, axis=0)
        new_m = tl.maximum(run_m, block_m)
        # A block wholly past V adds nothing (its max is -inf; the guard keeps exp(-inf - -inf) out).
        run_s = tl.where(
            new_m > float("-inf"), run_s * tl.exp(run_m - new_m) + tl.sum(tl.exp(x - new_m), axis=0), run_s
        )
        run_m = new_m
        u = mix(key ^ offs.to(tl.uint32))
        uniform = ((u >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        z = tl.where(hot, x * inv_t - tl.log(-tl.log(uniform)), x)
        z = tl.where(mask, z, float("-inf"))
        block_z = tl.max(z, axis=0)
        block_i = tl.argmax(z, axis=0)
        better = block_z > best_z
        best_i = tl.where(better, v0 + block_i, best_i)
        best_z = tl.where(better, block_z, best_z)
    out = part_ptr + (row * PARTS + part) * 4
    tl.store(out, run_m)
    tl.store(out + 1, run_s)
    tl.store(out + 2, best_z)
    tl.store(out + 3, best_i.to(tl.float32))  # < 2^24: exact


@triton.jit
def sample_merge_kernel(logits_ptr, part_ptr, tok_ptr, logp_ptr, V, PARTS, PARTS_PAD: tl.constexpr):
    row = tl.program_id(0)
    p = tl.arange(0, PARTS_PAD)
    valid = p < PARTS
    base = part_ptr + (row * PARTS + p) * 4
    m = tl.load(base, mask=valid, other=float("-inf"))
    s = tl.load(base + 1, mask=valid, other=0.0)
    z = tl.load(base + 2, mask=valid, other=float("-inf"))
    i = tl.load(base + 3, mask=valid, other=0.0)
    top = tl.max(m, axis=0)
    total = tl.sum(tl.where(valid, s * tl.exp(m - top), 0.0), axis=0)
    # The first share holding the largest z: shares are in id order, so ties go to the lowest id, as in one pass.
    best = tl.argmax(z, axis=0)
    best_i = tl.sum(tl.where(p == best, i, 0.0), axis=0).to(tl.int64)
    picked = tl.load(logits_ptr + row.to(tl.int64) * V + best_i).to(tl.float32)
    tl.store(tok_ptr + row, best_i)
    tl.store(logp_ptr + row, picked - top - tl.log(total))


@triton.jit
def advance_kernel(
    step_ptr, samp_ptr, bt_ptr, tok_ptr, n, stride, bt_stride, max_pages, PAGE: tl.constexpr, BLOCK: tl.constexpr
):
    # The next decode step's inputs of rows 0..n-1 (step_ptr: token, position, slot, length rows of `stride`).
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = r < n
    token = tl.load(tok_ptr + r, mask=live)
    position = tl.load(step_ptr + stride + r, mask=live) + 1
    length = tl.load(step_ptr + 3 * stride + r, mask=live) + 1
    page = tl.minimum(position // PAGE, max_pages - 1)
    block = tl.load(bt_ptr + r.to(tl.int64) * bt_stride + page, mask=live, other=0).to(tl.int64)
    tl.store(step_ptr + r, token, mask=live)
    tl.store(step_ptr + stride + r, position, mask=live)
    tl.store(step_ptr + 2 * stride + r, block * PAGE + position % PAGE, mask=live)
    tl.store(step_ptr + 3 * stride + r, length, mask=live)
    tl.store(samp_ptr + stride + r, tl.load(samp_ptr + stride + r, mask=live) + 1, mask=live)
