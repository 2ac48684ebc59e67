"""Benchmark the local training backend: SFT and sampling throughput, and the chunked log-softmax's memory.

    .venv/bin/python scripts/bench_backend.py --quick            # a random Llama (d=128, 4 layers, V=1000)
    .venv/bin/python scripts/bench_backend.py --model DIR        # any causal LM directory (with its tokenizer)

Figures, not a pass/fail test. Peak memory is the process's peak RSS on CPU
(it only grows: each figure is the peak up to that point) and
`torch.cuda.max_memory_allocated` on GPU. The log-softmax comparison runs
each variant in its own subprocess and reports its peak above the memory
held before the call (inputs included in neither), for a frozen LM head
(LoRA) and a trainable one (full fine-tuning).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="a model directory; default: a random Llama built here")
    p.add_argument("--quick", action="store_true", help="fewer steps and a shorter log-softmax sequence")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    p.add_argument("--lora-rank", type=int, default=8, help="0 = full fine-tuning")
    p.add_argument("--batch", type=int, default=8, help="SFT datums per step")
    p.add_argument("--seq-tokens", type=int, default=256, help="SFT tokens per datum")
    p.add_argument("--samples", type=int, default=8, help="sequences per sampling call")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per sampled sequence")
    p.add_argument("--vocab", type=int, default=200_000, help="log-softmax benchmark vocabulary")
    p.add_argument("--hidden", type=int, default=256, help="log-softmax benchmark hidden size")
    p.add_argument(
        "--positions",
        type=int,
        default=0,
        help="log-softmax benchmark positions; 0 = 2048 (1024 with --quick) on CPU, 16384 on GPU",
    )
    p.add_argument("--logprob-child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    p.add_argument("--trainable-head", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    if args.logprob_child:
        print(json.dumps(_logprob_child(args, device)))
        return
    print(f"device {device}, {torch.get_num_threads()} CPU threads, torch {torch.__version__}")
    _bench_backend(args, device)
    _bench_logprobs(args, device)


def _build_model(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model), args.model
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=448,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config), None, "random Llama d=128 L=4 V=1000"  # no tokenizer: only stop strings need one


def _bench_backend(args, device) -> None:
    from tinker import types

    from tbexp.backends.local import LocalBackend

    model, tokenizer, name = _build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    with tempfile.TemporaryDirectory() as save_dir:
        b = LocalBackend(
            model,
            tokenizer,
            lora_rank=args.lora_rank,
            lora_alpha=2.0 * max(args.lora_rank, 1),
            lora_dropout=0.0,
            lora_targets=TARGETS,
            device=str(device),
            save_dir=save_dir,
        )
        n_train = sum(p.numel() for p in b._params.values())
        print(
            f"\nmodel: {name}: {n_params / 1e6:.2f}M parameters, {n_train / 1e6:.3f}M trainable ({'LoRA r=%d' % args.lora_rank if args.lora_rank else 'full'})"
        )

        g = torch.Generator().manual_seed(0)
        steps = 3 if args.quick else 10
        data = []
        for _ in range(args.batch):
            toks = torch.randint(0, vocab, (args.seq_tokens + 1,), generator=g).tolist()
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(toks[:-1]),
                    loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * args.seq_tokens},
                )
            )
        _reset_peak(device)
        b.forward_backward(data, "cross_entropy").result()  # warm-up
        b.optim_step(types.AdamParams()).result()
        start = time.perf_counter()
        for _ in range(steps):
            b.forward_backward(data, "cross_entropy").result()
            b.optim_step(types.AdamParams()).result()
        _sync(device)
        elapsed = time.perf_counter() - start
        tokens = steps * args.batch * args.seq_tokens
        print(
            f"SFT       {tokens / elapsed:10.0f} tokens/s   ({steps} steps of {args.batch}×{args.seq_tokens} tokens, {elapsed / steps:.2f} s/step)   peak {_peak(device)}"
        )

        sampler = b.sampler()
        prompt = types.ModelInput.from_ints(torch.randint(0, vocab, (64,), generator=g).tolist())
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0, stop=[])
        _reset_peak(device)
        sampler.sample(prompt, args.samples, params).result()  # warm-up
        calls = 1 if args.quick else 3
        start = time.perf_counter()
        n = sum(len(s.tokens) for _ in range(calls) for s in sampler.sample(prompt, args.samples, params).result())
        _sync(device)
        elapsed = time.perf_counter() - start
        print(
            f"sampling  {n / elapsed:10.0f} tokens/s   ({calls} call(s) × {args.samples} sequences × {args.max_tokens} tokens after a 64-token prompt)   peak {_peak(device)}"
        )
        _bench_batched_sampling(sampler, vocab, args, g)


def _bench_batched_sampling(sampler, vocab: int, args, g) -> None:
    """The episodes' path: one reply each to different prompts in one batch, through transformers' forward and
    through LlamaSteps where the model is one it takes (the same tokens either way)."""
    from tinker import types

    from tbexp.backends.batch_sampling import Request
    from tbexp.backends.llama_steps import transformers_only

    lengths = torch.randint(200, 400, (args.samples,), generator=g).tolist()  # an episode's prompt after a turn or two
    requests = [
        Request(
            torch.randint(0, vocab, (n,), generator=g).tolist(),
            types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, stop=[]),
        )
        for i, n in enumerate(lengths)
    ]
    figures = {}
    for name in ("transformers", "LlamaSteps"):
        with transformers_only() if name == "transformers" else contextlib.nullcontext():
            sampler.sample_batch(requests)  # warm-up
            start = time.perf_counter()
            drawn = sampler.sample_batch(requests)
            figures[name] = (time.perf_counter() - start, [s.tokens for s in drawn])
    n = sum(len(tokens) for tokens in figures["transformers"][1])
    same = figures["transformers"][1] == figures["LlamaSteps"][1]
    print(
        f"batched   {n / figures['transformers'][0]:10.0f} tokens/s through transformers, "
        f"{n / figures['LlamaSteps'][0]:.0f} through LlamaSteps ({figures['transformers'][0] / figures['LlamaSteps'][0]:.2f}x; "
        f"{args.samples} prompts of 200-400 tokens, {args.max_tokens} tokens each; same tokens: {same})"
    )


def _bench_logprobs(args, device) -> None:
    positions = args.positions or (16384 if device.type == "cuda" else 1024 if args.quick else 2048)
    print(f"\nlog-softmax of {positions} positions, V={args.vocab}, D={args.hidden}, fp32, forward + backward")
    print(f"(full [T, V] fp32 logits alone: {positions * args.vocab * 4 / 2**20:.0f} MiB)")
    for trainable in (False, True):
        figures = {}
        for variant in ("naive", "chunked"):
            cmd = [
                sys.executable,
                __file__,
                "--logprob-child",
                variant,
                "--vocab",
                str(args.vocab),
                "--hidden",
                str(args.hidden),
                "--positions",
                str(positions),
                "--device",
                str(device),
            ]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            if trainable:
                cmd.append("--trainable-head")
            figures[variant] = json.loads(
                subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            )
        naive, chunked = figures["naive"], figures["chunked"]
        head = "trainable head (full FT)" if trainable else "frozen head (LoRA)     "
        print(
            f"{head}  naive {naive['peak_mib']:8.0f} MiB {naive['time_s']:6.2f} s   chunked {chunked['peak_mib']:6.0f} MiB {chunked['time_s']:6.2f} s   memory ratio {naive['peak_mib'] / max(chunked['peak_mib'], 1e-9):5.1f}×   |Δ mean logp| {abs(naive['logp_sum'] - chunked['logp_sum']) / positions:.1e}"
        )


def _logprob_child(args, device) -> dict:
    from tbexp.backends.logprobs import naive_target_logprobs, target_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.positions, args.hidden, generator=g).div_(args.hidden**0.5).to(device).requires_grad_()
    weight = torch.randn(args.vocab, args.hidden, generator=g).to(device).requires_grad_(args.trainable_head)
    targets = torch.randint(0, args.vocab, (args.positions,), generator=g).to(device)
    fn = naive_target_logprobs if args.logprob_child == "naive" else target_logprobs
    _sync(device)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else _rss_bytes()
    _reset_peak(device)
    start = time.perf_counter()
    logp = fn(hidden, weight, targets)
    logp.sum().backward()
    _sync(device)
    elapsed = time.perf_counter() - start
    peak = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {"peak_mib": (peak - base) / 2**20, "time_s": elapsed, "logp_sum": float(logp.detach().double().sum())}


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak(device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB GPU (max allocated)"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB RSS (process so far)"


if __name__ == "__main__":
    main()
