"""The local backend on a tiny random Llama: loss math, batching, LoRA, resume, adapters, sampling."""

from __future__ import annotations

import math

import pytest
import torch
from peft import PeftModel
from tinker import types
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tbexp.backends.local import PACKED_ATTENTION, LocalBackend, _microbatches
from tbexp.backends.logprobs import naive_target_logprobs, target_logprobs
from tbexp.backends.sampling import filter_logits

VOCAB = 300
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One printable character per token (ids 0..298), id 299 = <eos>; decode concatenates."""
    chars = [chr(0x21 + i) for i in range(94)] + [chr(0x100 + i) for i in range(VOCAB - 95)]
    vocab = {c: i for i, c in enumerate(chars)} | {"<eos>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def backend(tmp_path, lora_rank: int = 4, lora_dropout: float = 0.0, **kw) -> LocalBackend:
    return LocalBackend(
        tiny_llama(),
        char_tokenizer(),
        lora_rank=lora_rank,
        lora_alpha=8.0,
        lora_dropout=lora_dropout,
        lora_targets=TARGETS,
        device="cpu",
        save_dir=tmp_path / "states",
        **kw,
    )


def sft_datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    weights = weights if weights is not None else [1.0] * (len(tokens) - 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def rl_datum(tokens: list[int], logprobs: list[float], advantages: list[float]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": logprobs, "advantages": advantages},
    )


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """Teacher-forced logp of tokens[1:] by the plain full-logits route."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)


def grads(b: LocalBackend) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in b._params.items() if p.grad is not None}


def sgd(lr: float = 1e-2) -> types.AdamParams:
    return types.AdamParams(learning_rate=lr)


# ---- chunked log-softmax ----


@pytest.mark.parametrize(
    ("chunk", "compiled"),
    [(1, None), (3, None), (7, None), (16, None), (100, None), (3, "aot_eager"), (16, "aot_eager")],
)
def test_chunked_logprobs_equal_naive_values_and_gradients(chunk, compiled):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(16, 8, generator=g, requires_grad=True)
    w = torch.randn(50, 8, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (16,), generator=g)
    up = torch.randn(16, generator=g)
    bias = bias if compiled is None else None  # the fused softmax is for unbiased heads
    got = target_logprobs(h, w, t, bias, chunk_size=chunk, compile_backend=compiled)
    inputs = (h, w) if bias is None else (h, w, bias)
    grads_got = torch.autograd.grad((got * up).sum(), inputs)
    want = torch.log_softmax(h @ w.T + (0 if bias is None else bias), -1).gather(1, t[:, None]).squeeze(1)
    grads_want = torch.autograd.grad((want * up).sum(), inputs)
    torch.testing.assert_close(got, want)
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a, b)


def test_chunked_logprobs_gradcheck_and_frozen_head():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(9, 4, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 9, (5,), generator=g)
    assert torch.autograd.gradcheck(lambda h, w: target_logprobs(h, w, t, chunk_size=2), (h, w))
    # A frozen head (LoRA): only the hidden states get a gradient, and it still matches.
    w_frozen = w.detach()
    (gh,) = torch.autograd.grad(target_logprobs(h, w_frozen, t, chunk_size=2).sum(), (h,))
    (gh_ref,) = torch.autograd.grad(naive_target_logprobs(h, w_frozen, t).sum(), (h,))
    torch.testing.assert_close(gh, gh_ref)


# ---- losses against hand-computed values ----


def test_cross_entropy_is_the_weighted_sum_of_logprobs(tmp_path):
    b = backend(tmp_path)
    tokens = random_tokens(10, seed=1)
    weights = [0.0, 0.0, 1.0, 2.0, 0.5, 1.0, 0.0, 1.0, 3.0]
    result = b.forward_backward([sft_datum(tokens, weights)], "cross_entropy").result()
    with torch.no_grad():
        logp = reference_logprobs(b.model, tokens)
    assert result.loss == pytest.approx(-(torch.tensor(weights) * logp).sum().item(), rel=1e-5)
    assert result.n_tokens == pytest.approx(sum(weights))
    torch.testing.assert_close(torch.tensor(result.logprobs[0]), logp, atol=1e-5, rtol=0)


def test_importance_sampling_at_sampler_logprobs_is_minus_sum_of_advantages(tmp_path):
    b = backend(tmp_path)
    tokens = random_tokens(12, seed=2)
    adv = [0.0] * 4 + [1.5] * 4 + [-0.5] * 3
    with torch.no_grad():
        q = reference_logprobs(b.model, tokens).tolist()
    result = b.forward_backward([rl_datum(tokens, q, adv)], "importance_sampling").result()
    assert result.loss == pytest.approx(-sum(adv), abs=1e-4)
    assert result.n_tokens == len(adv)
    is_grads = grads(b)
    b.optimizer.zero_grad(set_to_none=True)
    b.forward_backward([sft_datum(tokens, adv)], "cross_entropy").result()  # −Σ A·logp
    for name, g in grads(b).items():
        torch.testing.assert_close(is_grads[name], g, atol=1e-5, rtol=1e-4)


def test_ppo_clips_the_ratio_and_zeroes_the_clipped_gradient(tmp_path):
    b = backend(tmp_path)
    tokens = random_tokens(8, seed=3)
    with torch.no_grad():
        logp = reference_logprobs(b.model, tokens)
    adv = torch.ones(7)
    # Ratio e (above 1.2) with A > 0: the clipped term 1.2·A wins, so loss = −Σ 1.2·A and no gradient.
    result = b.forward_backward([rl_datum(tokens, (logp - 1).tolist(), adv.tolist())], "ppo").result()
    assert result.loss == pytest.approx(-1.2 * adv.sum().item(), rel=1e-5)
    assert result.metrics["clip_fraction"] == 1.0
    assert all(torch.count_nonzero(g) == 0 for g in grads(b).values())
    # Ratio e^-1 (below 0.8) with A > 0: min picks r·A, unclipped, so the gradient is that of IS.
    b.optimizer.zero_grad(set_to_none=True)
    result = b.forward_backward([rl_datum(tokens, (logp + 1).tolist(), adv.tolist())], "ppo").result()
    assert result.loss == pytest.approx(-(torch.exp(torch.tensor(-1.0)) * adv).sum().item(), rel=1e-4)
    ppo_grads = grads(b)
    b.optimizer.zero_grad(set_to_none=True)
    b.forward_backward([rl_datum(tokens, (logp + 1).tolist(), adv.tolist())], "importance_sampling").result()
    assert any(torch.count_nonzero(g) > 0 for g in ppo_grads.values())
    for name, g in grads(b).items():
        torch.testing.assert_close(ppo_grads[name], g)
    # Wider thresholds from loss_fn_config put ratio e inside the band: r·A, with a gradient.
    b.optimizer.zero_grad(set_to_none=True)
    result = b.forward_backward(
        [rl_datum(tokens, (logp - 1).tolist(), adv.tolist())],
        "ppo",
        {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0},
    ).result()
    assert result.loss == pytest.approx(-torch.e * adv.sum().item(), rel=1e-4)
    assert any(torch.count_nonzero(g) > 0 for g in grads(b).values())


@pytest.mark.parametrize(
    "loss_fn,config",
    [("cispo", None), ("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}), ("dppo", None)],
)
@pytest.mark.parametrize("packing", [False, True])
def test_rl_losses_do_not_depend_on_how_datums_share_micro_batches(tmp_path, loss_fn, config, packing):
    """gspo's ratio is per datum: two datums in one packed row or padded batch give what they give apart."""
    tokens = [random_tokens(9, seed=5), random_tokens(6, seed=6)]
    adv = [[0.0] * 3 + [1.0] * 5, [0.0] * 2 + [-0.5] * 3]
    shift = [[0.0] * 3 + [0.3, -0.2, 0.1, 0.4, -0.1], [0.0] * 2 + [0.2, -0.3, 0.25]]
    results = []
    for budget in (4096, 9):  # together in one micro-batch, then one datum per micro-batch
        b = backend(tmp_path / str(budget), packing=packing, microbatch_tokens=budget)
        with torch.no_grad():
            q = [(reference_logprobs(b.model, t) + torch.tensor(d)).tolist() for t, d in zip(tokens, shift)]
        data = [rl_datum(t, qi, a) for t, qi, a in zip(tokens, q, adv)]
        results.append((b.forward_backward(data, loss_fn, config).result(), grads(b)))
    (together, g_together), (apart, g_apart) = results
    assert together.loss == pytest.approx(apart.loss, rel=1e-4, abs=1e-6)
    assert any(torch.count_nonzero(g) > 0 for g in g_together.values())
    for name, g in g_apart.items():
        torch.testing.assert_close(g_together[name], g, atol=1e-5, rtol=1e-3)


# ---- batching ----


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize(
    ("microbatch_tokens", "lengths"), [(8192, (5, 13, 9, 2)), (20, (5, 13, 9, 2)), (8192, (7, 7, 7))]
)
def test_padded_or_packed_batch_equals_per_datum(tmp_path, microbatch_tokens, lengths, packing):
    b = backend(tmp_path, microbatch_tokens=microbatch_tokens, packing=packing)
    data = [
        sft_datum(random_tokens(n, seed=n + i), [float(i % 3) for i in range(n - 1)]) for i, n in enumerate(lengths)
    ]
    batched = b.forward_backward(data, "cross_entropy").result()
    batched_grads = grads(b)
    b.optimizer.zero_grad(set_to_none=True)
    singles = [b.forward_backward([d], "cross_entropy").result() for d in data]  # gradients add up
    assert batched.loss == pytest.approx(sum(s.loss for s in singles), rel=1e-5)
    assert batched.n_tokens == sum(s.n_tokens for s in singles)
    for got, single in zip(batched.logprobs, singles):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(single.logprobs[0]), atol=1e-5, rtol=0)
    for name, g in grads(b).items():
        torch.testing.assert_close(batched_grads[name], g, atol=1e-5, rtol=1e-4)
    assert b._lm.config._attn_implementation != PACKED_ATTENTION  # packed attention only during packed passes


def test_packed_microbatches_hold_whole_datums_within_the_budget():
    rows = [{"tokens": torch.zeros(n)} for n in (5, 13, 9, 2, 4)]
    assert _microbatches(rows, 20, packed=True) == [[1], [2, 0, 4, 3]]  # longest first: 13, then 9+5+4+2
    assert _microbatches(rows, 20) == [[1], [2, 0], [4, 3]]  # padded: rows × longest
    assert _microbatches(rows, 3, packed=True) == [[1], [2], [0], [4], [3]]  # a datum over the budget goes alone


def test_compiled_layers_and_other_kernels_give_the_same_loss_and_gradients(tmp_path):
    data = [sft_datum(random_tokens(n, seed=n)) for n in (6, 11)]
    # inductor's compile is slow on CPU; aot_eager runs the same capture. MATH is the one SDPA kernel every CPU has.
    eager, compiled = (
        backend(tmp_path),
        backend(tmp_path, compile_backend="aot_eager", logprob_chunk_tokens=3, sdpa_backend="math"),
    )
    assert compiled.forward_backward(data, "cross_entropy").result().loss == pytest.approx(
        eager.forward_backward(data, "cross_entropy").result().loss, rel=1e-6
    )
    for name, g in grads(eager).items():
        torch.testing.assert_close(grads(compiled)[name], g)
    assert (
        compiled.sampler().sample(_prompt(), 2, GREEDY).result()[0].tokens
        == eager.sampler().sample(_prompt(), 2, GREEDY).result()[0].tokens
    )


def test_bf16_keeps_trainable_weights_fp32_and_matches_fp32_loosely(tmp_path):
    data = [sft_datum(random_tokens(n, seed=n)) for n in (6, 11)]
    fp32, bf16 = backend(tmp_path), backend(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in bf16._params.values()} == {torch.float32}
    assert {p.dtype for n, p in bf16.model.named_parameters() if n not in bf16._params} == {torch.bfloat16}
    want, got = (
        fp32.forward_backward(data, "cross_entropy").result(),
        bf16.forward_backward(data, "cross_entropy").result(),
    )
    assert got.loss == pytest.approx(want.loss, rel=2e-2)
    torch.testing.assert_close(torch.tensor(got.logprobs[1]), torch.tensor(want.logprobs[1]), atol=0.1, rtol=0)
    assert {g.dtype for g in grads(bf16).values()} == {torch.float32} and any(
        torch.count_nonzero(g) for g in grads(bf16).values()
    )
    bf16.optim_step(sgd()).result()
    assert len(bf16.sampler().sample(_prompt(), 2, GREEDY).result()[1].tokens) == GREEDY.max_tokens
    full = backend(
        tmp_path, lora_rank=0, dtype="bfloat16"
    )  # full fine-tuning: every weight trains, so every weight stays fp32
    assert {p.dtype for p in full.model.parameters()} == {torch.float32}
    assert full.forward_backward(data, "cross_entropy").result().loss == pytest.approx(want.loss, rel=2e-2)


@pytest.mark.parametrize("packing", [False, True])
def test_gradient_checkpointing_recomputes_each_layer_and_gives_the_same_gradients(tmp_path, packing):
    data = [sft_datum(random_tokens(n, seed=n)) for n in (6, 11)]
    plain, ckpt = backend(tmp_path, packing=packing), backend(tmp_path, gradient_checkpointing=True, packing=packing)
    assert not plain.gradient_checkpointing  # the default on a CPU: no memory plan, no checkpointing
    runs = {"plain": 0, "ckpt": 0}
    for name, b in (("plain", plain), ("ckpt", ckpt)):
        # The MLP runs inside the checkpointed layer forward, so it starts again when the backward recomputes it
        # (a pre-hook: the recomputation stops early, once the last tensor the backward needs is back).
        for layer in b._lm.get_decoder().layers:
            layer.mlp.register_forward_pre_hook(lambda *_, name=name: runs.__setitem__(name, runs[name] + 1))
    assert plain.forward_backward(data, "cross_entropy").result().loss == pytest.approx(
        ckpt.forward_backward(data, "cross_entropy").result().loss, rel=1e-6
    )
    layers = len(plain._lm.get_decoder().layers)  # one micro-batch: both datums are within the default budget
    assert runs == {"plain": layers, "ckpt": 2 * layers}  # each layer ran again in the backward
    for name, g in grads(plain).items():
        torch.testing.assert_close(grads(ckpt)[name], g, rtol=0, atol=0)  # recomputed exactly: the same bits
    ckpt.forward(data, "cross_entropy").result()  # no gradients: nothing to recompute
    assert runs["ckpt"] == 3 * layers


def test_optimizer_state_is_the_lora_weights_only(tmp_path):
    b = backend(tmp_path)
    b.forward_backward([sft_datum(random_tokens(12, seed=1))], "cross_entropy").result()
    b.optim_step(sgd()).result()
    lora = {p for n, p in b.model.named_parameters() if "lora_" in n}
    assert {p for g in b.optimizer.param_groups for p in g["params"]} == lora == set(b.optimizer.state)
    assert all(p.grad is None for n, p in b.model.named_parameters() if "lora_" not in n)  # no frozen gradient
    state_bytes = sum(t.numel() * t.element_size() for s in b.optimizer.state.values() for t in s.values() if t.ndim)
    assert state_bytes == 2 * sum(p.numel() * 4 for p in lora)  # Adam's two fp32 moments, of the LoRA weights


# ---- LoRA and full fine-tuning ----


def test_lora_training_changes_lora_weights_only(tmp_path):
    b = backend(tmp_path)
    trainable = set(b._params)
    assert all("lora_" in n for n in trainable)
    assert {t for t in TARGETS if any(f"{t}.lora_A" in n for n in trainable)} == set(TARGETS)  # MLP included
    before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
    data = [sft_datum(random_tokens(9, seed=s)) for s in range(3)]
    for _ in range(2):
        b.forward_backward(data, "cross_entropy").result()
        stats = b.optim_step(sgd()).result()
    assert stats["step"] == 2 and stats["grad_norm"] > 0
    for n, p in b.model.named_parameters():
        if n in trainable:
            assert not torch.equal(p, before[n]), f"{n} did not change"
        else:
            assert torch.equal(p, before[n]), f"base weight {n} changed"


def test_full_finetuning_trains_every_weight(tmp_path):
    b = backend(tmp_path, lora_rank=0)
    assert len(b._params) == len(list(b.model.parameters())) and not any("lora" in n for n in b._params)
    before = {n: p.detach().clone() for n, p in b._params.items()}
    b.forward_backward([sft_datum(random_tokens(20, seed=5))], "cross_entropy").result()
    b.optim_step(sgd(1e-3)).result()
    changed = [n for n, p in b._params.items() if not torch.equal(p, before[n])]
    assert "lm_head.weight" in changed and "model.layers.0.mlp.down_proj.weight" in changed
    exported = b.export_checkpoint(b.save_state("full"), str(tmp_path))  # no adapter: the whole model instead
    assert exported.kind == "hf_model" and "no adapter" in exported.describe()


@pytest.mark.parametrize("merge", [False, True])
def test_logit_scale_multiplies_the_logits_for_training_and_sampling(tmp_path, merge):
    b = backend(tmp_path, logit_scale=True, merge_for_sampling=merge)
    (name,) = [n for n in b._params if "lora_" not in n]
    assert name.endswith("model.norm.log_scale")
    with torch.no_grad():
        b._params[name].fill_(math.log(2.0))
    tokens = random_tokens(15, seed=8)
    logits = (
        tiny_llama()(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    )  # LoRA's B starts at 0: the base model's
    doubled = torch.log_softmax(2 * logits, -1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
    assert b.sampler().compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:] == pytest.approx(
        doubled.tolist(), abs=1e-4
    )
    teacher_forced = b.forward([sft_datum(tokens)], "cross_entropy").result().logprobs[0]  # the training path
    assert teacher_forced == pytest.approx(doubled.tolist(), abs=1e-4)


@pytest.mark.parametrize("merge", [False, True])
def test_a_scaled_reference_is_the_start_at_the_policys_current_scale(tmp_path, merge):
    from tbexp.backends.logit_scale import ScaledReference

    b = backend(tmp_path, logit_scale=True, merge_for_sampling=merge)
    (name,) = [n for n in b._params if "lora_" not in n]
    with torch.no_grad():
        b._params[name].fill_(math.log(1.25))  # the scale GRPO starts from
    reference = ScaledReference(b.sampler(), b)
    assert b.logit_scale() == pytest.approx(1.25)
    b._detach_samplers()  # what optim_step does before the weights change
    with torch.no_grad():
        b._params[name].fill_(math.log(2.0))  # the policy sharpened since
    tokens = random_tokens(15, seed=8)
    logits = tiny_llama()(input_ids=torch.tensor([tokens])).logits[0, :-1].float()  # LoRA's B is 0: the base's
    # The reference's logits are its own (1.25 x base) times 2 / 1.25: the base's times 2, the policy's scale now.
    doubled = torch.log_softmax(2 * logits, -1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
    got = reference.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
    assert got == pytest.approx(doubled.tolist(), abs=1e-4)
    plain = reference.sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
    at_start = torch.log_softmax(1.25 * logits, -1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
    assert plain == pytest.approx(at_start.tolist(), abs=1e-4)  # the plain reference stays at the starting scale


@pytest.mark.parametrize("factor", [0.0, 10.0])
def test_logit_scale_trains_at_its_lr_factor_and_loads_from_checkpoints_without_it(tmp_path, factor):
    b = backend(tmp_path, logit_scale=True, logit_scale_lr_factor=factor)
    (name,) = [n for n in b._params if "lora_" not in n]
    before = {n: p.detach().clone() for n, p in b._params.items()}
    b.forward_backward([sft_datum(random_tokens(20, seed=7))], "cross_entropy").result()
    stats = b.optim_step(sgd(1e-3)).result()
    # Adam's first step moves every weight with a gradient by ~lr: 1e-3 for LoRA's B, lr x factor for the scale.
    moved = {n: float((p.detach() - before[n]).abs().max()) for n, p in b._params.items()}
    assert moved[name] == pytest.approx(1e-3 * factor, rel=0.01, abs=1e-9)
    assert max(v for n, v in moved.items() if n != name) == pytest.approx(1e-3, rel=0.01)
    assert stats["logit_scale"] == pytest.approx(math.exp(float(b._params[name].detach())))
    plain = backend(tmp_path / "plain").save_state("plain")  # trained without a scale
    b.load_weights(plain)
    assert float(b._params[name].detach()) == 0.0
    with pytest.raises(ValueError, match="model.logit_scale"):
        b.load_state(plain)
    with pytest.raises(ValueError, match="model.logit_scale"):
        backend(tmp_path / "plain").load_weights(b.save_state("scaled"))


def test_a_resumed_state_trains_the_logit_scale_at_this_backends_factor(tmp_path):
    # The factor is the running stage's (SFT saves with 0, GRPO trains at its own), never the saved optimizer's.
    frozen = backend(tmp_path, logit_scale=True, logit_scale_lr_factor=0.0)
    frozen.forward_backward([sft_datum(random_tokens(20, seed=7))], "cross_entropy").result()
    frozen.optim_step(sgd(1e-3)).result()
    resumed = backend(tmp_path / "resumed", logit_scale=True, logit_scale_lr_factor=10.0)
    resumed.load_state(frozen.save_state("frozen"))
    assert resumed.optim_step(sgd(1e-3)).result()["logit_scale"] == 1.0  # no gradient yet: nothing moves
    resumed.forward_backward([sft_datum(random_tokens(20, seed=8))], "cross_entropy").result()
    assert abs(math.log(resumed.optim_step(sgd(1e-3)).result()["logit_scale"])) == pytest.approx(1e-2, rel=0.05)


def test_grad_clip_and_weight_decay_follow_adam_params(tmp_path):
    b = backend(tmp_path)
    b.forward_backward([sft_datum(random_tokens(30, seed=6))], "cross_entropy").result()
    norm = b.optim_step(types.AdamParams(learning_rate=1e-3, grad_clip_norm=1e-3, weight_decay=0.1)).result()[
        "grad_norm"
    ]
    assert norm > 1e-3  # reported before clipping
    group = b.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.95), 1e-12, 0.1)


def test_updates_run_on_train_threads_and_give_back_the_sampling_setting(tmp_path, monkeypatch):
    seen = []
    run = LocalBackend._run
    monkeypatch.setattr(
        LocalBackend, "_run", lambda self, *a, **kw: seen.append(torch.get_num_threads()) or run(self, *a, **kw)
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        b = backend(tmp_path, train_threads=2)
        b.forward_backward([sft_datum(random_tokens(30, seed=6))], "cross_entropy").result()
        assert seen == [2] and torch.get_num_threads() == 1
        b.optim_step(sgd()).result()
        assert torch.get_num_threads() == 1
        backend(tmp_path).forward_backward([sft_datum(random_tokens(30, seed=6))], "cross_entropy").result()
        assert seen == [2, 1]  # without train_threads, the process's setting
    finally:
        torch.set_num_threads(previous)


# ---- checkpoints and adapters ----


def _train(b: LocalBackend, steps: range) -> list[float]:
    losses = []
    for step in steps:
        data = [sft_datum(random_tokens(7 + step, seed=100 + step)), sft_datum(random_tokens(4, seed=200 + step))]
        losses.append(b.forward_backward(data, "cross_entropy").result().loss)
        b.optim_step(sgd(1e-2 / (1 + step))).result()  # a schedule: the caller changes the rate
    return losses


def test_save_then_load_into_a_fresh_backend_continues_exactly(tmp_path):
    # Dropout on the LoRA path makes the run depend on the RNG state, which must be restored too.
    torch.manual_seed(0)
    straight = backend(tmp_path, lora_dropout=0.1)
    losses_straight = _train(straight, range(4))

    torch.manual_seed(0)
    first = backend(tmp_path, lora_dropout=0.1)
    losses = _train(first, range(2))
    path = first.save_state("step2")
    torch.rand(5)  # disturb the RNG; load_state must put it back
    resumed = backend(tmp_path, lora_dropout=0.1)
    resumed.load_state(path)
    assert resumed.step == 2
    losses += _train(resumed, range(2, 4))

    assert losses == losses_straight
    for n, p in straight._params.items():
        assert torch.equal(p, resumed._params[n]), n
    for a, b in zip(straight.optimizer.state.values(), resumed.optimizer.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)  # peft 0.21 under transformers 5
def test_exported_adapter_loads_in_peft_with_the_same_logits(tmp_path):
    b = backend(tmp_path)
    _train(b, range(2))
    exported = b.export_checkpoint(b.save_state("trained"), str(tmp_path))
    assert exported.kind == "adapter" and exported.path == str(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(tiny_llama(), exported.path).eval()
    b.model.eval()
    ids = torch.tensor([random_tokens(15, seed=9)])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, b.model(input_ids=ids).logits, atol=1e-6, rtol=0)
        assert not torch.allclose(tiny_llama()(input_ids=ids).logits, b.model(input_ids=ids).logits)


# ---- sampling ----


def _prompt(n: int = 6) -> types.ModelInput:
    return types.ModelInput.from_ints(random_tokens(n, seed=42))


def test_greedy_sampling_is_argmax_decoding(tmp_path):
    b = backend(tmp_path)
    seqs = b.sampler().sample(_prompt(), 3, GREEDY).result()
    tokens = _prompt().to_ints()
    with torch.no_grad():
        for _ in range(GREEDY.max_tokens):  # no cache, full recompute each step
            tokens.append(int(b.model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    for s in seqs:
        assert s.tokens == tokens[-GREEDY.max_tokens :] and s.stop_reason == "length"


def test_sampling_respects_max_tokens_and_seed(tmp_path):
    s = backend(tmp_path).sampler()
    params = types.SamplingParams(max_tokens=9, temperature=1.0, seed=7, stop=[])
    a = s.sample(_prompt(), 4, params).result()
    assert [len(x.tokens) for x in a] == [9] * 4 and {x.stop_reason for x in a} == {"length"}
    assert [x.tokens for x in s.sample(_prompt(), 4, params).result()] == [x.tokens for x in a]
    other = s.sample(_prompt(), 4, params.model_copy(update={"seed": 8})).result()
    assert [x.tokens for x in other] != [x.tokens for x in a]
    assert len({tuple(x.tokens) for x in a}) > 1  # the samples differ from each other


def test_sampled_logprobs_are_untempered_and_match_teacher_forcing(tmp_path):
    b = backend(tmp_path)
    params = types.SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, top_k=50, seed=3, stop=[])
    for seq in b.sampler().sample(_prompt(), 3, params).result():
        with torch.no_grad():
            want = reference_logprobs(b.model, _prompt().to_ints() + seq.tokens)[-len(seq.tokens) :]
        torch.testing.assert_close(torch.tensor(seq.logprobs), want, atol=1e-4, rtol=0)


def test_sampling_stops_on_token_ids_and_strings(tmp_path):
    b = backend(tmp_path)
    tok = b.tokenizer
    greedy = b.sampler().sample(_prompt(), 1, GREEDY).result()[0].tokens
    # A stop token: the sequence ends at its first occurrence, the token included.
    stop_id = greedy[4]
    seq = b.sampler().sample(_prompt(), 2, GREEDY.model_copy(update={"stop": [stop_id]})).result()[0]
    assert seq.stop_reason == "stop" and seq.tokens == greedy[: greedy.index(stop_id) + 1]
    # A stop string spanning two tokens: the sequence ends with the token that completes it.
    stop_str = tok.decode(greedy[5:7])
    first = next(k for k in range(1, len(greedy) + 1) if stop_str in tok.decode(greedy[:k]))
    seq = b.sampler().sample(_prompt(), 2, GREEDY.model_copy(update={"stop": [stop_str]})).result()[1]
    assert seq.stop_reason == "stop" and seq.tokens == greedy[:first]
    # stop=None stops on EOS: make EOS the greedy choice by biasing the LM head.
    with torch.no_grad():
        b._lm.lm_head.weight[tok.eos_token_id] = b._lm.lm_head.weight[greedy[2]] * 2
    seq = b.sampler().sample(_prompt(), 1, GREEDY.model_copy(update={"stop": None})).result()[0]
    assert seq.stop_reason == "stop" and seq.tokens[-1] == tok.eos_token_id


def test_finished_sequences_drop_out_while_others_continue(tmp_path):
    b = backend(tmp_path)
    params = types.SamplingParams(max_tokens=30, temperature=1.0, seed=0, stop=["!", "#"])
    seqs = b.sampler().sample(_prompt(), 8, params).result()
    for s in seqs:
        text = b.tokenizer.decode(s.tokens)
        if s.stop_reason == "stop":
            assert text[-1] in "!#" and not any(c in text[:-1] for c in "!#")
        else:
            assert len(s.tokens) == 30 and not any(c in text for c in "!#")
        assert len(s.logprobs) == len(s.tokens)


def test_sampler_is_a_snapshot(tmp_path):
    b = backend(tmp_path)
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=1, stop=[])
    snap = b.sampler()
    before = snap.sample(_prompt(), 2, params).result()
    _train(b, range(3))
    live = {n: p.detach().clone() for n, p in b._params.items()}
    after = snap.sample(_prompt(), 2, params).result()
    assert [(s.tokens, s.logprobs) for s in after] == [(s.tokens, s.logprobs) for s in before]
    assert all(torch.equal(p, live[n]) for n, p in b._params.items())  # sampling put the live weights back
    fresh = b.sampler().sample(_prompt(), 2, params).result()
    assert [s.logprobs for s in fresh] != [s.logprobs for s in before]


@pytest.mark.parametrize(
    "params", [GREEDY, types.SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=4, stop=[])]
)
def test_static_decode_samples_what_the_dynamic_decode_does(tmp_path, params):
    plain, static = backend(tmp_path), backend(tmp_path, cuda_graph_sampling=True)  # on CPU: the static cache, no graph
    want, got = (
        plain.sampler().sample(_prompt(), 3, params).result(),
        static.sampler().sample(_prompt(), 3, params).result(),
    )
    assert [s.tokens for s in got] == [s.tokens for s in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)


def test_static_decode_ends_each_row_at_its_stop(tmp_path):
    static = backend(tmp_path, cuda_graph_sampling=True)
    stopping = (
        static.sampler()
        .sample(_prompt(), 8, types.SamplingParams(max_tokens=30, temperature=1.0, seed=0, stop=["!", "#"]))
        .result()
    )
    assert {s.stop_reason for s in stopping} == {"stop", "length"}
    for s in stopping:
        text = static.tokenizer.decode(s.tokens)
        assert (
            (text[-1] in "!#" and not any(c in text[:-1] for c in "!#"))
            if s.stop_reason == "stop"
            else len(s.tokens) == 30
        )


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    assert kept(filter_logits(logits, 2, 1.0)) == [True, True, False, False, False]
    assert kept(filter_logits(logits, -1, 0.6)) == [True, True, False, False, False]
    assert kept(filter_logits(logits, -1, 0.45)) == [True, False, False, False, False]
    assert kept(filter_logits(logits, -1, 0.01)) == [True, False, False, False, False]
    assert kept(filter_logits(logits, 3, 0.99)) == [True, True, True, False, False]


def test_lora_reaches_moe_expert_parameters_through_target_parameters(tmp_path):
    # gpt-oss keeps its experts as 3-D tensors, not nn.Linear: only target_parameters puts LoRA on them.
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention", "sliding_attention"],
    )
    torch.manual_seed(0)
    backend = LocalBackend(
        GptOssForCausalLM(config),
        None,
        lora_rank=4,
        lora_alpha=8,
        lora_dropout=0.0,
        lora_targets=["q_proj", "v_proj"],
        lora_target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        device="cpu",
        save_dir=tmp_path,
    )
    trainable = [n for n, p in backend.model.named_parameters() if p.requires_grad]
    assert any("experts" in n and "lora" in n for n in trainable) and any("q_proj" in n for n in trainable)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4},
    )
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters() if "experts" in n and p.requires_grad}
    backend.forward_backward([datum], "cross_entropy").result()
    backend.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert any(
        not torch.equal(before[n], p) for n, p in backend.model.named_parameters() if n in before
    )  # the experts' LoRA trained


@pytest.mark.parametrize("merge", [False, True])
def test_sampler_is_a_snapshot_merged_or_not(tmp_path, merge):
    b = backend(tmp_path, merge_for_sampling=merge)
    b.forward_backward([sft_datum(random_tokens(12, 1))], "cross_entropy").result()
    b.optim_step(sgd(0.05)).result()
    params = types.SamplingParams(max_tokens=8, temperature=1.0, stop=[], seed=3)
    sampler = b.sampler()
    before = sampler.sample(_prompt(), 2, params).result()
    b.forward_backward([sft_datum(random_tokens(12, 2))], "cross_entropy").result()
    b.optim_step(sgd(0.05)).result()
    again = sampler.sample(_prompt(), 2, params).result()  # trained since: the snapshot must not see it
    assert [s.tokens for s in again] == [s.tokens for s in before]
    assert sum((s.logprobs for s in again), []) == pytest.approx(sum((s.logprobs for s in before), []), abs=1e-6)
    other = backend(tmp_path / "other", merge_for_sampling=not merge)
    other.load_state(b.save_state("now"))
    fresh, mine = other.sampler(), b.sampler()  # merged and unmerged views of the same weights agree
    assert [s.tokens for s in fresh.sample(_prompt(), 2, params).result()] == [
        s.tokens for s in mine.sample(_prompt(), 2, params).result()
    ]
    tokens = types.ModelInput.from_ints(_prompt().to_ints() + before[0].tokens)
    assert fresh.compute_logprobs(tokens).result()[1:] == pytest.approx(
        mine.compute_logprobs(tokens).result()[1:], abs=1e-5
    )


def test_batched_requests_get_what_each_would_get_alone(tmp_path):
    from tbexp.backends.batch_sampling import Request

    sampler = backend(tmp_path).sampler()
    prompts = [random_tokens(n, seed=n) for n in (3, 9, 5)]  # different lengths: left padding must not leak
    requests = [
        Request(p, types.SamplingParams(max_tokens=6 + i, temperature=0.8, stop=[], seed=10 + i))
        for i, p in enumerate(prompts)
    ]
    batched = sampler.sample_batch(requests)
    alone = [sampler.sample_batch([r])[0] for r in requests]
    assert [s.tokens for s in batched] == [s.tokens for s in alone]
    assert [len(s.tokens) for s in batched] == [6, 7, 8]
    for s, a in zip(batched, alone):
        assert s.logprobs == pytest.approx(a.logprobs, abs=1e-4)


@pytest.mark.parametrize("merge", [True, False])
def test_a_restarted_backend_trains_as_a_newly_built_one_and_checkpoint_samplers_leave_training_alone(tmp_path, merge):
    """What the job's model host relies on: one loaded model serves every stage of a job."""
    import random

    data = [sft_datum([5, 6, 7, 8, 9, 10]), sft_datum([11, 12, 13, 14])]
    adam = types.AdamParams(learning_rate=1e-2)
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=7, stop=[])

    def steps(b, n=3):
        losses = []
        for _ in range(n):
            losses.append(b.forward_backward(data, "cross_entropy").result().loss)
            b.optim_step(adam).result()
        return losses

    fresh = backend(tmp_path / "fresh", merge_for_sampling=merge)
    fresh_losses = steps(fresh)
    checkpoint = fresh.save_state("trained")
    base_reply = (
        backend(tmp_path / "base", merge_for_sampling=merge)
        .sampler()
        .sample(types.ModelInput.from_ints([3, 4]), 1, params)
        .result()[0]
    )

    shared = backend(tmp_path / "shared", merge_for_sampling=merge)
    steps(shared, 2)  # a first training run on the loaded model
    shared.restart(tmp_path / "second")
    random.seed(123)
    from_checkpoint = shared.checkpoint_sampler(checkpoint)
    assert random.random() == random.Random(123).random()  # no random state was restored with the weights
    assert steps(shared) == fresh_losses  # the second run: exactly what a newly built backend does
    assert shared.save_state("x").startswith(str(tmp_path / "second"))

    prompt = types.ModelInput.from_ints([3, 4])
    trained_reply = fresh.sampler().sample(prompt, 1, params).result()[0]
    assert from_checkpoint.sample(prompt, 1, params).result()[0] == trained_reply  # the checkpoint's weights
    assert shared.checkpoint_sampler("").sample(prompt, 1, params).result()[0] == base_reply  # the base model's
