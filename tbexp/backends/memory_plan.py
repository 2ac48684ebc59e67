"""One GPU memory budget for the local backend's sampling and training (docs/gpu-sampling.md#one-memory-budget-issue-43).

The local backend samples and trains on one card, one phase after the other. What stays resident through
both phases: the frozen weights, the continuous batcher's merged decode copy of the decoder's linear layers
and its CUDA graphs, the trainable weights with their gradients, AdamW moments and a snapshot copy for
live samplers, and the paged KV pool. What comes and goes: one micro-batch's training pass (its activations
and the chunked LM-head loss) or, while sampling, one prefill chunk or one weight merge; never both at once.
So the job's peak is

    resident + max(training pass, sampling transient) + overhead  ≤  backend.gpu_memory_fraction × card

and the KV pool gets what is left (`kv_cache_tokens=0`), sized once, before the first sampler, instead of
a share of whatever happened to be free then. A configuration whose training pass cannot fit beside the
weights and a pool holding one sequence is refused before the first step (`MemoryPlanError`, naming the
figures and the settings that change them).

Every figure is computed from the shapes (counted bytes, no measurement). The training pass is what autograd
keeps for the backward of a Llama/Qwen-style decoder layer under LoRA, per token:

    input and post-attention RMSNorm   4·D + 4 each (their fp32 input and rsqrt) + b·D (their output)
    q/k RMSNorm (Qwen3)                4·(Hq + Hkv)·d + 4·(Hq + Hkv)
    attention                          b·(Hq + 2·Hkv')·d (q, k, v) + b·Hq·d (output) + 4·Hq (logsumexp)
    MLP                                4·b·I (gate output, SiLU output, up output, their product)
    LoRA                               b·r for each adapted linear layer (the A output that B reads)

with b the activations' bytes (2 under bf16 autocast), Hkv' = Hq where the KV heads are repeated for the
kernel (packed micro-batches, padded ones with a mask: assumed always, which over-counts equal-length padded
batches by 2·b·(Hq − Hkv)·d), plus outside the layers the final norm and the head's input and gradient
(4·D + 2·b·D) and the loss inputs. With per-layer checkpointing a layer keeps only its input (b·D) and the
backward recomputes one layer at a time. The backward of a layer adds 2·b·I (its MLP gradients); the loss
adds 8·C·V bytes (a chunk's fp32 logits and logsumexp temporary, C = logprob_chunk_tokens). A micro-batch is
taken at its full `microbatch_tokens`, or at the longest datum's length where that is longer (a datum is never
split: a longer one is a micro-batch of its own). tests/test_memory_plan.py checks these counts against what autograd
really saves for a tiny and a Qwen3-1.7B-wide model on the CPU, and the parameter counts against the real
modules of Qwen3-1.7B and Qwen3-8B built on the meta device.

Simplified: dense decoders only (`ModelShape.of` returns None for mixture-of-experts configs, which then get
no plan); compiled layers are counted as eager ones (compilation saves less); the allocator's fragmentation
and the CUDA context are one fixed `OVERHEAD_BYTES`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

from tbexp.backends.logprobs import default_chunk_size
from tbexp.errors import TbexpError

GIB = 2**30
DEFAULT_FRACTION = 0.85  # of the card the job plans for: the rest absorbs what the counts below miss
OVERHEAD_BYTES = GIB  # the CUDA context, cuBLAS workspaces and the allocator's rounding: outside the counts below
TRAINABLE_BYTES_PER_PARAM = 4 + 4 + 8 + 4  # fp32 weight, its gradient, AdamW's two moments, a sampler snapshot copy
FP32 = 4
BUCKETS_UP_TO = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
KV_SHARE_WITHOUT_CHECKPOINTING = 0.25  # auto checkpointing: on when the pool would get less of the budget than this


class MemoryPlanError(TbexpError, ValueError):
    """A local-backend configuration that does not fit the card, refused before the first step."""


@dataclass(frozen=True)
class ModelShape:
    """A Llama/Qwen-style dense decoder's sizes, and what its parts weigh in bytes."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_head: bool
    qk_norm: bool
    weight_bytes: int  # bytes per frozen weight (2 for bf16); activations take this width too

    @classmethod
    def of(cls, config, weight_bytes: int) -> ModelShape | None:
        """The shape of a transformers config, or None where the plan does not apply (mixture of experts)."""
        if any(getattr(config, k, 0) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
            return None
        if not getattr(config, "intermediate_size", None):
            return None
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            tied_head=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=getattr(config, "model_type", "") == "qwen3",
            weight_bytes=weight_bytes,
        )

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer, by its module name."""
        q, kv, d, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        return {
            "q_proj": (d, q),
            "k_proj": (d, kv),
            "v_proj": (d, kv),
            "o_proj": (q, d),
            "gate_proj": (d, i),
            "up_proj": (d, i),
            "down_proj": (i, d),
        }

    def layer_params(self) -> int:
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return sum(a * b for a, b in self.linears().values()) + norms

    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_head else 2)
        return self.layers * self.layer_params() + embeddings + self.hidden  # + the final norm

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Trainable parameters of rank-`rank` LoRA on the named linear layers of every decoder layer."""
        shapes = self.linears()  # a target that names none of them (lm_head is refused by the backend) adds nothing
        return self.layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in set(targets) if t in shapes)

    def decode_weight_bytes(self) -> int:
        """The continuous batcher's private merged copy: every layer's linear weights and norms (not the
        embedding or the head, which it reads in place), in the model's dtype."""
        return (self.layers * self.layer_params() + self.hidden) * self.weight_bytes

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.weight_bytes

    def layer_activation_bytes_per_token(self, lora_rank: int, lora_targets: int) -> int:
        """What autograd keeps for one decoder layer's backward, per token (the module docstring's table)."""
        b, d, hq, hkv = self.weight_bytes, self.hidden, self.heads, self.kv_heads
        norms = 2 * (FP32 * d + FP32 + b * d)
        qk_norms = FP32 * (hq + hkv) * (self.head_dim + 1) if self.qk_norm else 0
        attention = b * (hq + 2 * hq) * self.head_dim + b * hq * self.head_dim + FP32 * hq  # KV heads repeated
        mlp = 4 * b * self.intermediate
        return norms + qk_norms + attention + mlp + b * lora_rank * lora_targets

    def decode_bytes_per_row(self) -> int:
        """A decode or prefill token's live intermediates: residual and hidden states, fused QKV, attention output,
        fused gate/up, SiLU·up."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.weight_bytes * (4 * self.hidden + 2 * (q + 2 * kv) + 3 * self.intermediate)


@dataclass(frozen=True)
class Training:
    """How the backend trains: what one forward_backward micro-batch holds."""

    microbatch_tokens: int
    checkpointing: bool
    lora_rank: int  # 0 = full fine-tuning (every weight trains, in fp32)
    lora_targets: tuple[str, ...]
    logprob_chunk_tokens: int = 0  # 0 = logprobs.py's default
    longest_datum_tokens: int = 0  # model.max_length_tokens: a longer datum than the budget is a micro-batch alone

    @property
    def pass_tokens(self) -> int:
        """The most tokens one forward_backward pass holds."""
        return max(self.microbatch_tokens, self.longest_datum_tokens)

    def activation_bytes(self, m: ModelShape) -> int:
        """Peak bytes of one micro-batch's training pass above the resident weights."""
        t, b = self.pass_tokens, m.weight_bytes
        adapted = len(set(self.lora_targets) & set(m.linears())) if self.lora_rank else 0
        layer = m.layer_activation_bytes_per_token(self.lora_rank, adapted)
        if not self.lora_rank:
            layer += b * m.hidden  # the first layer's input norm also saves (its input needs a gradient)
        outside = FP32 * m.hidden + 2 * b * m.hidden + 40  # final norm, head input and its gradient; loss inputs
        backward = 2 * b * m.intermediate  # one layer's MLP gradients while its backward runs
        chunk = self.logprob_chunk_tokens or default_chunk_size(m.vocab)
        head = 8 * min(chunk, t) * m.vocab
        if self.checkpointing:
            kept = t * (m.layers * b * m.hidden + outside)
            return kept + max(head, t * (layer + backward))
        return t * (m.layers * layer + outside + backward) + head

    def trainable_bytes(self, m: ModelShape) -> int:
        params = m.lora_params(self.lora_rank, self.lora_targets) if self.lora_rank else m.params()
        return params * TRAINABLE_BYTES_PER_PARAM


@dataclass(frozen=True)
class Sampling:
    """How the backend samples: the continuous batcher's rows, sequences and pool."""

    continuous_batching: bool
    max_sequences: int  # rows of the running batch
    sequence_tokens: int  # the longest sequence (prompt + reply); the pool holds at least one
    kv_cache_tokens: int = 0  # 0 = what the plan leaves
    prefill_tokens: int = 16384

    def resident_bytes(self, m: ModelShape) -> int:
        """The decode copy of the weights, the graphs' logits and intermediates per batch-size bucket, RoPE tables."""
        if not self.continuous_batching:
            return 0
        buckets = [b for b in BUCKETS_UP_TO if b <= self.max_sequences] + (
            [self.max_sequences] if self.max_sequences > BUCKETS_UP_TO[-1] else []
        )
        graphs = sum(buckets) * (m.vocab * m.weight_bytes + m.decode_bytes_per_row())
        rope = 2 * self.sequence_tokens * m.head_dim * FP32
        return m.decode_weight_bytes() + graphs + rope

    def transient_bytes(self, m: ModelShape) -> int:
        """A prefill chunk's intermediates, or a weight merge's fp32 copies of the widest fused layer."""
        if not self.continuous_batching:
            return 0
        kv_read = 2 * m.kv_heads * m.head_dim * m.weight_bytes  # a packed prefill's K/V read back from the pool
        prefill = self.prefill_tokens * (m.decode_bytes_per_row() + kv_read + 4 * m.head_dim * FP32)
        merge = 3 * 2 * m.intermediate * m.hidden * FP32
        return max(prefill, merge)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of each part, and the KV pool the budget leaves (`kv_tokens`); `peak_bytes` is the job's planned peak."""

    card_bytes: int
    fraction: float
    weights: int
    trainable: int
    decode: int
    training: int
    sampling: int
    kv_tokens: int
    kv_bytes_per_token: int
    checkpointing: bool
    microbatch_tokens: int

    @property
    def budget_bytes(self) -> int:
        return int(self.fraction * self.card_bytes)

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    @property
    def without_kv_bytes(self) -> int:
        return self.weights + self.trainable + self.decode + max(self.training, self.sampling) + OVERHEAD_BYTES

    @property
    def peak_bytes(self) -> int:
        return self.without_kv_bytes + self.kv_bytes

    def describe(self) -> str:
        """One line of figures in GiB, as the backend logs it and the refusal quotes it."""
        parts = [
            ("weights", self.weights),
            ("trainable weights, gradients and AdamW state", self.trainable),
            ("the sampler's merged decode copy and graphs", self.decode),
            (
                f"a {self.microbatch_tokens:,}-token micro-batch's training pass "
                f"(checkpointing {'on' if self.checkpointing else 'off'})",
                self.training,
            ),
            ("a prefill chunk or weight merge (not at once with training)", self.sampling),
            ("CUDA context and allocator slack", OVERHEAD_BYTES),
            (f"KV pool of {self.kv_tokens:,} tokens", self.kv_bytes),
        ]
        figures = ", ".join(f"{name} {_gib(n)}" for name, n in parts if n)
        return (
            f"planned peak {_gib(self.peak_bytes)} of a {_gib(self.budget_bytes)} budget "
            f"(backend.gpu_memory_fraction={self.fraction} of {_gib(self.card_bytes)}): {figures}"
        )


def plan_memory(
    model: ModelShape, training: Training, sampling: Sampling, card_bytes: int, fraction: float
) -> MemoryPlan:
    """The plan for this card, its KV pool sized from what the rest leaves; MemoryPlanError if it cannot fit."""
    if not 0.0 < fraction <= 1.0:
        raise MemoryPlanError(f"backend.gpu_memory_fraction={fraction}: must lie in (0, 1]")
    frozen_params = model.params() if training.lora_rank else 0  # full fine-tuning: every weight is trainable
    plan = MemoryPlan(
        card_bytes=card_bytes,
        fraction=fraction,
        weights=frozen_params * model.weight_bytes,
        trainable=training.trainable_bytes(model),
        decode=sampling.resident_bytes(model),
        training=training.activation_bytes(model),
        sampling=sampling.transient_bytes(model),
        kv_tokens=0,
        kv_bytes_per_token=model.kv_bytes_per_token(),
        checkpointing=training.checkpointing,
        microbatch_tokens=training.pass_tokens,
    )
    if not sampling.continuous_batching:
        _refuse_if_over(plan, 0, training)
        return plan
    left_tokens = max(0, (plan.budget_bytes - plan.without_kv_bytes) // plan.kv_bytes_per_token)
    kv_tokens = sampling.kv_cache_tokens or min(left_tokens, sampling.max_sequences * sampling.sequence_tokens)
    plan = replace(plan, kv_tokens=kv_tokens)
    _refuse_if_over(plan, sampling.sequence_tokens, training)
    return plan


def wants_checkpointing(model: ModelShape, training: Training, sampling: Sampling, card_bytes: int, fraction: float):
    """`gradient_checkpointing=None` on a GPU: on when, without it, the training pass would leave the KV pool
    less than a quarter of the budget (or not fit at all)."""
    budget = fraction * card_bytes
    try:
        plan = plan_memory(
            model, replace(training, checkpointing=False), replace(sampling, kv_cache_tokens=0), card_bytes, fraction
        )
    except MemoryPlanError:
        return True
    return budget - plan.without_kv_bytes < KV_SHARE_WITHOUT_CHECKPOINTING * budget


def for_backend(
    config,
    weight_bytes: int,
    training: Training,
    sampling: Sampling,
    card_bytes: int | None,
    fraction: float,
    checkpointing: bool | None,
) -> tuple[MemoryPlan | None, bool]:
    """A local backend's plan on a card of `card_bytes` and whether it checkpoints (None: `wants_checkpointing`
    decides); no plan, and no checkpointing unless asked, without a card (a CPU) or for a model `ModelShape`
    does not cover."""
    model = ModelShape.of(config, weight_bytes) if card_bytes else None
    if model is None:
        return None, bool(checkpointing)
    if checkpointing is None:
        checkpointing = wants_checkpointing(model, training, sampling, card_bytes, fraction)
    return plan_memory(
        model, replace(training, checkpointing=checkpointing), sampling, card_bytes, fraction
    ), checkpointing


def _refuse_if_over(plan: MemoryPlan, min_kv_tokens: int, training: Training) -> None:
    short = plan.without_kv_bytes + max(plan.kv_tokens, min_kv_tokens) * plan.kv_bytes_per_token - plan.budget_bytes
    if short <= 0:
        return
    per_1k = (plan.training * 1000) // max(1, training.pass_tokens)
    if training.longest_datum_tokens > training.microbatch_tokens:
        advice = [
            f"lower model.max_length_tokens (now {training.longest_datum_tokens:,}: a datum that long is a micro-batch "
            f"of its own; each 1,000 tokens is about {_gib(per_1k)})"
        ]
    else:
        advice = [
            f"lower backend.microbatch_tokens (now {training.microbatch_tokens:,}; each 1,000 tokens is about "
            f"{_gib(per_1k)})"
        ]
    if not training.checkpointing:
        advice.append("set backend.gradient_checkpointing=true")
    if plan.kv_tokens and min_kv_tokens:
        advice.append(f"lower backend.kv_cache_tokens (now {plan.kv_tokens:,})")
    advice.append(f"or raise backend.gpu_memory_fraction (now {plan.fraction})")
    need = f", and the KV pool at least {min_kv_tokens:,} tokens (one sequence)" if min_kv_tokens else ""
    raise MemoryPlanError(
        f"backend=local does not fit this GPU: {_gib(short)} over. {plan.describe()}{need}. To fit: "
        + "; ".join(advice)
    )


def _gib(n: int | float) -> str:
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def pool_on_device(plan: MemoryPlan, available_bytes: int, min_tokens: int) -> int:
    """The planned pool's tokens, shrunk to what the card can still give now (`available_bytes`: free plus what
    torch holds unused) after the decode copy and the larger transient, which are not allocated yet. Another
    process on the card is what makes this smaller than planned."""
    room = available_bytes - plan.decode - max(plan.training, plan.sampling)
    tokens = min(plan.kv_tokens, max(0, room) // plan.kv_bytes_per_token)
    if tokens < min_tokens:
        raise MemoryPlanError(
            f"backend=local: the GPU has {_gib(available_bytes)} free, too little for the planned KV pool of "
            f"{plan.kv_tokens:,} tokens or even one {min_tokens:,}-token sequence beside the rest of the plan "
            f"({plan.describe()}); is another process using this GPU? Lower backend.gpu_memory_fraction or free it"
        )
    if tokens < plan.kv_tokens:
        warnings.warn(
            f"backend=local: KV pool of {tokens:,} tokens instead of the planned {plan.kv_tokens:,}: the GPU has "
            f"{_gib(available_bytes)} free (another process on it?)",
            stacklevel=2,
        )
    return tokens
