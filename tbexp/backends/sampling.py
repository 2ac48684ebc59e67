"""Batched sampling with a KV cache: `num_samples` continuations of one prompt.

The prompt is run once (prefill) and its KV cache repeated `num_samples`
times. Each step feeds one token per live sequence; a sequence that hits a
stop condition or `max_tokens` is dropped from the batch and from the cache,
so finished sequences cost nothing afterwards. Because every live sequence
has the same length (prompt + step), no padding or attention mask is needed.

With `static_decode` the batch stays whole instead: the prompt's cache is
copied into a transformers `StaticCache` sized prompt + max_tokens, finished
rows keep decoding (their tokens are dropped), and on CUDA each step after
the first replays one captured CUDA graph of the model's forward, so the
per-step cost is the GPU's, not Python's dispatch of ~100 kernels per layer.
The first step runs eagerly (it warms up and is a real step); autocast's
weight-cast cache is off inside, since a graph must redo those casts.

Token choice follows Tinker's `SamplingParams`: temperature (0 = greedy
argmax), then top-k (-1 = off), then top-p over the tempered distribution,
then a multinomial draw from a `torch.Generator` seeded with `seed` (or, when
`seed` is None, with a number drawn from torch's global RNG, so a run that
restores its RNG state samples the same again). The reported logprob of a
token is under the *untempered*, unfiltered distribution, as Tinker reports it.

Stops, as Tinker documents them: `stop=None` stops on the model's EOS
token(s); `stop=[]` disables every stop including EOS; otherwise exactly the
given stops apply (EOS is then not implied): token ids stop when sampled,
strings stop once they appear in the decoded text of the generated tokens.
The returned tokens *include* the stop: the EOS or stop token, or the token
whose text completes a stop string (any text in that token past the stop
string is kept, since tokens are not split).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from tinker import types
from transformers import DynamicCache, StaticCache

from tbexp.backends.base import SampledSequence


@dataclass(frozen=True)
class Stops:
    token_ids: frozenset[int]
    strings: tuple[str, ...]

    @property
    def tail_tokens(self) -> int:
        """Generated tokens to decode when looking for a stop string: a character may take 4 byte tokens."""
        return 4 * max((len(s) for s in self.strings), default=0) + 4


def resolve_stops(stop: str | Sequence[str] | Sequence[int] | None, eos_token_ids: Sequence[int]) -> Stops:
    if stop is None:
        return Stops(frozenset(eos_token_ids), ())
    if isinstance(stop, str):
        stop = [stop]
    ids = frozenset(int(s) for s in stop if not isinstance(s, str))
    strings = tuple(s for s in stop if isinstance(s, str))
    if any(not s for s in strings):
        raise ValueError("an empty stop string would stop at once")
    return Stops(ids, strings)


@torch.no_grad()
def sample_sequences(
    model,
    tokenizer,
    prompt_tokens: list[int],
    num_samples: int,
    params: types.SamplingParams,
    eos_token_ids: Sequence[int],
    max_context_tokens: int | None = None,
    static_decode: bool = False,
) -> list[SampledSequence]:
    """Sample `num_samples` sequences; the caller puts the model in eval mode and holds its weights fixed."""
    if not prompt_tokens:
        raise ValueError("an empty prompt has no position to sample from")
    device = next(model.parameters()).device
    stops = resolve_stops(params.stop, eos_token_ids)
    if stops.strings and tokenizer is None:
        raise ValueError("stop strings need a tokenizer to decode with")
    max_tokens = params.max_tokens
    if max_tokens is None:
        if max_context_tokens is None:
            raise ValueError("SamplingParams.max_tokens is required when the model's context length is unknown")
        max_tokens = max_context_tokens - len(prompt_tokens)
    generator = seeded_generator(params, device)

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a peft wrapper
    cache = DynamicCache(config=lm.config)
    cache_kw = {cache_kwarg(lm): cache}
    out = model(input_ids=torch.tensor([prompt_tokens], device=device), use_cache=True, logits_to_keep=1, **cache_kw)
    if static_decode:
        return _static_decode(
            model,
            lm,
            cache,
            out.logits[:, -1],
            len(prompt_tokens),
            num_samples,
            max(max_tokens, 0),
            params,
            stops,
            tokenizer,
            generator,
        )
    cache.batch_repeat_interleave(num_samples)
    logits_B_V = out.logits[:, -1].expand(num_samples, -1)

    tokens = [[] for _ in range(num_samples)]
    logprobs = [[] for _ in range(num_samples)]
    reasons = ["length"] * num_samples
    live = list(range(num_samples))  # row b of the batch is sequence live[b]
    for _ in range(max(max_tokens, 0)):
        logits_B_V = logits_B_V.float()
        picked_B = _pick(logits_B_V, params, generator)
        logp_B = torch.log_softmax(logits_B_V, dim=-1).gather(1, picked_B[:, None]).squeeze(1)
        keep = []
        for b, (tok, lp) in enumerate(zip(picked_B.tolist(), logp_B.tolist())):
            i = live[b]
            tokens[i].append(tok)
            logprobs[i].append(lp)
            if stopped(tokens[i], stops, tokenizer):
                reasons[i] = "stop"
            elif len(tokens[i]) < max_tokens:
                keep.append(b)
        if not keep:
            break
        if len(keep) < len(live):
            keep_t = torch.tensor(keep, device=device)
            cache.batch_select_indices(keep_t)
            picked_B = picked_B[keep_t]
            live = [live[b] for b in keep]
        out = model(input_ids=picked_B[:, None], use_cache=True, **cache_kw)
        logits_B_V = out.logits[:, -1]
    return [SampledSequence(tokens=t, logprobs=lp, stop_reason=r) for t, lp, r in zip(tokens, logprobs, reasons)]


def _static_decode(
    model,
    lm,
    prompt_cache: DynamicCache,
    logits_1_V: torch.Tensor,
    prompt_len: int,
    num_samples: int,
    max_tokens: int,
    params: types.SamplingParams,
    stops: Stops,
    tokenizer,
    generator,
) -> list[SampledSequence]:
    """The decode loop over a whole batch and a static cache, graph-replayed on CUDA (see the module docstring)."""
    device = logits_1_V.device
    cache = StaticCache(config=lm.config, max_cache_len=prompt_len + max_tokens)
    for static, prompt in zip(cache.layers, prompt_cache.layers):
        static.update(
            prompt.keys.expand(num_samples, -1, -1, -1).contiguous(),
            prompt.values.expand(num_samples, -1, -1, -1).contiguous(),
        )
    del prompt_cache
    tokens_B_1 = torch.zeros(num_samples, 1, dtype=torch.long, device=device)  # the graph's inputs, refilled each step
    positions_B_1 = torch.zeros_like(tokens_B_1)
    cache_kw = {cache_kwarg(lm): cache}

    def step() -> torch.Tensor:
        return model(input_ids=tokens_B_1, position_ids=positions_B_1, use_cache=True, **cache_kw).logits[:, -1]

    on_gpu = device.type == "cuda"
    autocast = (
        torch.autocast(device.type, dtype=torch.get_autocast_dtype(device.type), cache_enabled=False)
        if torch.is_autocast_enabled(device.type)
        else nullcontext()
    )
    graph, logits_B_V = None, logits_1_V.expand(num_samples, -1)
    graph_logits_B_V = logits_B_V  # the captured output buffer, once a graph exists
    tokens, logprobs = [[] for _ in range(num_samples)], [[] for _ in range(num_samples)]
    reasons, done = ["length"] * num_samples, [False] * num_samples
    for t in range(max_tokens):
        logits_B_V = logits_B_V.float()
        picked_B = _pick(logits_B_V, params, generator)
        logp_B = torch.log_softmax(logits_B_V, dim=-1).gather(1, picked_B[:, None]).squeeze(1)
        picked, logp = torch.stack([picked_B.double(), logp_B.double()]).tolist()  # one sync a step
        for b in range(num_samples):
            if done[b]:
                continue
            tokens[b].append(int(picked[b]))
            logprobs[b].append(logp[b])
            if stopped(tokens[b], stops, tokenizer):
                reasons[b], done[b] = "stop", True
            done[b] = done[b] or len(tokens[b]) >= max_tokens
        if all(done):
            break
        tokens_B_1.copy_(picked_B[:, None])
        positions_B_1.fill_(prompt_len + t)
        with autocast:
            if graph is not None:
                graph.replay()
                logits_B_V = graph_logits_B_V
            elif on_gpu:  # this step eagerly on a side stream (the warm-up a capture needs), then capture the next
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    logits_B_V = step().clone()
                torch.cuda.current_stream().wait_stream(side)
                graph, graph_logits_B_V = _capture(step)
                on_gpu = graph is not None  # a forward that cannot be captured decodes eagerly
            else:
                logits_B_V = step()
    return [SampledSequence(tokens=t, logprobs=lp, stop_reason=r) for t, lp, r in zip(tokens, logprobs, reasons)]


def _capture(step):
    """(graph, its output) of one capture of `step`, or Nones if the forward cannot be captured (a host sync, say)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = step()
    except RuntimeError as e:
        warnings.warn(
            f"static decode runs eagerly: the forward pass could not be captured in a CUDA graph ({e})", stacklevel=3
        )
        return None, None
    return graph, out


def cache_kwarg(lm) -> str:
    """transformers 5 renamed `past_key_values` to `cache`; accept either."""
    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"


def seeded_generator(params: types.SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
    return torch.Generator(device=device).manual_seed(seed)


def _pick(logits_B_V: torch.Tensor, params: types.SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    if params.temperature == 0:
        return logits_B_V.argmax(dim=-1)
    logits_B_V = filter_logits(logits_B_V / params.temperature, params.top_k, params.top_p)
    return torch.multinomial(torch.softmax(logits_B_V, dim=-1), 1, generator=generator).squeeze(1)


def filter_logits(logits_B_V: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to −inf) all but the `top_k` largest logits, then all outside the smallest set with mass ≥ `top_p`."""
    if 0 < top_k < logits_B_V.shape[-1]:
        kth_B_1 = torch.topk(logits_B_V, top_k, dim=-1).values[:, -1:]
        logits_B_V = logits_B_V.masked_fill(logits_B_V < kth_B_1, float("-inf"))
    if top_p < 1:
        sorted_B_V, order_B_V = torch.sort(logits_B_V, dim=-1, descending=True)
        probs_B_V = torch.softmax(sorted_B_V, dim=-1)
        outside_B_V = probs_B_V.cumsum(dim=-1) - probs_B_V >= top_p  # mass before this token already reaches top_p
        outside_B_V[:, 0] = False
        logits_B_V = logits_B_V.scatter(1, order_B_V, sorted_B_V.masked_fill(outside_B_V, float("-inf")))
    return logits_B_V


def stopped(generated: list[int], stops: Stops, tokenizer) -> bool:
    if generated[-1] in stops.token_ids:
        return True
    if not stops.strings:
        return False
    # Decoding only the tail is enough: a match that ended at an earlier token stopped that step.
    text = tokenizer.decode(generated[-stops.tail_tokens :])
    return any(s in text for s in stops.strings)
