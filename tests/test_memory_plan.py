"""The local backend's GPU memory plan (backends/memory_plan.py): hand-computed bytes, real shapes, and the
counts of what autograd saves, all on the CPU; the backend refuses a job that cannot fit before its first step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tinker import types
from transformers import Qwen3Config, Qwen3ForCausalLM

import tbexp.backends.local as local
from tbexp.backends.batch_sampling import Request
from tbexp.backends.local import LocalBackend
from tbexp.backends.memory_plan import (
    DEFAULT_FRACTION,
    GIB,
    OVERHEAD_BYTES,
    MemoryPlanError,
    ModelShape,
    Sampling,
    Training,
    plan_memory,
    wants_checkpointing,
)
from tests.test_continuous_batching import lora_backend
from tests.test_local_backend import TARGETS, random_tokens, sft_datum

H100_BYTES = 81559 * 2**20  # what torch reports for an H100 80GB HBM3: 79.6 GiB
H200_BYTES = 143771 * 2**20


def qwen3_config(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=tied,
    )


QWEN3_1_7B = qwen3_config(2048, 6144, 28, 16, tied=True)
QWEN3_8B = qwen3_config(4096, 12288, 36, 32, tied=False)
LORA_R32 = dict(lora_rank=32, lora_targets=tuple(TARGETS))
GRPO_64 = Sampling(continuous_batching=True, max_sequences=64, sequence_tokens=1024 + 512)  # 64 episodes at once


def tiny_shape() -> ModelShape:
    # 2 layers, width 64, 4 query heads and 2 KV heads of 16, MLP 128, vocabulary 300, tied head, q/k norms, bf16
    return ModelShape(2, 64, 4, 2, 16, 128, 300, tied_head=True, qk_norm=True, weight_bytes=2)


# ---- math: bytes by hand ----


def test_a_tiny_decoders_parts_weigh_what_they_hold():
    m = tiny_shape()
    # A layer: q 64·64, k and v 64·32 each, o 64·64, gate and up 64·128 each, down 128·64; two RMSNorms of 64 and the
    # q/k norms of 16 each.
    layer = 4096 + 2 * 2048 + 4096 + 3 * 8192 + 2 * 64 + 2 * 16
    assert m.layer_params() == layer == 37024
    assert m.params() == 2 * layer + 300 * 64 + 64  # tied embedding counted once; the final norm
    # LoRA r4: r·(in + out) per adapted layer: q 4·128, k and v 4·96, o 4·128, gate, up and down 4·192.
    assert m.lora_params(4, tuple(TARGETS)) == 2 * (512 + 2 * 384 + 512 + 3 * 768) == 8192
    assert m.lora_params(4, ("q_proj", "lm_head")) == 2 * 512  # a target that is no decoder linear adds nothing
    assert m.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads of 16, bf16
    assert m.decode_weight_bytes() == (2 * layer + 64) * 2


def test_a_tiny_layers_activations_and_a_micro_batch_by_hand():
    m = tiny_shape()
    norms = 2 * (4 * 64 + 4 + 2 * 64)  # two RMSNorms: fp32 input and rsqrt, bf16 output
    qk_norms = 4 * (4 + 2) * (16 + 1)  # fp32 q and k per head, and their rsqrt
    attention = 2 * (4 + 2 * 4) * 16 + 2 * 4 * 16 + 4 * 4  # q and the KV heads repeated to 4; output; logsumexp
    mlp = 4 * 2 * 128
    lora = 2 * 4 * 7
    per_layer = norms + qk_norms + attention + mlp + lora
    assert m.layer_activation_bytes_per_token(4, 7) == per_layer == 2792
    outside = 4 * 64 + 2 * 2 * 64 + 40  # final norm's fp32 input, the head's input and its gradient, loss inputs
    backward = 2 * 2 * 128  # one layer's MLP gradients
    head = 8 * 1000 * 300  # the chunk (default: 2**25 // 300 positions) is the whole 1,000-token batch
    plain = Training(microbatch_tokens=1000, checkpointing=False, lora_rank=4, lora_targets=tuple(TARGETS))
    assert plain.activation_bytes(m) == 1000 * (2 * per_layer + outside + backward) + head == 9_048_000
    ckpt = Training(microbatch_tokens=1000, checkpointing=True, lora_rank=4, lora_targets=tuple(TARGETS))
    kept = 1000 * (2 * 2 * 64 + outside)  # each layer's bf16 input
    assert ckpt.activation_bytes(m) == kept + max(head, 1000 * (per_layer + backward)) == 4_112_000
    assert plain.trainable_bytes(m) == 8192 * (4 + 4 + 8 + 4)  # fp32 weight, gradient, Adam's moments, a snapshot
    # A datum longer than the budget is a micro-batch of its own: the pass is planned at the longest datum.
    long = replace(plain, longest_datum_tokens=4000)
    assert long.activation_bytes(m) == replace(plain, microbatch_tokens=4000).activation_bytes(m)
    with pytest.raises(MemoryPlanError, match=r"lower model.max_length_tokens \(now 4,000"):
        plan_memory(m, long, Sampling(False, 1, 4000), OVERHEAD_BYTES + 30 * 2**20, 1.0)


def test_the_pool_gets_what_the_budget_leaves_and_a_job_that_cannot_fit_is_refused():
    m = tiny_shape()
    training = Training(microbatch_tokens=1000, checkpointing=False, lora_rank=4, lora_targets=tuple(TARGETS))
    sampling = Sampling(continuous_batching=True, max_sequences=256, sequence_tokens=4096)
    card = int(1.25 * GIB)
    plan = plan_memory(m, training, sampling, card, 0.9)
    rest = plan.weights + plan.trainable + plan.decode + max(plan.training, plan.sampling) + OVERHEAD_BYTES
    assert plan.kv_tokens == (int(0.9 * card) - rest) // 256 < 256 * 4096  # every byte left, 256 a token
    assert plan.peak_bytes <= int(0.9 * card) < plan.peak_bytes + 256
    capped = plan_memory(m, training, Sampling(True, max_sequences=4, sequence_tokens=256), card, 0.9)
    assert capped.kv_tokens == 4 * 256  # no more than the running batch can hold at once
    with pytest.raises(MemoryPlanError) as refused:
        plan_memory(m, training, sampling, card, 0.8)  # 1 GiB: the overhead alone takes it
    message = str(refused.value)
    for figure in ("backend.microbatch_tokens", "backend.gradient_checkpointing=true", "gpu_memory_fraction"):
        assert figure in message
    with pytest.raises(MemoryPlanError, match="backend.kv_cache_tokens"):  # a pool set by hand must fit too
        plan_memory(m, training, Sampling(True, 4, 256, kv_cache_tokens=10**7), card, 0.9)
    with pytest.raises(MemoryPlanError, match="must lie in"):
        plan_memory(m, training, sampling, card, 1.5)


# ---- real shapes ----


@pytest.mark.parametrize("config", [QWEN3_1_7B, QWEN3_8B], ids=["qwen3-1.7b", "qwen3-8b"])
def test_parameter_counts_are_those_of_the_real_modules(config):
    """Built on the meta device (no memory): transformers' Qwen3 and peft's LoRA r32 on the seven linear layers."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    shape = ModelShape.of(config, 2)
    assert shape.params() == sum(p.numel() for p in model.parameters())
    lora = get_peft_model(model, LoraConfig(r=32, lora_alpha=64, target_modules=TARGETS))
    assert shape.lora_params(32, tuple(TARGETS)) == sum(p.numel() for p in lora.parameters() if p.requires_grad)


def test_qwen3_8b_grpo_step_fits_one_80gb_card_only_with_checkpointing():
    """64 episodes × (1,024 prompt + 512 new tokens), 16,384-token micro-batches, 4,096-position loss chunks."""
    m = ModelShape.of(QWEN3_8B, 2)
    assert m.params() == 8_190_735_360 and m.kv_bytes_per_token() == 2 * 36 * 8 * 128 * 2  # 144 KiB a token
    plain = Training(microbatch_tokens=16384, checkpointing=False, logprob_chunk_tokens=4096, **LORA_R32)
    assert wants_checkpointing(m, plain, GRPO_64, H100_BYTES, DEFAULT_FRACTION)
    with pytest.raises(MemoryPlanError, match="set backend.gradient_checkpointing=true"):
        plan_memory(m, plain, GRPO_64, H100_BYTES, DEFAULT_FRACTION)
    plan = plan_memory(
        m, Training(16384, True, logprob_chunk_tokens=4096, **LORA_R32), GRPO_64, H100_BYTES, DEFAULT_FRACTION
    )
    assert plan.budget_bytes <= 72 * GIB and plan.peak_bytes <= 72 * GIB
    assert plan.kv_tokens == 64 * 1536  # every episode's reservation at once, without counting shared prompts
    assert plan.weights == 8_190_735_360 * 2
    # Each layer keeps its 8 KiB bf16 input; one layer is recomputed at a time.
    assert plan.training < 10 * GIB
    assert 15 * GIB < plan.weights < 16 * GIB and 12.5 * GIB < plan.decode < 13.5 * GIB


def test_qwen3_1_7b_grpo_step_checkpoints_on_an_h100_not_on_an_h200():
    m = ModelShape.of(QWEN3_1_7B, 2)
    plain = Training(microbatch_tokens=16384, checkpointing=False, logprob_chunk_tokens=4096, **LORA_R32)
    # Without checkpointing the pass takes ~49 GiB: it fits an H100's 67.7 GiB budget with the step's 98k-token pool,
    # but leaves the pool under a quarter of the budget, so the default turns checkpointing on there.
    assert plan_memory(m, plain, GRPO_64, H100_BYTES, DEFAULT_FRACTION).peak_bytes <= DEFAULT_FRACTION * H100_BYTES
    assert 45 * GIB < plain.activation_bytes(m) < 52 * GIB
    assert wants_checkpointing(m, plain, GRPO_64, H100_BYTES, DEFAULT_FRACTION)
    assert not wants_checkpointing(m, plain, GRPO_64, H200_BYTES, DEFAULT_FRACTION)


def test_the_planned_activations_are_what_autograd_saves_for_the_tiny_model(tmp_path):
    """Tensors saved for backward in a real forward_backward, counted by storage, per token and per layer (the
    difference between 3 and 2 layers, and between 64- and 32-token datums): the plan's count, up to the
    attention layout, which it takes as the GPU's packed kernel has it: equal-length padded batches keep the 2 KV
    heads unrepeated, and the CPU's packed path keeps one more copy of the attention output."""
    for dtype, width in ((None, 4), ("bfloat16", 2)):
        for packing in (False, True):
            measured = layer_bytes_saved(
                tmp_path, dtype, packing, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16
            )
            planned = replace(tiny_shape(), weight_bytes=width)
            layout = width * 4 * 16 if packing else -2 * width * (4 - 2) * 16
            assert measured == planned.layer_activation_bytes_per_token(4, 7) + layout, (dtype, packing)


@pytest.mark.slow
def test_the_planned_activations_are_what_autograd_saves_at_qwen3_1_7b_width(tmp_path):
    measured = layer_bytes_saved(
        tmp_path, "bfloat16", True, hidden=2048, intermediate=6144, heads=16, kv_heads=8, head_dim=128
    )
    planned = ModelShape.of(QWEN3_1_7B, 2).layer_activation_bytes_per_token(4, 7)
    assert measured == planned + 2 * 16 * 128  # the CPU's packed path's extra copy of the attention output


def layer_bytes_saved(save_dir, dtype, packing: bool, **shape) -> float:
    """Bytes autograd saves per token for one more decoder layer (LoRA r4 on all seven linear layers)."""
    per_token = {}
    for layers in (2, 3):
        b = tiny_qwen3_backend(save_dir, layers, dtype=dtype, packing=packing, microbatch_tokens=10**6, **shape)
        per_token[layers] = (saved_bytes(b, 64) - saved_bytes(b, 32)) / (2 * 32)
    return per_token[3] - per_token[2]


def saved_bytes(b: LocalBackend, tokens: int) -> int:
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    data = [sft_datum(random_tokens(tokens + 1, 1)), sft_datum(random_tokens(tokens + 1, 2))]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        b.forward_backward(data, "cross_entropy").result()
    return sum(storages.values())


def tiny_qwen3_backend(save_dir, layers: int, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, **kw):
    config = Qwen3Config(
        vocab_size=300,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return lora_backend(save_dir, model=Qwen3ForCausalLM(config), **kw)


# ---- the backend follows its plan ----


@pytest.fixture
def card(monkeypatch):
    """A stand-in GPU of the given size for a backend that runs on the CPU: its plan is made as on that card."""

    def set_card(n_bytes: int) -> None:
        monkeypatch.setattr(local, "_card_bytes", lambda device: n_bytes)

    return set_card


def test_a_job_that_cannot_fit_is_refused_when_the_backend_is_built(card, tmp_path):
    card(int(1.1 * GIB))  # the default 0.85 of it is less than the 1 GiB overhead alone
    with pytest.raises(MemoryPlanError, match="does not fit this GPU") as refused:
        tiny_qwen3_backend(tmp_path, 2, continuous_batching=True)
    assert "planned peak" in str(refused.value) and "KV pool at least" in str(refused.value)


def test_checkpointing_turns_on_where_the_plan_needs_it_and_the_pool_is_the_plans(card, tmp_path):
    card(8 * GIB)
    b = tiny_qwen3_backend(tmp_path, 2, continuous_batching=True, microbatch_tokens=8192)
    assert not b.gradient_checkpointing and not b._lm.get_decoder().layers[0].gradient_checkpointing
    greedy = types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])
    b.sampler().sample_batch([Request(random_tokens(5, 1), greedy)])  # builds the running batch
    page = b._batcher.page_tokens  # the pool is the plan's: not 64k tokens, nor a share of free memory
    assert len(b._batcher.pool.refs) - 1 == b.memory_plan.kv_tokens // page > 65536 // page
    # A card on which the pass without checkpointing would leave the pool under a quarter of the budget.
    plain = Training(8192, False, 4, tuple(TARGETS)).activation_bytes(ModelShape.of(b._lm.config, 4))
    card(int((OVERHEAD_BYTES + 1.2 * plain) / DEFAULT_FRACTION))
    tight = tiny_qwen3_backend(tmp_path, 2, continuous_batching=True, microbatch_tokens=8192)
    assert tight.gradient_checkpointing and tight._lm.get_decoder().layers[0].gradient_checkpointing
    asked = tiny_qwen3_backend(tmp_path, 2, microbatch_tokens=8192, gradient_checkpointing=False)
    assert not asked.gradient_checkpointing  # an explicit setting is kept
