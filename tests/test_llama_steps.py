"""LlamaSteps: the sampler's forward passes without transformers' machinery, bitwise equal to transformers'.

.venv/bin/python -m pytest tests/test_llama_steps.py -v

* logits: prefill and decode steps on left-padded batches whose rows leave mid-way, compared with
  `torch.equal` against `LlamaForCausalLM.forward` with transformers' own cache, for the shipped tiny model
  with and without a learnt logit scale;
* `sample_batch`: the same tokens, logprobs and stop reasons with LlamaSteps as through transformers;
* what it refuses: a PEFT model (LoRA not merged), bfloat16.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tinker import types
from transformers import AutoModelForCausalLM, DynamicCache

from tbexp.backends.batch_sampling import Request, sample_batch
from tbexp.backends.llama_steps import LlamaSteps, transformers_only
from tbexp.backends.logit_scale import add_logit_scale

TINY = Path(__file__).resolve().parent.parent / "tbexp" / "models" / "tiny"


def tiny(scale: float | None = None):
    model = AutoModelForCausalLM.from_pretrained(TINY).eval()
    if scale is not None:
        add_logit_scale(model)
        with torch.no_grad():
            model.model.norm.log_scale.fill_(math.log(scale))
    return model


def batch(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        tokens[b, width - n :] = torch.randint(5, 900, (n,), generator=generator)
        mask[b, width - n :] = 1
    return tokens, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("scale", [None, 1.7])
@pytest.mark.parametrize("lengths", [[40, 40, 40], [60, 33, 7, 60], [1], [130, 129]])
def test_logits_are_transformers_bit_for_bit(lengths, scale):
    model = tiny(scale)
    assert LlamaSteps.supports(model)
    tokens, mask, positions = batch(lengths, seed=len(lengths))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        kw = {"use_cache": True, "past_key_values": cache}
        theirs = model(input_ids=tokens, attention_mask=mask, position_ids=positions, logits_to_keep=1, **kw).logits
        theirs = theirs[:, -1]
        steps = LlamaSteps(model)
        mine = steps.prefill(tokens, mask, positions)
        assert torch.equal(mine, theirs)
        next_positions = positions[:, -1] + 1
        for step in range(70):  # past the first doubling of the key/value buffers (64)
            picked = theirs.argmax(-1)
            if step == 5 and len(picked) > 1:  # the first row stops: the others go on without it
                rows = torch.arange(1, len(picked))
                cache.batch_select_indices(rows)
                steps.keep(rows)
                mask, next_positions, picked = mask[rows], next_positions[rows], picked[rows]
            mask = torch.cat([mask, torch.ones(len(picked), 1, dtype=mask.dtype)], dim=1)
            theirs = model(input_ids=picked[:, None], attention_mask=mask, position_ids=next_positions[:, None], **kw)
            theirs = theirs.logits[:, -1]
            mine = steps.decode(picked, next_positions)
            assert torch.equal(mine, theirs), f"step {step}: {float((mine - theirs).abs().max())}"
            next_positions = next_positions + 1


def test_sample_batch_draws_the_same_with_and_without_it():
    model = tiny(1.3)
    tokenizer = _tokenizer()
    prompts = [batch([n], seed=n)[0][0].tolist() for n in (12, 50, 31, 50, 3)]
    params = [
        types.SamplingParams(max_tokens=40, temperature=t, seed=7 + i) for i, t in enumerate((0.7, 1.0, 0.0, 0.7, 1.0))
    ]
    requests = [Request(p, q) for p, q in zip(prompts, params)]
    fast = sample_batch(model, tokenizer, requests, [3])
    with transformers_only():
        assert not LlamaSteps.supports(model)
        slow = sample_batch(model, tokenizer, requests, [3])
    assert LlamaSteps.supports(model)
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in fast] == [
        (s.tokens, s.logprobs, s.stop_reason) for s in slow
    ]
    assert len({len(s.tokens) for s in fast}) > 1  # rows left the batch at different steps


def test_models_it_cannot_reproduce_are_left_to_transformers():
    from peft import LoraConfig, get_peft_model

    assert not LlamaSteps.supports(get_peft_model(tiny(), LoraConfig(r=2, target_modules=["q_proj"])))
    assert not LlamaSteps.supports(tiny().to(torch.bfloat16))


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)
