"""One reply each for many different prompts in one batched decode, and a queue that forms such batches.

Concurrent episodes each ask for one reply to their own conversation. On a
CPU, a decode step costs nearly the same for 8 rows as for 1 (the time goes
to per-layer overhead, not arithmetic), so `BatchQueue` gathers the requests
waiting at a moment and `sample_batch` answers them together.

`sample_batch` left-pads the prompts to a common length, with an attention
mask and position ids that count only real tokens, so each row sees exactly
its own prompt; rows leave the batch (and the KV cache) when they stop. Each
row draws from its own generator seeded by its request, so what a request
gets does not depend on which others shared its batch (up to float rounding
in batched matrix products). Stops and logprobs follow `sampling.py`.

The forward passes go through `TransformersSteps` (the model's own forward,
transformers' cache) or, for a plain Llama model on the CPU, through
`tbexp.backends.llama_steps.LlamaSteps`, the same operations without
transformers' per-call overhead: the same logits bit for bit, 1.31x the tokens/s
on a batch of 8 and a quarter less sampler CPU in a held-out eval (docs/grpo.md).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from tinker import types
from transformers import DynamicCache

from tbexp.backends.base import SampledSequence
from tbexp.backends.llama_steps import LlamaSteps
from tbexp.backends.sampling import cache_kwarg, filter_logits, resolve_stops, seeded_generator, stopped


@dataclass
class Request:
    prompt: list[int]
    params: types.SamplingParams


@torch.no_grad()
def sample_batch(model, tokenizer, requests: list[Request], eos_token_ids: list[int]) -> list[SampledSequence]:
    """One sampled sequence per request; the caller puts the model in eval mode and holds its weights fixed."""
    device = next(model.parameters()).device
    stops = [resolve_stops(r.params.stop, eos_token_ids) for r in requests]
    generators = [seeded_generator(r.params, device) for r in requests]
    limits = [r.params.max_tokens for r in requests]
    if any(limit is None for limit in limits):
        raise ValueError("batched sampling needs SamplingParams.max_tokens")
    width = max(len(r.prompt) for r in requests)
    tokens_B_T = torch.zeros(len(requests), width, dtype=torch.long)
    mask_B_T = torch.zeros(len(requests), width, dtype=torch.long)
    for b, r in enumerate(requests):
        tokens_B_T[b, width - len(r.prompt) :] = torch.tensor(r.prompt)
        mask_B_T[b, width - len(r.prompt) :] = 1
    tokens_B_T, mask_B_T = tokens_B_T.to(device), mask_B_T.to(device)
    positions_B_T = (mask_B_T.cumsum(-1) - 1).clamp(min=0)

    steps = LlamaSteps(model) if LlamaSteps.supports(model) else TransformersSteps(model)
    logits_B_V = steps.prefill(tokens_B_T, mask_B_T, positions_B_T)
    next_B = positions_B_T[:, -1] + 1

    results = [SampledSequence([], [], "length") for _ in requests]
    live = list(range(len(requests)))  # row b of the batch is request live[b]
    while live:
        logits_B_V = logits_B_V.float()
        logp_B_V = torch.log_softmax(logits_B_V, dim=-1)
        picked = [_pick_row(logits_B_V[b], requests[i].params, generators[i]) for b, i in enumerate(live)]
        keep = []
        for b, (i, token) in enumerate(zip(live, picked)):
            seq = results[i]
            seq.tokens.append(token)
            seq.logprobs.append(float(logp_B_V[b, token]))
            if stopped(seq.tokens, stops[i], tokenizer):
                seq.stop_reason = "stop"
            elif len(seq.tokens) < limits[i]:
                keep.append(b)
        if not keep:
            break
        if len(keep) < len(live):
            keep_t = torch.tensor(keep, device=device)
            steps.keep(keep_t)
            next_B = next_B[keep_t]
            live = [live[b] for b in keep]
        logits_B_V = steps.decode(torch.tensor([picked[b] for b in keep], device=device), next_B)
        next_B = next_B + 1
    return results


class TransformersSteps:
    """A batch's prefill and decode steps through the model's own forward (any model transformers can run);
    `LlamaSteps` is the same for Llama models without transformers' per-call overhead."""

    def __init__(self, model):
        self.model = model
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.cache = DynamicCache(config=lm.config)
        self.cache_kw = {cache_kwarg(lm): self.cache}

    def prefill(self, tokens_B_T: torch.Tensor, mask_B_T: torch.Tensor, positions_B_T: torch.Tensor) -> torch.Tensor:
        self.mask_B_T = mask_B_T
        out = self.model(
            input_ids=tokens_B_T,
            attention_mask=mask_B_T,
            position_ids=positions_B_T,
            use_cache=True,
            logits_to_keep=1,
            **self.cache_kw,
        )
        return out.logits[:, -1]

    def decode(self, tokens_B: torch.Tensor, positions_B: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(len(tokens_B), 1, dtype=self.mask_B_T.dtype, device=self.mask_B_T.device)
        self.mask_B_T = torch.cat([self.mask_B_T, ones], dim=1)
        out = self.model(
            input_ids=tokens_B[:, None],
            attention_mask=self.mask_B_T,
            position_ids=positions_B[:, None],
            use_cache=True,
            **self.cache_kw,
        )
        return out.logits[:, -1]

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask_B_T = self.mask_B_T[rows]


def _pick_row(logits_V: torch.Tensor, params: types.SamplingParams, generator: torch.Generator | None) -> int:
    if params.temperature == 0:
        return int(logits_V.argmax())
    logits_1_V = filter_logits(logits_V[None] / params.temperature, params.top_k, params.top_p)
    return int(torch.multinomial(torch.softmax(logits_1_V, dim=-1), 1, generator=generator))


class BatchQueue:
    """Answers `submit(request)` from many threads by running `run_batch` over whatever is waiting.

    The first caller to find no batch running runs one itself over every
    request queued so far; the others wait for their answers. No timer: a
    batch is whatever arrived while the previous one ran, so a lone caller
    never waits and a busy moment fills the batch by itself.

    Which requests meet in a batch then follows thread timing, and a batched
    product rounds differently from a lone one: two runs of the same seeds
    differ in the last bits, and then by the draws those bits tip. After
    `lockstep(workers, jobs)` a batch instead waits until every worker that
    still has a job is waiting (each worker tells `job_done()` as it finishes
    one), and runs them sorted by seed and prompt: the same batches on every
    run, at the cost of the sampler idling while the slowest command runs.
    """

    def __init__(self, run_batch, max_batch: int = 64):
        self.run_batch = run_batch
        self.max_batch = max_batch
        self._workers = 0  # lockstep: how many threads run jobs (0 = off), and how many jobs are not done
        self._unfinished = 0
        # Waiters sleep on this until a batch ends instead of polling (15 waiters polling every 5 ms woke 3,000 times
        # a second, each time taking the GIL from the thread that runs the batch, to find nothing to do).
        self._changed = threading.Condition()
        self._waiting: list[tuple[Request, Future]] = []
        self._running = False
        self.batches = 0  # for benchmarks: how many batches, of how many requests, taking how long
        self.requests = 0
        self.busy_s = 0.0

    def lockstep(self, workers: int, jobs: int) -> None:
        """From now on, batch the requests of all `workers` at once while `jobs` (counted down by `job_done`) last."""
        with self._changed:
            self._workers, self._unfinished = workers, jobs
            self._changed.notify_all()

    def job_done(self) -> None:
        with self._changed:
            self._unfinished -= 1
            self._changed.notify_all()

    def _ready(self) -> bool:
        if not self._waiting:
            return False
        return not self._workers or len(self._waiting) >= min(self._workers, self._unfinished)

    def submit(self, request: Request) -> SampledSequence:
        future: Future = Future()
        with self._changed:
            self._waiting.append((request, future))
        while True:
            with self._changed:
                while not future.done() and (self._running or not self._ready()):
                    self._changed.wait()
                if future.done():
                    break
                if self._workers:  # every worker's request, in an order that does not depend on who asked first
                    waiting, self._waiting = sorted(self._waiting, key=lambda pair: _order(pair[0])), []
                else:
                    waiting, self._waiting = self._waiting[: self.max_batch], self._waiting[self.max_batch :]
                self._running = True
            for at in range(0, len(waiting), self.max_batch):
                self._run(waiting[at : at + self.max_batch])
            with self._changed:
                self._running = False
                self._changed.notify_all()
        return future.result()

    def _run(self, batch: list[tuple[Request, Future]]) -> None:
        start = time.perf_counter()
        try:
            answers = self.run_batch([r for r, _ in batch])
            for (_, f), answer in zip(batch, answers):
                f.set_result(answer)
        except BaseException as err:  # every waiter learns of the failure, not only this thread
            for _, f in batch:
                if not f.done():
                    f.set_exception(err)
        finally:
            with self._changed:
                self.batches += 1
                self.requests += len(batch)
                self.busy_s += time.perf_counter() - start


def _order(request: Request) -> tuple:
    """A request's place in a lockstep batch: its seed (a function of task, run and turn), then its prompt."""
    seed = request.params.seed
    return (seed is None, seed or 0, request.prompt)
