"""Continuous batching for the local backend's sampler: concurrent requests share one running decode batch.

`backend.continuous_batching=true` routes every sampling request of a
`LocalSampler` here. Requests join the running batch between decode steps
and leave it the step they stop, so a short reply never waits for a long
one and a new episode turn never waits for a whole batch to drain. Each
iteration of the loop (`ContinuousBatcher._iterate`):

1. admits waiting requests while rows and cache pages are free: the prompt's
   leading full pages that are already cached (the same tokens under the
   same weights: the other samples of a GRPO group, the earlier turns of an
   episode) are shared, and only the rest is encoded (prefill, packed passes
   of `prefill_tokens` new tokens). While rows are decoding, one such chunk
   is admitted per iteration, so a burst of new prompts holds the running
   rows up for one chunk at a time, not for all of them;
2. runs one decode step over all live rows (one token each), padded up to the
   next batch-size bucket, replaying that bucket's CUDA graph on a GPU;
3. samples every row, appends, checks stops, and frees the rows that finished.
   Steps 2 and 3 run one step ahead: the device's inputs for step t+1 are
   the tokens it sampled at step t, so step t+1 is queued before the host
   reads step t's tokens and the host's work (appending, stop tokens, the
   stop strings of the few rows whose new token can end one: stop_screen.py)
   overlaps the device's; a row that ends at step t drops its step t+1 token.
   The host writes a row's step inputs once, when it joins; when rows leave,
   the survivors' device state moves into the freed places by one gather.

KV cache: pages of `page_tokens` tokens in one pool per layer (see
paged_kernels.py for the layout); a sequence holds a block table of pages,
so no row is padded to the longest and memory grows with each sequence's own
length. A request reserves the pages for prompt + max_tokens when admitted
(simplified: no preemption; a request that does not fit waits). A page that
fills up is registered under a hash of every token up to its end; a
finished sequence's registered pages stay cached (least recently used ones
are reused first) until the weights change.

Weights: the decoder runs from private fused tensors (QKV, gate/up) with
the policy's LoRA deltas merged in once per sampler snapshot, into buffers
of fixed address, so graphs captured once stay valid across snapshots.
A snapshot different from the loaded one waits until the batch drains.

Sampling is Gumbel-max with counter-based noise per (seed, token index,
vocabulary id) (paged_kernels.py), so what a seeded request gets does not
depend on which others share its batch (up to the rounding of batched
matrix products), and is the same on CPU and GPU up to that rounding; it
is not the stream `sampling.py`'s seeded generators draw. Temperature, top-k,
top-p, stops and logprobs (untempered) follow `sampling.py`.

Threads: `submit` blocks its caller. No background thread: the first
caller to find no loop running drives it until its own requests finish,
then hands over to a caller still waiting.

Supported models: Llama-style decoders (llama, qwen2, qwen3, mistral
without a sliding window) with SiLU MLPs; others raise at construction.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from tbexp.backends.base import SampledSequence
from tbexp.backends.batch_sampling import Request
from tbexp.backends.paged_kernels import OPS, gather_pages, triton_available
from tbexp.backends.sampling import filter_logits, resolve_stops
from tbexp.backends.stop_screen import StopScreen

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
SCRATCH_PAGE = 0  # padding rows of a bucket write and read here; never handed to a sequence
SEED_STRIDE = 0x9E3779B97F4A7C15  # sample i of a seeded sample(prompt, n) draws with seed + i·stride


@dataclass
class _Sequence:
    request: Request
    future: Future
    snapshot: object
    seed: int
    stops: object
    limit: int
    submitted_s: float
    pages: list[int] = field(default_factory=list)
    written: int = 0  # tokens whose K/V are in the cache
    cached_prefix: int = 0  # of those, how many came from shared pages
    tokens: list[int] = field(default_factory=list)  # generated
    logprobs: list[float] = field(default_factory=list)
    first_token_s: float | None = None
    done: str | None = None
    load: object = None  # load(engine): fill the engine with this request's weights
    stop_ends: object = frozenset()  # token ids after which a stop string may appear (stop_screen.py)

    @property
    def context(self) -> list[int]:
        return self.request.prompt + self.tokens


class PagePool:
    """Free pages, reference counts and the prefix cache (page hash → page), least recently used first."""

    def __init__(self, n_pages: int):
        self.free = list(range(n_pages - 1, SCRATCH_PAGE, -1))  # page 0 is the scratch page
        self.refs = [0] * n_pages
        self.digest_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached pages no sequence holds: reusable, oldest first

    def available(self) -> int:
        return len(self.free) + len(self.idle)

    def take(self, n: int) -> list[int]:
        pages = []
        for _ in range(n):
            if self.free:
                page = self.free.pop()
            else:
                page, _ = self.idle.popitem(last=False)
                del self.page_of[self.digest_of.pop(page)]
            self.refs[page] = 1
            pages.append(page)
        return pages

    def share(self, page: int) -> None:
        if self.refs[page] == 0:
            del self.idle[page]
        self.refs[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.digest_of:
                    self.idle[page] = None
                else:
                    self.free.append(page)

    def register(self, page: int, digest: bytes) -> None:
        if digest not in self.page_of and page not in self.digest_of:
            self.page_of[digest] = page
            self.digest_of[page] = digest

    def forget_all(self) -> None:
        """The weights changed: no cached K/V is valid any more."""
        self.free.extend(self.idle)
        self.idle.clear()
        self.digest_of.clear()
        self.page_of.clear()


def page_digests(tokens: list[int], page_tokens: int) -> list[bytes]:
    """One digest per full page of `tokens`, each covering every token up to that page's end."""
    digests, previous = [], b""
    for start in range(0, len(tokens) - page_tokens + 1, page_tokens):
        previous = hashlib.blake2b(
            previous + np.asarray(tokens[start : start + page_tokens], dtype=np.int64).tobytes(), digest_size=16
        ).digest()
        digests.append(previous)
    return digests


class DecodeWeights:
    """The decoder's weights as fused tensors with LoRA merged, refilled in place by `load` (fixed addresses)."""

    def __init__(self, lm):
        config = lm.config
        _check_supported(config)
        decoder = lm.get_decoder()
        attn = decoder.layers[0].self_attn
        self.n_layers = len(decoder.layers)
        self.n_q_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = float(attn.scaling)
        self.eps = float(config.rms_norm_eps)
        self.has_qk_norm = hasattr(attn, "q_norm")
        self.has_qkv_bias = _linear_bias(attn.q_proj) is not None
        self.embed = lm.get_input_embeddings().weight  # never LoRA-wrapped here (the backend refuses it); read in place
        self.dtype = self.embed.dtype
        self.head = lm.get_output_embeddings().weight  # tied or not, frozen: read in place
        self.layers: list[dict[str, torch.Tensor]] = []
        self.final_norm: torch.Tensor | None = None
        self.load(lm)

    def load(self, lm) -> float:
        """Copy `lm`'s current weights (LoRA deltas merged) into the buffers; returns the seconds it took."""
        start = time.perf_counter()
        decoder = lm.get_decoder()
        fresh = not self.layers
        with torch.no_grad():
            for i, layer in enumerate(decoder.layers):
                a, m = layer.self_attn, layer.mlp
                tensors = {
                    "qkv": torch.cat(
                        [_effective_weight(a.q_proj), _effective_weight(a.k_proj), _effective_weight(a.v_proj)]
                    ),
                    "o": _effective_weight(a.o_proj),
                    "gate_up": torch.cat([_effective_weight(m.gate_proj), _effective_weight(m.up_proj)]),
                    "down": _effective_weight(m.down_proj),
                    "ln1": layer.input_layernorm.weight,
                    "ln2": layer.post_attention_layernorm.weight,
                }
                if self.has_qkv_bias:
                    tensors["qkv_bias"] = torch.cat(
                        [_linear_bias(a.q_proj), _linear_bias(a.k_proj), _linear_bias(a.v_proj)]
                    )
                if self.has_qk_norm:
                    tensors["q_norm"], tensors["k_norm"] = a.q_norm.weight, a.k_norm.weight
                if fresh:
                    self.layers.append({k: v.detach().to(self.dtype).contiguous().clone() for k, v in tensors.items()})
                else:
                    for k, v in tensors.items():
                        self.layers[i][k].copy_(v)
            final = _final_norm_weight(decoder.norm)
            if fresh:
                self.final_norm = final.to(self.dtype).clone()
            else:
                self.final_norm.copy_(final)
        if self.embed.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def _check_supported(config) -> None:
    kind = getattr(config, "model_type", "")
    problems = []
    if kind not in SUPPORTED:
        problems.append(f"model_type {kind!r} is not one of {SUPPORTED}")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (only silu)")
    if getattr(config, "use_sliding_window", False) or (kind == "mistral" and getattr(config, "sliding_window", None)):
        problems.append("a sliding attention window")
    if getattr(config, "mlp_bias", False):
        problems.append("MLP biases")
    if problems:
        raise ValueError(
            f"backend.continuous_batching: {type(config).__name__} is not supported ({'; '.join(problems)}); "
            "set backend.continuous_batching=false"
        )


def _linear_bias(module):
    base = getattr(module, "base_layer", module)
    return base.bias


def _effective_weight(module) -> torch.Tensor:
    """A linear layer's weight with its active LoRA deltas added (peft's own delta computation), in fp32."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return module.weight.float()
    weight = base.weight.float()
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return weight
    for name in module.active_adapters:
        if name in module.lora_A:
            weight = weight + module.get_delta_weight(name).float()
    return weight


def _final_norm_weight(norm) -> torch.Tensor:
    """The final RMSNorm's gain, times model.logit_scale's factor when the norm carries one (logit_scale.py)."""
    if hasattr(norm, "log_scale"):
        return norm.norm.weight.float() * norm.log_scale.float().exp()
    return norm.weight.float()


class ContinuousBatcher:
    """The running batch, its paged KV cache and its CUDA graphs; one per backend (see the module docstring)."""

    def __init__(
        self,
        lm,
        tokenizer,
        eos_token_ids,
        *,
        snapshot=None,
        kv_cache_tokens: int = 0,
        page_tokens: int = 0,
        max_batch: int = 256,
        max_seq_tokens: int = 0,
        cuda_graphs: bool = True,
        kernels: str = "auto",
        prefill_tokens: int = 16384,
    ):
        self.weights = w = DecodeWeights(lm)
        self.device = w.embed.device
        self.tokenizer, self.eos_token_ids = tokenizer, list(eos_token_ids)
        on_gpu = self.device.type == "cuda"
        if kernels == "auto":
            kernels = "triton" if on_gpu and triton_available() else "torch"
        if kernels not in OPS:
            raise ValueError(f"kernels={kernels!r}: choose one of {sorted(OPS)} or auto")
        self.kernels = kernels
        self.ops = OPS[kernels]
        self.page_tokens = page_tokens or (32 if kernels == "triton" else 16)
        if kernels == "triton" and self.page_tokens < 16:
            raise ValueError("the Triton attention kernel needs page_tokens >= 16")
        self.max_seq_tokens = sequence_limit(lm.config, max_seq_tokens)
        self.max_batch = max_batch
        self.prefill_tokens = prefill_tokens
        self.cuda_graphs = cuda_graphs and on_gpu and kernels == "triton"  # the torch attention syncs on its lengths
        self.max_pages_per_seq = -(-self.max_seq_tokens // self.page_tokens)
        if not kv_cache_tokens:  # on a GPU the backend's memory plan sizes the pool (memory_plan.py)
            if on_gpu:
                raise ValueError("kv_cache_tokens: on a GPU, give the pool's size (LocalBackend.memory_plan's)")
            kv_cache_tokens = 65536
        n_pages = max(2, kv_cache_tokens // self.page_tokens + 1)
        shape = (w.n_layers, n_pages, w.n_kv_heads, self.page_tokens, w.head_dim)
        self.k_cache = torch.zeros(shape, dtype=w.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=w.dtype, device=self.device)
        self.pool = PagePool(n_pages)
        self.rope_cos, self.rope_sin = _rope_tables(lm, self.max_seq_tokens, self.device)
        # Per-row device state of the decode batch; a bucket's step reads the first `bucket` rows.
        self.block_tables = torch.full(
            (max_batch, self.max_pages_per_seq), SCRATCH_PAGE, dtype=torch.int32, device=self.device
        )
        # token, position, slot, length; a padding row (past the live ones) writes the scratch slot, reads 1 token
        self._padding_inputs = torch.tensor(
            [[0], [0], [SCRATCH_PAGE * self.page_tokens], [1]], dtype=torch.long, device=self.device
        ).expand(4, max_batch)
        self.step_inputs = self._padding_inputs.contiguous()
        self.sample_inputs = torch.zeros(2, max_batch, dtype=torch.long, device=self.device)  # seed, token index
        self.temperatures = torch.zeros(max_batch, dtype=torch.float32, device=self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.rows: list[_Sequence] = []
        self.snapshot = snapshot
        self._cond = threading.Condition()
        self._waiting: list[_Sequence] = []
        self._driving = False
        self._varlen = _varlen_attention() if on_gpu else None
        self._filtering_rows = 0  # rows with top-k or top-p, whose logits are filtered before the draw
        self._stops = StopScreen(tokenizer, w.head.shape[0]) if tokenizer is not None else None
        self._host_buffers: list[torch.Tensor] = []  # pinned, two: the device-to-host copies of steps' picks
        self.first_token_s: list[float] = []  # time to first token of each finished request, submit to sample
        self.stats = {
            "prefill_tokens": 0,
            "cached_prompt_tokens": 0,
            "decode_steps": 0,
            "decode_rows": 0,
            "weight_loads": 0,
            "weight_load_s": 0.0,
            "graph_captures": 0,
            "decode_s": 0.0,
            "device_wait_s": 0.0,
            "prefill_s": 0.0,
        }  # decode_s − device_wait_s: the host's share of decoding

    # ---- public ----

    def submit(self, request: Request, snapshot=None, load=None) -> SampledSequence:
        """Sample one reply; blocks until it is done (see the module docstring)."""
        return self.submit_all([request], snapshot, load)[0]

    def submit_all(
        self, requests: list[Request], snapshot=None, load=None, seeds: list[int] | None = None
    ) -> list[SampledSequence]:
        """One reply per request, all in the running batch; `load(engine)` fills in `snapshot`'s weights if needed."""
        now = time.perf_counter()
        seqs = [
            self._new_sequence(r, snapshot, load, now, None if seeds is None else seeds[i])
            for i, r in enumerate(requests)
        ]
        with self._cond:
            self._waiting.extend(seqs)
        futures = [s.future for s in seqs]
        while not all(f.done() for f in futures):
            with self._cond:
                while self._driving and not all(f.done() for f in futures):
                    self._cond.wait()
                if all(f.done() for f in futures):
                    break
                self._driving = True
            try:
                while not all(f.done() for f in futures):
                    self._iterate()
            except BaseException as err:  # every caller learns of the failure
                self._fail(err)
                raise
            finally:
                with self._cond:
                    self._driving = False
                    self._cond.notify_all()
        return [f.result() for f in futures]

    def load(self, lm, snapshot) -> float:
        """Fill the weights from `lm`; drops the prefix cache. Only between batches (the caller guarantees it)."""
        seconds = self.weights.load(lm)
        self.pool.forget_all()
        self.snapshot = snapshot
        self.stats["weight_loads"] += 1
        self.stats["weight_load_s"] += seconds
        return seconds

    # ---- the loop ----

    def _new_sequence(self, request: Request, snapshot, load, now: float, seed: int | None) -> _Sequence:
        params = request.params
        if not request.prompt:
            raise ValueError("an empty prompt has no position to sample from")
        limit = params.max_tokens if params.max_tokens is not None else self.max_seq_tokens - len(request.prompt)
        if len(request.prompt) + limit > self.max_seq_tokens:
            raise ValueError(
                f"prompt ({len(request.prompt)}) + max_tokens ({limit}) exceeds the batcher's "
                f"{self.max_seq_tokens} tokens a sequence"
            )
        need = -(-(len(request.prompt) + limit) // self.page_tokens)
        if need > len(self.pool.refs) - 1:
            raise ValueError(
                f"a request of {len(request.prompt) + limit} tokens needs {need} cache pages; "
                f"the cache has {len(self.pool.refs) - 1}: raise kv_cache_tokens"
            )
        stops = resolve_stops(params.stop, self.eos_token_ids)
        if stops.strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode with")
        if seed is None:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        seq = _Sequence(request, Future(), snapshot, seed % 2**63, stops, max(limit, 0), now, load=load)
        if stops.strings:
            seq.stop_ends = self._stops.ends(stops.strings)
        return seq

    def _iterate(self) -> None:
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
            self._retire()  # a reply can end at its first token
        if self.rows:
            self._decode_run()
            self._retire()

    def _admit(self) -> list[_Sequence]:
        """Waiting requests that get rows and pages now; while rows are decoding, only as many as one prefill
        chunk encodes, so that decoding goes on between chunks instead of waiting for every prompt."""
        admitted, new_tokens = [], 0
        with self._cond:
            while self._waiting and len(self.rows) + len(admitted) < self.max_batch:
                seq = self._waiting[0]
                if seq.snapshot is not self.snapshot:
                    if self.rows or admitted:
                        break  # other weights: wait until the batch drains
                    if seq.load is not None:
                        seq.load(self)
                    self.snapshot = seq.snapshot
                if seq.limit == 0:
                    self._waiting.pop(0)
                    seq.done = "length"
                    self._finish(seq)
                    continue
                shared = self._cached_pages(seq.request.prompt)
                new = len(seq.request.prompt) - len(shared) * self.page_tokens
                if self.rows and admitted and new_tokens + new > self.prefill_tokens:
                    break  # the next chunk's: decoding takes a step first
                if not self._reserve(seq, shared):
                    break
                self._waiting.pop(0)
                admitted.append(seq)
                new_tokens += new
        return admitted

    def _cached_pages(self, prompt: list[int]) -> list[int]:
        """The cached pages holding the prompt's leading full pages (not its last token: its logits start the
        reply, so it is always run)."""
        shared = []
        for digest in page_digests(prompt[:-1], self.page_tokens):
            page = self.pool.page_of.get(digest)
            if page is None:
                break
            shared.append(page)
        return shared

    def _reserve(self, seq: _Sequence, shared: list[int]) -> bool:
        """Pages for the whole request: the `shared` cached ones for the prompt's leading full pages, new ones after."""
        prompt = seq.request.prompt
        need = -(-(len(prompt) + seq.limit) // self.page_tokens) - len(shared)
        if need > self.pool.available() - sum(1 for p in shared if self.pool.refs[p] == 0):
            return False
        for page in shared:
            self.pool.share(page)
        seq.pages = shared + self.pool.take(need)
        seq.written = seq.cached_prefix = len(shared) * self.page_tokens
        # Registered now, before the prefill writes them: a request admitted after this one in the same iteration
        # shares them, and its prefill (later in the same packed pass, or a later chunk) reads them once written.
        for i, digest in enumerate(page_digests(prompt, self.page_tokens)):
            self.pool.register(seq.pages[i], digest)
        self.stats["cached_prompt_tokens"] += seq.cached_prefix
        return True

    def _prefill(self, seqs: list[_Sequence]) -> None:
        """Encode admitted prompts' uncached tokens (packed, `prefill_tokens` a chunk); sample their first tokens."""
        chunks: list[list[_Sequence]] = [[]]
        total = 0
        for seq in seqs:
            n = len(seq.request.prompt) - seq.written
            if chunks[-1] and total + n > self.prefill_tokens:
                chunks.append([])
                total = 0
            chunks[-1].append(seq)
            total += n
        began = time.perf_counter()
        for chunk in chunks:
            if chunk:
                self._append_first(chunk, self._prefill_batch(chunk))
        self.stats["prefill_s"] += time.perf_counter() - began
        self._add_rows(seqs)

    def _prefill_inputs(self, seqs: list[_Sequence]):
        """The packed chunk's (token, position, slot) [3, N] on the device, and each prompt's (start, new, length)."""
        columns, spans, start = [], [], 0
        for seq in seqs:
            prompt = seq.request.prompt
            positions = np.arange(seq.written, len(prompt))
            pages = np.asarray(seq.pages, dtype=np.int64)
            slots = pages[positions // self.page_tokens] * self.page_tokens + positions % self.page_tokens
            columns.append(np.stack([np.asarray(prompt[seq.written :], dtype=np.int64), positions, slots]))
            spans.append((start, len(positions), len(prompt)))
            start += len(positions)
        return self._upload(np.concatenate(columns, axis=1)), spans

    def _upload(self, array: np.ndarray, into: torch.Tensor | None = None) -> torch.Tensor:
        """`array` on the device (or copied `into` a device tensor) without waiting for the device to finish what
        it has queued: torch's copy from pageable host memory synchronizes the stream, one from pinned memory not."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            host = host.pin_memory()
        if into is not None:
            return into.copy_(host, non_blocking=True)
        return host.to(self.device, non_blocking=True)

    def _prefill_batch(self, seqs: list[_Sequence]):
        """Queue one packed chunk's encoding and its first tokens' sampling; returns the wait for (tokens, logprobs)."""
        dev = self.device
        inputs, spans = self._prefill_inputs(seqs)
        tokens_N, positions_N, slots_N = inputs

        # Prompts with nothing cached attend to their own tokens only: on a GPU, one packed varlen (flash) call per
        # layer over all of them, their K/V read back from the slots just written; the rest, one SDPA call each.
        fresh = [i for i, (_, n, length) in enumerate(spans) if n == length] if self._varlen else []
        if len(fresh) > 1:
            rows = np.concatenate([np.arange(spans[i][0], spans[i][0] + spans[i][1]) for i in fresh])
            every = len(fresh) == len(spans)  # then rows_T is 0..N-1
            rows_T = None if every else self._upload(rows)
            slots_T = slots_N if every else slots_N[rows_T]
            pages_T, offsets_T = slots_T // self.page_tokens, slots_T % self.page_tokens
            cu = self._upload(np.cumsum([0] + [spans[i][1] for i in fresh]).astype(np.int32))
            longest = max(spans[i][1] for i in fresh)
        else:
            fresh = []
        packed = set(fresh)
        others = [i for i in range(len(spans)) if i not in packed]
        page_tables = {i: self._upload(np.asarray(seqs[i].pages, dtype=np.int64)) for i in others}

        def attend(layer: int, q_N_H_d: torch.Tensor) -> torch.Tensor:
            if not fresh:
                return attend_each(layer, q_N_H_d, range(len(spans)))
            k = self.k_cache[layer][pages_T, :, offsets_T]  # [T, KV heads, d]
            v = self.v_cache[layer][pages_T, :, offsets_T]
            q = q_N_H_d if rows_T is None else q_N_H_d[rows_T]
            out_T = self._varlen(q, k, v, cu, longest, self.weights.scale).reshape(q.shape[0], -1)
            if not others:
                return out_T
            out = torch.empty(q_N_H_d.shape[0], q_N_H_d.shape[1] * q_N_H_d.shape[2], dtype=q_N_H_d.dtype, device=dev)
            out[rows_T] = out_T
            for i, o in zip(others, attend_each(layer, q_N_H_d, others, cat=False)):
                out[spans[i][0] : spans[i][0] + spans[i][1]] = o
            return out

        def attend_each(layer: int, q_N_H_d: torch.Tensor, which, cat: bool = True):
            outs = []
            for i in which:
                start, n, length = spans[i]
                pages = page_tables[i]
                k = gather_pages(self.k_cache[layer], pages, length)
                v = gather_pages(self.v_cache[layer], pages, length)
                # 4-D inputs: SDPA's fused kernels take nothing else (3-D ones run its slow math kernel).
                q = q_N_H_d[start : start + n].transpose(0, 1)[None]
                if n == length:
                    o = torch.nn.functional.scaled_dot_product_attention(
                        q, k[None], v[None], is_causal=True, scale=self.weights.scale, enable_gqa=True
                    )
                else:  # after a cached prefix: query i sees the prefix and the new tokens up to itself
                    # The masked (memory-efficient) kernel has no GQA: the KV heads are repeated for it.
                    group = q.shape[1] // k.shape[0]
                    k, v = k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None]
                    mask = (
                        torch.arange(length, device=dev)[None] <= torch.arange(length - n, length, device=dev)[:, None]
                    )
                    o = torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask, scale=self.weights.scale
                    )
                outs.append(o[0].transpose(0, 1).reshape(n, -1))
            return torch.cat(outs) if cat else outs

        last, seeds, steps = self._upload(
            np.array(
                [[start + n - 1 for start, n, _ in spans], [s.seed for s in seqs], [len(s.tokens) for s in seqs]],
                dtype=np.int64,
            )
        )
        temps = self._upload(np.array([s.request.params.temperature for s in seqs], dtype=np.float32))
        with torch.no_grad():
            hidden = self._forward(tokens_N, positions_N, slots_N, attend)
            logits = self._logits(hidden[last])
            tokens_B, logp_B = self._sample(seqs, logits, temps, seeds, steps)
            wait = self._to_host(torch.stack([tokens_B.double(), logp_B.double()]))
        self.stats["prefill_tokens"] += inputs.shape[1]
        for seq in seqs:
            seq.written = len(seq.request.prompt)
        return wait

    def _decode_run(self) -> None:
        """Decode steps over the current rows until a row ends or a waiting request can join.

        One step is always queued ahead: step t+1 is launched, its inputs advanced on the device from step t's
        samples (`_advance`), before the host reads step t's tokens, so the host's work (appending, stop tokens
        and strings, the next launch) overlaps the device's. When step t ends a row, step t+1's token for that
        row is dropped (its K/V goes to a slot inside the row's reservation and is never read); the other rows
        keep theirs. The tokens are the ones a step-by-step loop samples: the same inputs, seeds and counters.
        """
        start = time.perf_counter()
        rows = list(self.rows)
        ahead = self._launch(rows)
        while True:
            current = ahead
            ahead = None if self._admission_due() else self._launch(rows)
            if self._consume(rows, current) or ahead is None:
                break
        if ahead is not None:
            self._consume(rows, ahead)
        self.stats["decode_s"] += time.perf_counter() - start

    def _launch(self, rows: list[_Sequence]):
        """Queue one decode step and its sampling over `rows`; returns the wait for its (tokens, logprobs)."""
        n = len(rows)
        bucket = next((b for b in BUCKETS if b >= n), n) if self.cuda_graphs else n
        with torch.no_grad():
            logits_B_V = self._decode_logits(bucket)[:n]
            tokens_B, logp_B = self._sample(
                rows,
                logits_B_V,
                self.temperatures[:n],
                self.sample_inputs[0, :n],
                self.sample_inputs[1, :n],
                filtering=self._filtering_rows > 0,
            )
            self._advance(n, tokens_B)
            return self._to_host(torch.stack([tokens_B.double(), logp_B.double()]))

    def _advance(self, n: int, tokens_B: torch.Tensor) -> None:
        """The next step's inputs of the `n` live rows, on the device: feed the sampled token one position on."""
        self.ops["advance"](self.step_inputs, self.sample_inputs, self.block_tables, tokens_B[:n], self.page_tokens)

    def _consume(self, rows: list[_Sequence], wait) -> bool:
        """Append a step's tokens to the rows still going and check their stops; True if a row ended."""
        waited = time.perf_counter()
        picked, logps = wait()  # the step's one sync
        now = time.perf_counter()
        self.stats["device_wait_s"] += now - waited
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(rows)
        return self._append(rows, picked, logps, now, fed=1)

    def _admission_due(self) -> bool:
        """A waiting request could join now (rows and pages free, same weights), so decoding should pause for it.

        Counts the pages a request needs without the prefix cache (hashing its prompt every step would cost
        more): a request that fits only by sharing cached pages joins when a row ends instead.
        """
        with self._cond:
            if not self._waiting or len(self.rows) >= self.max_batch:
                return False
            seq = self._waiting[0]
        if seq.snapshot is not self.snapshot:
            return False  # other weights: it waits until the batch drains anyway
        need = -(-(len(seq.request.prompt) + seq.limit) // self.page_tokens)
        return need <= self.pool.available()

    def _decode_logits(self, bucket: int) -> torch.Tensor:
        if not self.cuda_graphs:
            return self._decode_step(bucket)
        if bucket not in self.graphs:
            self._capture(bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits

    def _capture(self, bucket: int) -> None:
        """Warm the step up eagerly on a side stream (Triton compiles, cuBLAS picks kernels), then capture it."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._decode_step(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._decode_step(bucket)
        self.graphs[bucket] = (graph, logits)
        self.stats["graph_captures"] += 1

    def _decode_step(self, bucket: int) -> torch.Tensor:
        tokens, positions, slots, lengths = self.step_inputs[:, :bucket]
        block_tables = self.block_tables[:bucket]
        lengths_i32 = lengths.to(torch.int32)
        splits = _splits(bucket * self.weights.n_kv_heads, self.max_pages_per_seq)

        def attend(layer: int, q_N_H_d: torch.Tensor) -> torch.Tensor:
            return self.ops["attention"](
                q_N_H_d, self.k_cache[layer], self.v_cache[layer], block_tables, lengths_i32, self.weights.scale, splits
            )

        return self._logits(self._forward(tokens, positions, slots, attend))

    def _forward(self, tokens_N, positions_N, slots_N, attend) -> torch.Tensor:
        """The decoder over N tokens at `positions_N`, their K/V written to `slots_N`; final-normed hidden states."""
        w, ops = self.weights, self.ops
        cos, sin = self.rope_cos[positions_N], self.rope_sin[positions_N]
        residual = w.embed[tokens_N]
        hidden, residual = ops["add_rmsnorm"](residual, None, w.layers[0]["ln1"], w.eps)
        for i, layer in enumerate(w.layers):
            qkv = torch.nn.functional.linear(hidden, layer["qkv"], layer.get("qkv_bias"))
            q = ops["qk_norm_rope_store"](
                qkv,
                cos,
                sin,
                layer.get("q_norm"),
                layer.get("k_norm"),
                w.eps,
                self.k_cache[i],
                self.v_cache[i],
                slots_N,
                w.n_q_heads,
                w.n_kv_heads,
            )
            attn = torch.nn.functional.linear(attend(i, q), layer["o"])
            hidden, residual = ops["add_rmsnorm"](attn, residual, layer["ln2"], w.eps)
            mlp = torch.nn.functional.linear(
                ops["silu_mul"](torch.nn.functional.linear(hidden, layer["gate_up"])), layer["down"]
            )
            next_norm = w.layers[i + 1]["ln1"] if i + 1 < len(w.layers) else w.final_norm
            hidden, residual = ops["add_rmsnorm"](mlp, residual, next_norm, w.eps)
        return hidden

    def _logits(self, hidden_N_D: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler reads them as fp32 (a bf16 value is exact in fp32), so no fp32 copy."""
        return torch.nn.functional.linear(hidden_N_D, self.weights.head)

    def _append_first(self, seqs: list[_Sequence], wait) -> None:
        """Append each prefilled sequence's first token (decode steps: `_launch`, `_consume`)."""
        waited = time.perf_counter()
        picked, logps = wait()
        now = time.perf_counter()
        self.stats["device_wait_s"] += now - waited
        self._append(seqs, picked, logps, now, fed=0)

    def _sample(self, seqs: list[_Sequence], logits_B_V, temps_B, seeds_B, steps_B, filtering: bool | None = None):
        """(tokens, logprobs) of one draw per row; rows with top-k/top-p draw from their filtered logits
        (`filtering`: whether any row has them, if the caller knows)."""
        filtered = None
        if filtering if filtering is not None else any(_filters(s.request.params) for s in seqs):
            filtered = torch.stack([_filtered_row(logits_B_V[b], s.request.params) for b, s in enumerate(seqs)])
        return self.ops["sample"](logits_B_V, temps_B, seeds_B, steps_B, filtered)

    def _append(self, seqs: list[_Sequence], picked: np.ndarray, logps: np.ndarray, now: float, fed: int) -> bool:
        """Each going row's new token and its stops (a token id, the length, then a stop string, which outranks
        the length; `fed`: the step wrote the previous token's K/V); True if a row has ended."""
        ended, check = False, []
        for seq, token, logprob in zip(seqs, picked.astype(np.int64).tolist(), logps.tolist()):
            if seq.done is not None:
                ended = True  # a step ahead of its end: this token is dropped
                continue
            seq.written += fed
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            if seq.first_token_s is None:
                seq.first_token_s = now
            if token in seq.stops.token_ids:
                seq.done, ended = "stop", True
                continue
            if len(seq.tokens) >= seq.limit:
                seq.done, ended = "length", True
            if token in seq.stop_ends:  # this token may complete a stop string (stop_screen.py)
                check.append(seq)
        if check:  # only these rows' tails are decoded, in one batch
            tails = [s.tokens[-s.stops.tail_tokens :] for s in check]
            for seq, hit in zip(check, self._stops.stopped(tails, [s.stops.strings for s in check])):
                if hit:
                    seq.done, ended = "stop", True
        return ended

    def _to_host(self, values: torch.Tensor):
        """Start copying `values` to the host; returns the wait that gives them as a numpy array."""
        if not values.is_cuda:
            return values.numpy
        n = values.shape[1]
        if not self._host_buffers or self._host_buffers[0].shape[1] < n:
            self._host_buffers = [
                torch.empty(values.shape[0], max(n, self.max_batch), dtype=values.dtype, pin_memory=True)
                for _ in range(2)
            ]
        self._host_buffers.reverse()  # two steps are in flight at most: each copies into its own buffer
        view = self._host_buffers[0][:, :n]
        view.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()

        def wait():
            event.synchronize()
            return view.numpy()

        return wait

    def _add_rows(self, seqs: list[_Sequence]) -> None:
        """Prefilled sequences join as the last rows; the host writes their step inputs and block tables once
        (the decode steps advance them on the device from then on)."""
        start = len(self.rows)
        self.rows.extend(seqs)
        self._filtering_rows += sum(_filters(s.request.params) for s in seqs)
        tables = np.full((len(seqs), self.max_pages_per_seq), SCRATCH_PAGE, dtype=np.int32)
        steps = np.empty((4, len(seqs)), dtype=np.int64)
        samples = np.empty((2, len(seqs)), dtype=np.int64)
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.pages)] = seq.pages
            position = len(seq.request.prompt) + len(seq.tokens) - 1  # the newest token is fed next
            steps[:, i] = (seq.tokens[-1], position, self._slot(seq, position), position + 1)
            samples[:, i] = (seq.seed, len(seq.tokens))
        end = len(self.rows)
        self._upload(tables, into=self.block_tables[start:end])
        self._upload(steps, into=self.step_inputs[:, start:end])
        self._upload(samples, into=self.sample_inputs[:, start:end])
        temps = np.array([s.request.params.temperature for s in seqs], dtype=np.float32)
        self._upload(temps, into=self.temperatures[start:end])

    def _retire(self) -> None:
        """Finish stopped rows; the last row moves into each freed place, so the live rows stay 0..n-1. Their
        device state moves with them in one gather, and the freed places become padding rows."""
        before = len(self.rows)
        origin = list(range(before))  # the device column each row's state is in
        r = 0
        while r < len(self.rows):
            seq = self.rows[r]
            if seq.done is None:
                r += 1
                continue
            last, last_origin = self.rows.pop(), origin.pop()
            if last is not seq:
                self.rows[r], origin[r] = last, last_origin
            self._filtering_rows -= _filters(seq.request.params)
            self._finish(seq)
        n = len(self.rows)
        if n == before:
            return
        if origin != list(range(n)):
            index = self._upload(np.asarray(origin, dtype=np.int64))
            for state in (self.step_inputs, self.sample_inputs):
                state[:, :n] = state[:, index]
            self.temperatures[:n] = self.temperatures[index]
            self.block_tables[:n] = self.block_tables[index]
        self.step_inputs[:, n:before] = self._padding_inputs[:, n:before]

    def _finish(self, seq: _Sequence) -> None:
        if seq.pages:
            # Register every full page whose K/V are written, so later turns and samples can share them.
            for i, digest in enumerate(page_digests(seq.context[: seq.written], self.page_tokens)):
                self.pool.register(seq.pages[i], digest)
            self.pool.release(seq.pages)
            seq.pages = []
        if seq.first_token_s is not None:
            self.first_token_s.append(seq.first_token_s - seq.submitted_s)
        seq.future.set_result(
            SampledSequence(tokens=seq.tokens, logprobs=seq.logprobs, stop_reason=seq.done or "length")
        )

    def _fail(self, err: BaseException) -> None:
        with self._cond:
            for seq in self.rows + self._waiting:
                if not seq.future.done():
                    seq.future.set_exception(err)
                self.pool.release(seq.pages)
                seq.pages = []
            self.rows, self._waiting = [], []
            self._filtering_rows = 0

    def _slot(self, seq: _Sequence, position: int) -> int:
        return seq.pages[position // self.page_tokens] * self.page_tokens + position % self.page_tokens


def sequence_limit(config, max_seq_tokens: int = 0) -> int:
    """The longest sequence a batcher takes: `max_seq_tokens`, else the model's context up to 32k tokens."""
    return max_seq_tokens or min(getattr(config, "max_position_embeddings", None) or 4096, 32768)


def _splits(programs: int, max_pages: int) -> int:
    """Split-K factor for the attention kernel: ~8 programs per SM of an H100/H200 (132 SMs), so that page loads
    overlap (one program walks its pages one after another); rounded, as measured best at 16, 64 and 256 rows
    (scripts/tune_paged_attention.py: 8, 2 and 1 splits)."""
    return max(1, min(16, round(1056 / programs), max_pages))


def _filters(params) -> bool:
    return params.temperature > 0 and ((0 < params.top_k) or params.top_p < 1)


def _filtered_row(logits_V: torch.Tensor, params) -> torch.Tensor:
    logits_V = logits_V.float()
    if not _filters(params):
        return logits_V
    # filter_logits works on tempered logits; undo the temperature so the kernel's division gives them back.
    return filter_logits(logits_V[None] / params.temperature, params.top_k, params.top_p)[0] * params.temperature


def _rope_tables(lm, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] in fp32 from the model's own rotary module (its scaling included)."""
    rotary = lm.get_decoder().rotary_emb
    probe = torch.zeros(1, 1, 1, dtype=torch.float32, device=device)
    with torch.no_grad():
        cos, sin = rotary(probe, torch.arange(length, device=device)[None])
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def _varlen_attention():
    """Causal attention over packed sequences through torch's flash varlen kernel, or None where torch has none.

    `attend(q_T_H_d, k_T_K_d, v_T_K_d, cu_seq, longest, scale) -> [T, H, d]`. The function's keywords changed
    across torch releases (`is_causal` in 2.10; `window_size`, `scale`, `enable_gqa` later): read them from its
    signature, and do by hand what a release lacks (scale the queries, repeat the KV heads).
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    import inspect

    keywords = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True}

    def attend(q, k, v, cu_seq, longest: int, scale: float):
        extra = dict(causal)
        if "scale" in keywords:
            extra["scale"] = scale
        else:  # its scale is 1/sqrt(d)
            q = q * (scale * q.shape[-1] ** 0.5)
        if "enable_gqa" in keywords:
            extra["enable_gqa"] = True
        elif k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return varlen_attn(q, k, v, cu_seq, cu_seq, longest, longest, **extra)

    return attend
