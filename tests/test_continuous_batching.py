"""backend.continuous_batching: batched = alone, logprobs = teacher forcing, shared prefixes, stops, threads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tinker import types
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tbexp.backends.batch_sampling import Request
from tbexp.backends.continuous_batching import ContinuousBatcher, PagePool, page_digests
from tbexp.backends.local import LocalBackend
from tbexp.backends.paged_kernels import sample_tokens_torch
from tests.test_local_backend import TARGETS, VOCAB, char_tokenizer, random_tokens, sft_datum, sgd

REPO = Path(__file__).resolve().parent.parent


def tiny_model(kind: str, seed: int = 0):
    """A tiny random decoder: Qwen3 (q/k norms, GQA 4:2, head_dim 16) or Llama (GQA, no q/k norms)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return (
            Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
            if kind == "qwen3"
            else LlamaForCausalLM(LlamaConfig(**common))
        )


def lora_backend(save_dir, kind: str = "qwen3", model=None, **kw) -> LocalBackend:
    return LocalBackend(
        tiny_model(kind) if model is None else model,
        char_tokenizer(),
        lora_rank=4,
        lora_alpha=8.0,
        lora_dropout=0.0,
        lora_targets=TARGETS,
        device="cpu",
        save_dir=save_dir,
        **kw,
    )


def trained_backend(tmp_path, kind: str = "qwen3", **kw) -> LocalBackend:
    """A LoRA backend one SGD step away from its base, so the LoRA deltas are not zero and must be merged right."""
    b = lora_backend(tmp_path / "states", kind, merge_for_sampling=False, **kw)
    b.forward_backward([sft_datum(random_tokens(20, 1)), sft_datum(random_tokens(15, 2))], "cross_entropy").result()
    b.optim_step(sgd(0.5)).result()
    return b


def requests(n: int = 6, temperature: float = 0.9) -> list[Request]:
    shapes = [(5, 7), (13, 20), (4, 3), (9, 15), (22, 9), (3, 11), (17, 4), (8, 8)][:n]
    return [
        Request(
            random_tokens(p, seed=100 + i), types.SamplingParams(max_tokens=k, temperature=temperature, seed=i, stop=[])
        )
        for i, (p, k) in enumerate(shapes)
    ]


def alone(b: LocalBackend, request: Request):
    """The reply a request gets in a batcher of its own (fresh cache, nothing shared)."""
    with b.sampler()._model() as (_, lm):
        return ContinuousBatcher(lm, b.tokenizer, b.eos_token_ids, page_tokens=4, kv_cache_tokens=2048).submit(request)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_a_request_gets_the_same_tokens_alone_or_joining_a_running_batch(tmp_path, kind):
    b = trained_backend(
        tmp_path, kind, continuous_batching=True, max_concurrent_sequences=3
    )  # 8 requests, 3 rows: they join as others leave
    reqs = requests(8)
    batched = b.sampler().sample_batch(reqs)
    for r, got in zip(reqs, batched):
        ref = alone(b, r)
        assert got.tokens == ref.tokens
        assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-5)  # fp32: batched products round differently, barely
        assert len(got.tokens) == r.params.max_tokens and got.stop_reason == "length"
    stats = b._batcher.stats
    assert stats["decode_rows"] / stats["decode_steps"] > 2  # the rows really were batched


def test_logprobs_match_a_teacher_forced_pass_with_the_lora_weights(tmp_path):
    b = trained_backend(tmp_path, continuous_batching=True)
    sampler = b.sampler()
    for r, got in zip(reqs := requests(4), sampler.sample_batch(requests(4))):
        forced = sampler.compute_logprobs(types.ModelInput.from_ints(r.prompt + got.tokens)).result()[len(r.prompt) :]
        assert got.logprobs == pytest.approx(forced, abs=1e-4)
    base = lora_backend(tmp_path / "base", "qwen3", merge_for_sampling=False)
    r, got = reqs[1], sampler.sample_batch([reqs[1]])[0]
    untrained = (
        base.sampler().compute_logprobs(types.ModelInput.from_ints(r.prompt + got.tokens)).result()[len(r.prompt) :]
    )
    assert max(abs(x - y) for x, y in zip(got.logprobs, untrained)) > 1e-3  # the trained LoRA deltas mattered


def test_greedy_decoding_equals_the_existing_sampler(tmp_path):
    b = trained_backend(tmp_path, continuous_batching=True)
    reference = trained_backend(tmp_path / "ref")  # same seeds, same step: the same weights, sampled the old way
    greedy = types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    prompt = types.ModelInput.from_ints(random_tokens(9, 5))
    got = b.sampler().sample(prompt, 2, greedy).result()
    want = reference.sampler().sample(prompt, 1, greedy).result()[0]
    assert got[0].tokens == got[1].tokens == want.tokens
    assert got[0].logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_the_longest_sequence_is_the_model_configs_context_not_max_position_embeddings(tmp_path):
    """model.max_length_tokens (here 512) decides how long a sequence may grow, not the checkpoint's
    max_position_embeddings (256): a terminus-2 conversation outgrows the tiny model's 4,096."""
    greedy = types.SamplingParams(max_tokens=30, temperature=0.0, stop=[])
    long_prompt = Request(random_tokens(240, 7), greedy)
    with pytest.raises(ValueError, match="exceeds the batcher's 256 tokens a sequence"):
        trained_backend(tmp_path / "a", continuous_batching=True).sampler().sample_batch([long_prompt])
    b = trained_backend(tmp_path / "b", continuous_batching=True, max_sequence_tokens=512)
    got = b.sampler().sample_batch([long_prompt])[0]
    want = trained_backend(tmp_path / "ref").sampler().sample_batch([long_prompt])[0]  # the default sampler
    assert len(got.tokens) == 30 and got.tokens == want.tokens
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_samples_of_one_prompt_and_later_turns_share_cached_pages(tmp_path):
    b = trained_backend(tmp_path, continuous_batching=True)
    sampler = b.sampler()
    prompt = random_tokens(40, 7)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
    group = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result()
    stats = b._batcher.stats
    page = b._batcher.page_tokens
    assert stats["prefill_tokens"] == 40 + 3 * (
        40 - (39 // page) * page
    )  # one prompt encoded; the others share its full pages
    assert len({tuple(s.tokens) for s in group}) > 1  # sample i draws with its own seed
    seeds = [(3 + i * 0x9E3779B97F4A7C15) % 2**63 for i in range(4)]
    for s, seed in zip(group, seeds):  # sharing changes nothing a sample gets
        assert s.tokens == alone(b, Request(prompt, params.model_copy(update={"seed": seed}))).tokens
    turn2 = prompt + group[0].tokens + random_tokens(5, 8)  # the next turn of an episode: its history is cached
    before = stats["prefill_tokens"]
    second = sampler.sample_batch([Request(turn2, params)])[0]
    written = len(prompt) + len(group[0].tokens) - 1  # the last sampled token was never fed back
    assert stats["prefill_tokens"] - before == len(turn2) - (written // page) * page
    assert second.tokens == alone(b, Request(turn2, params)).tokens


def test_stops_follow_the_existing_sampler(tmp_path):
    b = trained_backend(tmp_path, continuous_batching=True)
    sampler = b.sampler()
    prompt = random_tokens(7, 9)
    greedy = types.SamplingParams(max_tokens=10, temperature=0.0, stop=[])
    free = sampler.sample_batch([Request(prompt, greedy)])[0].tokens
    by_id = sampler.sample_batch([Request(prompt, greedy.model_copy(update={"stop": [free[3]]}))])[0]
    assert by_id.tokens == free[: free.index(free[3]) + 1] and by_id.stop_reason == "stop"
    text = b.tokenizer.decode(free[4:6])
    by_string = sampler.sample_batch([Request(prompt, greedy.model_copy(update={"stop": [text]}))])[0]
    assert (
        b.tokenizer.decode(by_string.tokens).endswith(text)
        and by_string.stop_reason == "stop"
        and len(by_string.tokens) <= 6
    )
    b.eos_token_ids = [free[2]]
    b._batcher.eos_token_ids = [free[2]]
    by_eos = sampler.sample_batch([Request(prompt, greedy.model_copy(update={"stop": None}))])[0]
    assert by_eos.tokens[-1] == free[2] and by_eos.stop_reason == "stop"
    assert sampler.sample_batch([Request(prompt, greedy.model_copy(update={"max_tokens": 0}))])[0].tokens == []


def test_a_small_cache_makes_requests_wait_for_pages_not_fail(tmp_path):
    b = trained_backend(tmp_path, continuous_batching=True, kv_cache_tokens=64)  # room for about two requests at a time
    reqs = requests(6)
    got = b.sampler().sample_batch(reqs)
    assert [g.tokens for g in got] == [alone(b, r).tokens for r in reqs]
    with pytest.raises(ValueError, match="raise kv_cache_tokens"):
        b.sampler().sample_batch(
            [Request(random_tokens(60, 1), types.SamplingParams(max_tokens=30, temperature=0.0, stop=[]))]
        )


def test_concurrent_episodes_submit_from_threads_and_weights_follow_the_snapshot(tmp_path):
    b = trained_backend(tmp_path, continuous_batching=True, max_concurrent_sequences=4)
    queue = b.sampler().request_queue()
    reqs = requests(8)
    answers: dict[int, object] = {}
    threads = [
        threading.Thread(target=lambda i=i: answers.__setitem__(i, queue.submit(reqs[i]))) for i in range(len(reqs))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [answers[i].tokens for i in range(len(reqs))] == [alone(b, r).tokens for r in reqs]
    b.forward_backward([sft_datum(random_tokens(20, 3))], "cross_entropy").result()
    b.optim_step(sgd(0.5)).result()
    fresh = b.sampler()  # new weights: the batcher reloads them and drops its now stale prefix cache
    r = reqs[1]
    got = fresh.sample_batch([r])[0]
    forced = fresh.compute_logprobs(types.ModelInput.from_ints(r.prompt + got.tokens)).result()[len(r.prompt) :]
    assert got.logprobs == pytest.approx(forced, abs=1e-4)
    assert b._batcher.stats["weight_loads"] == 1


def test_gumbel_max_draws_follow_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(4000, 1)
    seeds = torch.arange(4000)
    tokens, logp = sample_tokens_torch(logits, torch.full((4000,), 0.7), seeds, torch.zeros(4000, dtype=torch.long))
    freq = torch.bincount(tokens, minlength=5).double() / 4000
    assert freq.tolist() == pytest.approx(torch.softmax(logits[0].double() / 0.7, 0).tolist(), abs=0.025)
    assert logp[0].item() == pytest.approx(torch.log_softmax(logits[0], 0)[tokens[0]].item(), abs=1e-6)  # untempered
    again, _ = sample_tokens_torch(logits[:3], torch.full((3,), 0.7), seeds[:3], torch.zeros(3, dtype=torch.long))
    assert again.tolist() == tokens[:3].tolist()  # the same (seed, step) draws the same, whatever the batch
    later, _ = sample_tokens_torch(
        logits[:200], torch.full((200,), 0.7), seeds[:200], torch.ones(200, dtype=torch.long)
    )
    assert later.tolist() != tokens[:200].tolist()  # the next token index draws fresh noise


def test_page_pool_shares_registers_and_reuses_idle_pages_last():
    pool = PagePool(5)  # pages 1..4 (0 is scratch)
    a = pool.take(2)
    digests = page_digests(list(range(8)), 4)
    for page, digest in zip(a, digests):
        pool.register(page, digest)
    pool.release(a)
    assert pool.available() == 4 and pool.page_of[digests[0]] == a[0]  # cached, idle, still findable
    pool.share(a[0])
    assert pool.take(2) and a[1] in pool.page_of.values()  # free pages go before idle cached ones
    pool.take(1)  # now the idle cached page is reused and forgotten
    assert digests[1] not in pool.page_of and pool.available() == 0
    assert (
        page_digests([1, 2, 3, 4, 9], 4) != page_digests([1, 2, 3, 5, 9], 4)
        and len(page_digests(list(range(7)), 4)) == 1
    )


def test_unsupported_models_are_refused_by_name():
    model = tiny_model("llama")
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="backend.continuous_batching.*hidden_act"):
        ContinuousBatcher(model, None, [])


def test_triton_kernels_match_the_torch_references_in_the_interpreter():
    pytest.importorskip("triton")
    script = REPO / "scripts" / "check_paged_kernels.py"
    proc = subprocess.run(
        [sys.executable, str(script), "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ALL OK" in proc.stdout


SPLIT_KERNELS_CHECK = """
import torch
from tbexp.backends import paged_kernels as pk
tri, ref = pk.OPS["triton"], pk.OPS["torch"]
# 40,000 ids: three shares of the vocabulary, the last one partly and some of its blocks wholly past the end.
for dtype in (torch.float32, torch.bfloat16):
    logits = (torch.randn(6, 40000, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    args = (torch.tensor([0.0, 0.7, 1.0, 1.0, 0.3, 2.0]), torch.tensor([0, 1, 2**40 + 5, 2**61, 7, 7]),
            torch.tensor([0, 3, 9, 100000, 5, 6]))
    (t1, l1), (t2, l2) = tri["sample"](logits, *args), ref["sample"](logits, *args)
    assert torch.equal(t1, t2) and (l1 - l2).abs().max() < 1e-5, (t1, t2, l1, l2)
g = torch.Generator().manual_seed(1)
steps = torch.randint(0, 30, (4, 16), generator=g)
steps[3] = steps[1] + 1
samples, tables = torch.randint(0, 99, (2, 16), generator=g), torch.randint(1, 50, (16, 8), generator=g).int()
for n in (5, 16):  # rows past n stay as they were
    a, b, sa, sb = steps.clone(), steps.clone(), samples.clone(), samples.clone()
    tokens = torch.randint(0, 999, (n,), generator=g)
    tri["advance"](a, sa, tables, tokens, 4)
    ref["advance"](b, sb, tables, tokens, 4)
    assert torch.equal(a, b) and torch.equal(sa, sb), (a, b)
print("ALL OK")
"""


def test_split_sampler_and_advance_kernels_match_the_torch_references_in_the_interpreter():
    pytest.importorskip("triton")
    proc = subprocess.run(
        [sys.executable, "-c", SPLIT_KERNELS_CHECK],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the compiled Triton kernels need a GPU")
def test_cuda_graph_decode_matches_the_eager_torch_decode():
    model = tiny_model("qwen3").cuda().to(torch.bfloat16)
    reqs = requests(8)
    pool = 16384  # on a GPU the caller sizes the KV pool (LocalBackend's memory plan); a batcher alone is given one
    eager = ContinuousBatcher(
        model, char_tokenizer(), [], kernels="torch", cuda_graphs=False, page_tokens=16, kv_cache_tokens=pool
    ).submit_all(reqs)
    graphed = ContinuousBatcher(model, char_tokenizer(), [], page_tokens=16, kv_cache_tokens=pool).submit_all(reqs)
    same = sum(a == b for e, g in zip(eager, graphed) for a, b in zip(e.tokens, g.tokens)) / sum(
        len(e.tokens) for e in eager
    )
    assert same > 0.9  # bf16: a near-tie may flip a token, after which the rest differs


def test_stop_strings_checked_while_the_next_step_runs_end_each_row_where_alone_it_ends(tmp_path):
    b = trained_backend(tmp_path, continuous_batching=True, max_concurrent_sequences=2)
    reqs = requests(5)
    free = [alone(b, r).tokens for r in reqs]
    # Each request stops at a two-character string its own free run reaches at token 3 (one token each here).
    stopping = [
        Request(r.prompt, r.params.model_copy(update={"stop": [b.tokenizer.decode(t[2:4])]}))
        for r, t in zip(reqs, free)
    ]
    got = b.sampler().sample_batch(stopping)
    for r, g in zip(stopping, got):
        want = alone(b, r)
        assert (g.tokens, g.stop_reason) == (want.tokens, want.stop_reason)
        assert (
            g.stop_reason == "stop" and b.tokenizer.decode(g.tokens).endswith(r.params.stop[0]) and len(g.tokens) <= 4
        )


def test_model_policy_episodes_submit_to_the_running_batch_only_when_asked(tmp_path):
    from tbexp.backends.batch_sampling import BatchQueue
    from tbexp.episodes.policies import ModelRuntime

    b = trained_backend(tmp_path, continuous_batching=True)
    runtime = ModelRuntime(b.sampler(), renderer=None, params=None)
    r = requests(1)[0]
    assert not isinstance(runtime.queue, BatchQueue) and runtime.queue.submit(r).tokens == alone(b, r).tokens
    assert b._batcher.stats["decode_steps"] > 0  # it went through the batcher
    off = lora_backend(tmp_path / "off", "qwen3")
    assert (
        isinstance(ModelRuntime(off.sampler(), renderer=None, params=None).queue, BatchQueue) and off._batcher is None
    )
    # A small model on a CPU merges a private copy per sampler by default; the batcher merges into its own buffers.
    on = lora_backend(tmp_path / "on", "qwen3", continuous_batching=True)
    assert off.sampler()._merged is not None and on.sampler()._merged is None


def test_prompts_arriving_while_rows_decode_are_encoded_a_chunk_between_decode_steps(tmp_path):
    b = trained_backend(tmp_path)
    with b.sampler()._model() as (_, lm):
        engine = ContinuousBatcher(
            lm, b.tokenizer, b.eos_token_ids, page_tokens=4, kv_cache_tokens=2048, prefill_tokens=20
        )
    params = types.SamplingParams(max_tokens=40, temperature=0.9, seed=1, stop=[])
    requests = [Request(random_tokens(5, 50), params)] + [
        Request(random_tokens(10, 60 + i), params.model_copy(update={"seed": 2 + i})) for i in range(4)
    ]
    seqs = [engine._new_sequence(r, None, None, time.perf_counter(), None) for r in requests]
    events = []
    prefill, launch, due = engine._prefill_batch, engine._launch, engine._admission_due
    engine._prefill_batch = lambda chunk: events.append(("prefill", len(chunk))) or prefill(chunk)
    engine._launch = lambda rows: events.append(("decode", len(rows))) or launch(rows)

    def arrive_at_step_3():  # four prompts of 10 tokens arrive while the first request decodes
        if engine.stats["decode_steps"] == 3 and seqs[1] not in engine._waiting + engine.rows:
            engine._waiting.extend(seqs[1:])
        return due()

    engine._admission_due = arrive_at_step_3
    engine._waiting.append(seqs[0])
    while not all(s.future.done() for s in seqs):
        engine._iterate()
    chunks = [i for i, (kind, _) in enumerate(events) if kind == "prefill"]
    assert [events[i][1] for i in chunks] == [1, 2, 2]  # 20-token chunks: two 10-token prompts each
    assert events[chunks[1] + 1] == ("decode", 3)  # the running rows took a step before the next chunk
    for s in seqs:
        assert s.future.result().tokens == alone(b, s.request).tokens
