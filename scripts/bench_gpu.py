"""GPU benchmark of the local backend (issues 6, 20, 43): LoRA SFT against TRL, sampling, continuous batching,
loss memory, the memory plan and the host's share of a decode step.

    python scripts/bench_gpu.py                     # on one GPU: Qwen3-1.7B shape, random weights, 4 × 4096 tokens
    python scripts/bench_gpu.py --shape qwen3-8b    # the Qwen3-8B shape
    python scripts/bench_gpu.py --shape tiny        # a tiny shape on CPU (also --tiny), to check the script itself
    python scripts/bench_gpu.py --only sft-trl      # one measurement (any of MEASUREMENTS; --only issue43: ROWS_43)
    python scripts/bench_gpu.py --shape qwen3-8b --device cpu --only memory-plan --card-gib 79.6   # no GPU needed

Every row names the card it ran on (`card`) and the shape (`shape`): compare figures only within one run.

Every measurement runs in a subprocess of its own, so each peak-memory figure
is that run's alone (`torch.cuda.max_memory_allocated`, everything the run
allocated: weights, optimizer state, activations) and a crash or an
out-of-memory costs one row. Each child prints one JSON line; the parent
prints them and a table last. Nothing is downloaded: models are built from
their configs with random weights (fine for speed and memory); TRL gets a
word-level tokenizer with the model's vocabulary size.

SFT: LoRA r32 (alpha 64, no dropout) on every linear layer of the decoder,
bf16, SDPA, batch 4 × 4096 tokens, loss on every token, AdamW. tbexp runs
`LocalBackend(dtype="bfloat16")` with the knobs each variant names; TRL runs
`SFTTrainer` (bf16=True, its fused AdamW, no packing, logging once) on the
same bf16 model. Timed steps follow warm-up steps (torch.compile's compile
happens there). MFU counts the FLOPs LoRA training needs: 2·N forward and
2·N for input gradients through the frozen linear weights (N includes the LM
head), 6·N_lora, and causal attention forward + backward (3 × 2·S·d·L per
token); recomputation (checkpointing, the chunked head) is not counted. It is
reported against the H200's datasheet dense bf16 peak, 989 TFLOP/s, and
against an 8192³ bf16 matmul measured in the same run.

Continuous batching (`cb-*`, docs/gpu-sampling.md): N concurrent requests with
distinct prompts of `cb_prompt` tokens, `cb_new` new tokens each (temperature
0.7, a stop string checked every step), submitted at once to a
`continuous_batching=True` backend after a short warm-up run that captures the
bucket's CUDA graph. tokens/s counts new tokens over the whole call (prefill
included); decode tokens/s leaves out the time to the last first token. The
bound is one decode step reading the decode weights and the batch's KV cache at
its mean context once, at 4.8 TB/s (datasheet) and at the copy bandwidth
measured in the `env` row. `grpo-step-*`: one GRPO step end to end (sample
`grpo_groups` × `grpo_group_size` replies, an importance-sampling
forward_backward over them, optim_step), sampling with the CUDA-graph sampler
one group at a time (before) or all at once through continuous batching (after).
`cb-*-profile`: where a decode step's device time goes (kernel time per kind,
the matmuls and the attention alone); `cb-64-lora-unmerged`: the step's linear
layers with the LoRA deltas merged (as the batcher runs them) against unmerged,
and the cost of a merge.

Issue 43 (`--only issue43`): the backends run with their defaults (memory plan
within `gpu_memory_fraction=0.85`, checkpointing where the plan needs it, the
KV pool the plan leaves); each row adds the plan's figures (planned peak,
pool, checkpointing) beside the measured peak. `memory-plan`: the plan of the
GRPO step for this shape on this card (or `--card-gib` on a CPU).
`train-memory`: a training pass's peak per token of context, checkpointing off
and on (on a CPU: the bytes autograd saves, no allocator to ask), against the
plan's. `cb-256-host`: a decode step's host work at 256 rows (step inputs,
sampler launch, stop checks, scheduling): the thread's CPU time less the
forward's and the sampler's, which on a CPU compute and on a GPU launch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEAK_TFLOPS = 989.0  # H200 SXM dense bf16, datasheet
# name -> (kind, options). tbexp SFT variants name LocalBackend knobs.
FAST = {"compile_backend": "inductor", "logprob_chunk_tokens": 4096, "sdpa_backend": "cudnn_attention"}
MEASUREMENTS = {
    "env": ("env", {}),
    "attention": ("attention", {}),
    "sft-trl": ("sft_trl", {}),
    "sft-tbexp-eager": ("sft_tbexp", {}),
    "sft-tbexp-compiled": ("sft_tbexp", {"compile_backend": "inductor"}),
    "sft-tbexp-compiled-chunk4096": ("sft_tbexp", {"compile_backend": "inductor", "logprob_chunk_tokens": 4096}),
    "sft-tbexp-fast": ("sft_tbexp", FAST),
    "sample-tbexp": ("sample_tbexp", {}),
    "sample-tbexp-graph": ("sample_tbexp", {"cuda_graph_sampling": True}),
    "sample-generate": ("sample_generate", {}),
    "loss-naive": ("loss", {"variant": "naive"}),
    "loss-chunked": ("loss", {"variant": "chunked"}),
    "loss-chunked-fused": ("loss", {"variant": "chunked", "chunk_size": 4096, "compile_backend": "inductor"}),
    "varlen-padded": ("varlen", {}),
    "varlen-packed": ("varlen", {"packing": True}),
    "varlen-packed-fast": ("varlen", {"packing": True, **FAST}),
    "kernels-check": ("kernels_check", {}),
    "cb-16": ("sample_continuous", {"concurrent": 16}),
    "cb-64": ("sample_continuous", {"concurrent": 64}),
    "cb-256": ("sample_continuous", {"concurrent": 256}),
    "grpo-step-before": ("grpo_step", {"continuous": False}),
    "grpo-step-after": ("grpo_step", {"continuous": True}),
    "cb-64-nostop": ("sample_continuous", {"concurrent": 64, "stop": False}),
    "cb-64-page16": ("sample_continuous", {"concurrent": 64, "page_tokens": 16}),
    "cb-64-page64": ("sample_continuous", {"concurrent": 64, "page_tokens": 64}),
    "cb-64-torch-kernels": ("sample_continuous", {"concurrent": 64, "kernels": "torch"}),
    "cb-64-prefill64k": ("sample_continuous", {"concurrent": 64, "prefill_tokens": 65536}),
    "cb-16-profile": ("decode_profile", {"concurrent": 16}),
    "cb-64-profile": ("decode_profile", {"concurrent": 64}),
    "cb-256-profile": ("decode_profile", {"concurrent": 256}),
    "cb-64-lora-unmerged": ("lora_unmerged", {"concurrent": 64}),
    "sft-trl-ckpt": ("sft_trl", {"gradient_checkpointing": True}),
    "sft-tbexp-fast-ckpt": ("sft_tbexp", {**FAST, "gradient_checkpointing": True}),
    "grpo-step-after-nockpt": ("grpo_step", {"continuous": True, "gradient_checkpointing": False}),
    "memory-plan": ("memory_plan", {}),
    "train-memory": ("train_memory", {}),
    "cb-256-host": ("host_work", {"concurrent": 256}),
}
# The rows issue 43 asks for, in one run on one card: `--only issue43`.
ROWS_43 = "env,memory-plan,train-memory,sft-tbexp-eager,grpo-step-after,cb-16,cb-64,cb-256,cb-256-host"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: checks the script, measures nothing")
    p.add_argument(
        "--shape", default="", choices=sorted(SHAPES), help="model shape (default qwen3-1.7b; tiny = --tiny)"
    )
    p.add_argument("--device", default="", help="cuda or cpu (default: cuda, or cpu for the tiny shape)")
    p.add_argument("--card-gib", type=float, default=0.0, help="memory-plan on a CPU: the card's GiB to plan for")
    p.add_argument("--only", default="", help="comma-separated measurement names, or issue43; default: all")
    p.add_argument("--skip", default="", help="comma-separated measurement names to leave out")
    p.add_argument("--steps", type=int, default=0, help="timed SFT steps (default 8; 2 with --tiny)")
    p.add_argument("--out", default="", help="also append every JSON line to this file")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape_name = args.shape or ("tiny" if args.tiny else "qwen3-1.7b")
    shape = SHAPES[shape_name]()
    shape["name"] = shape_name
    shape["device"] = args.device or shape["device"]
    shape["card_gib"] = args.card_gib
    if args.steps:
        shape["steps"] = args.steps
    if args.child:
        kind, options = MEASUREMENTS[args.child]
        if shape["device"] == "cpu":  # CPU stand-ins: inductor compiles slowly on CPU, and CPUs have no cuDNN
            options = {
                k: {"inductor": "aot_eager", "cudnn_attention": "math"}.get(v, v) if isinstance(v, str) else v
                for k, v in options.items()
            }
        figures = globals()[f"_{kind}"](shape, **options)
        result = {"name": args.child, "shape": shape_name, "card": _card(shape), **figures}
        print("RESULT " + json.dumps(result), flush=True)
        return
    only = args.only.replace("issue43", ROWS_43)
    names = [n for n in (only.split(",") if only else MEASUREMENTS) if n and n not in args.skip.split(",")]
    results = []
    for name in names:
        cmd = (
            [sys.executable, __file__, "--child", name, "--shape", shape_name]
            + (["--device", args.device] if args.device else [])
            + (["--card-gib", str(args.card_gib)] if args.card_gib else [])
            + (["--steps", str(args.steps)] if args.steps else [])
        )
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        result = (
            json.loads(lines[-1])
            if lines
            else {
                "name": name,
                "shape": shape_name,
                "card": _card(shape) if shape["device"] == "cpu" else "see the env row",
                "error": (proc.stderr or proc.stdout).strip().splitlines()[-6:],
            }
        )
        result["wall_s"] = round(time.perf_counter() - start, 1)
        if proc.returncode and "error" not in result:
            result["error"] = f"exit {proc.returncode}"
        results.append(result)
        if "copy_tb_per_s" in result:  # the decode bound of the cb-* rows at the bandwidth measured here
            os.environ["BENCH_COPY_TB_PER_S"] = str(result["copy_tb_per_s"])
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    _table(results)


def full_shape() -> dict:
    """Qwen3-1.7B's dimensions (tied embeddings)."""
    return {
        "device": "cuda",
        "batch": 4,
        "seq": 4096,
        "steps": 8,
        "warmup": 3,
        "model": dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        "samples": 16,
        "new_tokens": 512,
        "prompt": 256,
        "loss_positions": 32768,
        "loss_vocab": 201088,
        "loss_hidden": 2880,  # gpt-oss-20b's vocabulary and width
        "varlen_lengths": [4096, 3500, 3000, 2600, 2200, 1800, 1500, 1200, 1000, 800, 600, 500, 400, 300, 200, 100],
        "cb_prompt": 1024,
        "cb_new": 512,
        "host_new": 512,  # cb-256-host: replies of 64 to 512 tokens
        "grpo_groups": 4,
        "grpo_group_size": 16,
    }


def qwen3_8b_shape() -> dict:
    """Qwen3-8B's dimensions (untied embeddings); the rest as for Qwen3-1.7B."""
    shape = full_shape()
    shape["model"] = {
        **shape["model"],
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "tie_word_embeddings": False,
    }
    return shape


def tiny_shape() -> dict:
    return {
        "device": "cpu",
        "batch": 4,
        "seq": 64,
        "steps": 2,
        "warmup": 1,
        "model": dict(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        ),
        "samples": 4,
        "new_tokens": 16,
        "prompt": 8,
        "loss_positions": 512,
        "loss_vocab": 5000,
        "loss_hidden": 64,
        "varlen_lengths": [64, 50, 30, 10],
        "cb_prompt": 24,
        "cb_new": 8,
        "host_new": 64,
        "grpo_groups": 2,
        "grpo_group_size": 3,
    }


SHAPES = {"qwen3-1.7b": full_shape, "qwen3-8b": qwen3_8b_shape, "tiny": tiny_shape}


# ---- building blocks ----


def _card(shape: dict) -> str:
    """The device a row ran on, by name."""
    if shape["device"] == "cuda":
        props = torch.cuda.get_device_properties()
        return f"{props.name} ({props.total_memory / 2**30:.1f} GiB)"
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "?")
    return f"CPU: {model} ({os.cpu_count()} cores)"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _model(shape: dict):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**shape["model"], attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(shape["device"]):  # initialised in bf16: no fp32 copy of an 8B model on the card
        return Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)


def _plan_figures(b) -> dict:
    """The backend's memory plan beside a row's measured peak (none on a CPU)."""
    plan = b.memory_plan
    figures = {"gradient_checkpointing": b.gradient_checkpointing}
    if plan is not None:
        figures |= {
            "planned_peak_gib": round(plan.peak_bytes / 2**30, 2),
            "planned_kv_tokens": plan.kv_tokens,
            "budget_gib": round(plan.budget_bytes / 2**30, 2),
        }
    return figures


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1")


def _backend(shape: dict, model, **knobs):
    from tbexp.backends.local import LocalBackend

    # The longest sequence any row feeds: the memory plan takes a datum that long as a training pass of its own.
    longest = max(shape["seq"], shape["cb_prompt"] + shape["host_new"], max(shape["varlen_lengths"]))
    knobs = {
        "dtype": "bfloat16",
        "microbatch_tokens": shape["batch"] * shape["seq"],
        "max_sequence_tokens": longest,
        **knobs,
    }
    return LocalBackend(
        model,
        _tokenizer(model.config.vocab_size),
        lora_rank=32,
        lora_alpha=64.0,
        lora_dropout=0.0,
        lora_targets=TARGETS,
        device=shape["device"],
        save_dir=tempfile.mkdtemp(),
        **knobs,
    )


def _sft_data(shape: dict, n: int, lengths: list[int] | None = None):
    from tinker import types

    g = torch.Generator().manual_seed(0)
    lengths = lengths or [shape["seq"]] * n
    data = []
    for length in lengths:
        toks = torch.randint(0, shape["model"]["vocab_size"], (length + 1,), generator=g).tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * length},
            )
        )
    return data


def _sync(shape: dict) -> None:
    if shape["device"] == "cuda":
        torch.cuda.synchronize()


def _peak_gib(shape: dict) -> float:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if shape["device"] == "cuda" else 0.0


def _flops_per_token(model, seq: int) -> float:
    """Model FLOPs of one LoRA training token (see the module docstring)."""
    frozen = sum(
        m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n
    )
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    c = model.config
    attention = 3 * 2 * seq * c.num_attention_heads * c.head_dim * c.num_hidden_layers  # causal: half of 4·S·d
    return 4 * frozen + 6 * lora + attention


def _sft_figures(shape: dict, model, elapsed_s: float, steps: int, tokens_per_step: int, seq: int) -> dict:
    tokens_per_s = steps * tokens_per_step / elapsed_s
    flops = _flops_per_token(model, seq)
    return {
        "tokens_per_s": round(tokens_per_s),
        "s_per_step": round(elapsed_s / steps, 4),
        "peak_gib": _peak_gib(shape),
        "model_tflop_per_token": round(flops / 1e12, 6),
        "model_tflops": round(tokens_per_s * flops / 1e12, 1),
        "mfu_vs_989": round(tokens_per_s * flops / 1e12 / PEAK_TFLOPS, 3),
    }


# ---- measurements ----


def _env(shape: dict) -> dict:
    import peft
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "python": sys.version.split()[0],
    }
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError as e:
        info["trl"] = f"missing: {e}"
    info["varlen_attn"] = _has("torch.nn.attention.varlen")
    info["flex_attention"] = _has("torch.nn.attention.flex_attention")
    if shape["device"] == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cudnn"] = torch.backends.cudnn.version()
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        info["matmul_bf16_tflops"] = round(20 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12, 1)
        src = torch.empty(2**31, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            dst.copy_(src)
        torch.cuda.synchronize()
        info["copy_tb_per_s"] = round(
            20 * 2 * src.numel() / (time.perf_counter() - start) / 1e12, 2
        )  # bytes read + written
    return info


def _has(module: str) -> bool:
    import importlib

    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def _attention(shape: dict) -> dict:
    """SDPA forward + backward at one layer's shape, per backend (GQA expanded where a backend lacks it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    c = shape["model"]
    dev, dt = shape["device"], torch.bfloat16
    q = torch.randn(
        shape["batch"], c["num_attention_heads"], shape["seq"], c["head_dim"], device=dev, dtype=dt, requires_grad=True
    )
    k = torch.randn(
        shape["batch"], c["num_key_value_heads"], shape["seq"], c["head_dim"], device=dev, dtype=dt, requires_grad=True
    )
    v = torch.randn_like(k, requires_grad=True)
    rep = c["num_attention_heads"] // c["num_key_value_heads"]
    out = {}
    for name, backend in [
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ]:
        for gqa in (True, False):

            def run():
                kk, vv = (k, v) if gqa else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
                with sdpa_kernel(backend):
                    o = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
                o.sum().backward()

            try:
                for _ in range(2):
                    run()
                _sync(shape)
                start = time.perf_counter()
                for _ in range(5):
                    run()
                _sync(shape)
                out[f"{name}{'_gqa' if gqa else ''}_ms"] = round((time.perf_counter() - start) / 5 * 1e3, 3)
            except RuntimeError as e:
                out[f"{name}{'_gqa' if gqa else ''}_ms"] = f"n/a: {str(e).splitlines()[0][:80]}"
    return out


def _sft_tbexp(shape: dict, **knobs) -> dict:
    from tinker import types

    model = _model(shape)
    b = _backend(shape, model, **knobs)
    data = _sft_data(shape, shape["batch"])
    adam = types.AdamParams(learning_rate=2e-5)
    if shape["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    losses = []
    for _ in range(shape["warmup"]):
        losses.append(b.forward_backward(data, "cross_entropy").result().loss)
        b.optim_step(adam).result()
    warmup_s = time.perf_counter() - start
    _sync(shape)
    start = time.perf_counter()
    for _ in range(shape["steps"]):
        losses.append(b.forward_backward(data, "cross_entropy").result().loss)
        b.optim_step(adam).result()
    _sync(shape)
    elapsed = time.perf_counter() - start
    tokens = shape["batch"] * shape["seq"]
    return {
        **_sft_figures(shape, b.model, elapsed, shape["steps"], tokens, shape["seq"]),
        **_plan_figures(b),
        "warmup_s": round(warmup_s, 1),
        "knobs": knobs,
        "trainable_params": sum(p.numel() for p in b._params.values()),
        "mean_loss_per_token_first_last": [round(losses[0] / tokens, 4), round(losses[-1] / tokens, 4)],
    }


def _sft_trl(shape: dict, gradient_checkpointing: bool = False) -> dict:
    import pyarrow as pa
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    model = _model(shape)
    tokenizer = _tokenizer(model.config.vocab_size)
    warmup, steps = shape["warmup"], shape["steps"]
    g = torch.Generator().manual_seed(0)
    rows = [
        torch.randint(2, shape["model"]["vocab_size"], (shape["seq"],), generator=g).tolist()
        for _ in range(shape["batch"] * (warmup + steps))
    ]
    # A given fingerprint and no preparation: datasets' hashing pickles pyarrow types, which some pyarrow builds refuse.
    dataset = Dataset(pa.table({"input_ids": rows}), fingerprint="bench-gpu")
    marks: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (warmup, warmup + steps):
                _sync(shape)
                marks[state.global_step] = time.perf_counter()
            if state.global_step == warmup and shape["device"] == "cuda":
                marks["peak_warmup"] = _peak_gib(shape)

    cpu = shape["device"] == "cpu"
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=shape["batch"],
        gradient_accumulation_steps=1,
        max_steps=warmup + steps,
        learning_rate=2e-5,
        bf16=True,
        use_cpu=cpu,
        max_length=shape["seq"],
        packing=False,
        gradient_checkpointing=gradient_checkpointing,
        logging_steps=warmup + steps,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        seed=0,
        dataset_kwargs={"skip_prepare_dataset": True},
    )
    peft_config = LoraConfig(
        r=32, lora_alpha=64, lora_dropout=0.0, target_modules="all-linear", bias="none", task_type="CAUSAL_LM"
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[Clock()],
    )
    if shape["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    elapsed = marks[warmup + steps] - marks[warmup]
    figures = _sft_figures(shape, trainer.model, elapsed, steps, shape["batch"] * shape["seq"], shape["seq"])
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {
        **figures,
        "trainable_params": trainable,
        "gradient_checkpointing": gradient_checkpointing,
        "lora_dtype": str(next(p.dtype for p in trainer.model.parameters() if p.requires_grad)),
    }


def _sample_params(shape: dict, stop):
    from tinker import types

    return types.SamplingParams(max_tokens=shape["new_tokens"], temperature=0.7, top_p=1.0, seed=0, stop=stop)


def _prompt(shape: dict) -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, shape["model"]["vocab_size"], (shape["prompt"],), generator=g).tolist()


def _sample_tbexp(shape: dict, **knobs) -> dict:
    from tinker import types

    b = _backend(shape, _model(shape), **knobs)
    sampler = b.sampler()
    prompt = types.ModelInput.from_ints(_prompt(shape))
    # A stop string, as an agent's episodes use: decoded and checked every step (random weights never produce it).
    params = _sample_params(shape, ["</cmd>"])
    sampler.sample(prompt, shape["samples"], params.model_copy(update={"max_tokens": 16})).result()  # warm-up
    if shape["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(shape)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:  # the graph path warns when it falls back to eager
        warnings.simplefilter("always")
        seqs = sampler.sample(prompt, shape["samples"], params).result()
    elapsed = time.perf_counter() - start
    knobs = {**knobs, "warnings": [str(w.message)[:200] for w in caught if "static decode" in str(w.message)]}
    n = sum(len(s.tokens) for s in seqs)
    # The sampler's logprobs against one teacher-forced pass over what it sampled: a stale cache or position would show.
    forced = sampler.compute_logprobs(types.ModelInput.from_ints(prompt.to_ints() + seqs[-1].tokens)).result()[
        prompt.length :
    ]
    diff = torch.tensor(forced) - torch.tensor(seqs[-1].logprobs)
    check = {
        "logprob_vs_teacher_forced_max_abs": round(float(diff.abs().max()), 4),
        "mean_abs": round(float(diff.abs().mean()), 4),
    }
    return {
        "tokens_per_s": round(n / elapsed, 1),
        "new_tokens": n,
        "s": round(elapsed, 2),
        "ms_per_step": round(elapsed / shape["new_tokens"] * 1e3, 2),
        "peak_gib": _peak_gib(shape),
        "knobs": knobs,
        **check,
    }


def _sample_generate(shape: dict) -> dict:
    """Plain `generate` on the same bf16 model with peft's LoRA (its own fp32 adapter weights), no autocast."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _model(shape), LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    ).eval()
    ids = torch.tensor([_prompt(shape)], device=shape["device"])
    kw = dict(
        do_sample=True, temperature=0.7, top_p=1.0, top_k=0, num_return_sequences=shape["samples"], pad_token_id=0
    )
    with torch.no_grad():
        model.generate(ids, max_new_tokens=16, **kw)  # warm-up
        if shape["device"] == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _sync(shape)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=shape["new_tokens"], min_new_tokens=shape["new_tokens"], **kw)
        _sync(shape)
    elapsed = time.perf_counter() - start
    n = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {
        "tokens_per_s": round(n / elapsed, 1),
        "new_tokens": n,
        "s": round(elapsed, 2),
        "ms_per_step": round(elapsed / shape["new_tokens"] * 1e3, 2),
        "peak_gib": _peak_gib(shape),
    }


def _loss(shape: dict, variant: str, chunk_size: int | None = None, compile_backend: str | None = None) -> dict:
    """Target logprobs + backward to the hidden states at a frozen bf16 head (LoRA), naive full logits or chunked."""
    from tbexp.backends.logprobs import naive_target_logprobs, target_logprobs

    n, v, d = shape["loss_positions"], shape["loss_vocab"], shape["loss_hidden"]
    dev = shape["device"]
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = (torch.randn(n, d, device=dev, generator=g) / d**0.5).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(v, d, device=dev, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device=dev, generator=g)
    fn = (
        naive_target_logprobs
        if variant == "naive"
        else functools.partial(target_logprobs, chunk_size=chunk_size, compile_backend=compile_backend)
    )
    if compile_backend:  # compile outside the measurement
        target_logprobs(
            hidden[:4096], weight, targets[:4096], chunk_size=chunk_size, compile_backend=compile_backend
        ).sum().backward()
        target_logprobs(
            hidden[:4095], weight, targets[:4095], chunk_size=chunk_size, compile_backend=compile_backend
        ).sum().backward()
        hidden.grad = None
    _sync(shape)
    base = torch.cuda.memory_allocated() if dev == "cuda" else 0
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        logp = fn(hidden, weight, targets)
        logp.sum().backward()
        _sync(shape)
    except torch.OutOfMemoryError as e:
        return {"variant": variant, "oom": str(e).splitlines()[0][:160]}
    elapsed = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev == "cuda" else 0.0
    return {
        "variant": variant,
        "chunk_size": chunk_size,
        "compile_backend": compile_backend,
        "peak_above_inputs_gib": round(peak, 2),
        "s": round(elapsed, 3),
        "full_fp32_logits_gib": round(n * v * 4 / 2**30, 1),
        "mean_logp": float(logp.detach().double().mean()),
    }


def _varlen(shape: dict, packing: bool = False, **knobs) -> dict:
    """RL-like episodes of mixed lengths, one forward_backward a step: bucketed padding against packing."""
    from tinker import types

    b = _backend(
        shape, _model(shape), packing=packing, microbatch_tokens=16384 if shape["device"] == "cuda" else 128, **knobs
    )
    lengths = shape["varlen_lengths"]
    data = _sft_data(shape, len(lengths), lengths)
    adam = types.AdamParams(learning_rate=2e-5)
    # Before any update (LoRA B = 0): the same function under both layouts, so these must agree to bf16 rounding.
    check = [
        round(sum(lp) / len(lp), 4)
        for lp in b.forward(data[:: max(1, len(data) // 4)], "cross_entropy").result().logprobs
    ]
    for _ in range(2):
        b.forward_backward(data, "cross_entropy").result()
        b.optim_step(adam).result()
    if shape["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(shape)
    steps = max(2, shape["steps"] // 2)
    start = time.perf_counter()
    for _ in range(steps):
        b.forward_backward(data, "cross_entropy").result()
        b.optim_step(adam).result()
    _sync(shape)
    elapsed = time.perf_counter() - start
    return {
        "real_tokens_per_s": round(steps * sum(lengths) / elapsed),
        "s_per_step": round(elapsed / steps, 4),
        "peak_gib": _peak_gib(shape),
        "packing": packing,
        "padding_fraction": round(1 - sum(lengths) / _padded_tokens(lengths, b.microbatch_tokens), 3),
        "mean_logp_check": check,
    }


def _padded_tokens(lengths: list[int], budget: int) -> int:
    from tbexp.backends.local import _microbatches

    batches = _microbatches([{"tokens": range(n)} for n in lengths], budget)
    return sum(len(batch) * lengths[batch[0]] for batch in batches)


def _kernels_check(shape: dict) -> dict:
    """scripts/check_paged_kernels.py on this device (on CPU it needs TRITON_INTERPRET=1, which --tiny sets)."""
    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if shape["device"] == "cpu" else {})}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_paged_kernels.py"), shape["device"]],
        capture_output=True,
        text=True,
        env=env,
    )
    lines = proc.stdout.strip().splitlines()
    return {
        "ok": proc.returncode == 0,
        "checks": lines,
        **({"stderr": proc.stderr.strip().splitlines()[-5:]} if proc.returncode else {}),
    }


def _cb_requests(shape: dict, n: int, max_tokens: int, prompts: list[list[int]] | None = None):
    from tinker import types

    from tbexp.backends.batch_sampling import Request

    g = torch.Generator().manual_seed(2)
    prompts = prompts or [
        torch.randint(2, shape["model"]["vocab_size"], (shape["cb_prompt"],), generator=g).tolist() for _ in range(n)
    ]
    return [
        Request(p, types.SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=1.0, seed=i, stop=["</cmd>"]))
        for i, p in enumerate(prompts)
    ]


def _decode_bound(engine, concurrent: int, mean_context: float, bandwidth: float) -> float:
    """Tokens/s if each decode step only read the decode weights and the batch's KV cache once at `bandwidth`."""
    w = engine.weights
    weight_bytes = (
        sum(t.numel() * t.element_size() for layer in w.layers for t in layer.values())
        + w.head.numel() * w.head.element_size()
    )
    kv_bytes = concurrent * mean_context * 2 * w.n_layers * w.n_kv_heads * w.head_dim * w.embed.element_size()
    return concurrent / ((weight_bytes + kv_bytes) / bandwidth)


def _sample_continuous(
    shape: dict,
    concurrent: int,
    kernels: str = "auto",
    stop: bool = True,
    page_tokens: int = 0,
    prefill_tokens: int = 0,
) -> dict:
    from tinker import types

    b = _backend(shape, _model(shape), continuous_batching=True, max_concurrent_sequences=max(16, concurrent))
    sampler = b.sampler()
    if kernels != "auto" or page_tokens or prefill_tokens:  # before the first request builds it
        from tbexp.backends.continuous_batching import ContinuousBatcher

        with sampler._model() as (_, lm):
            b._batcher = ContinuousBatcher(
                lm,
                b.tokenizer,
                b.eos_token_ids,
                snapshot=sampler,
                kernels=kernels,
                page_tokens=page_tokens,
                max_batch=max(16, concurrent),
                kv_cache_tokens=b._kv_cache_tokens(),
                **({"prefill_tokens": prefill_tokens} if prefill_tokens else {}),
            )
    engine = b._continuous_batcher(sampler)
    warm = [
        r.prompt[::-1] for r in _cb_requests(shape, concurrent, 4)
    ]  # other prompts: nothing cached for the measured run
    sampler.sample_batch(_cb_requests(shape, concurrent, 4, warm))  # captures this bucket's graph, compiles the kernels
    merge_s = [_timed(lambda: sampler._load_into(engine), shape) for _ in range(3)]
    requests = _cb_requests(shape, concurrent, shape["cb_new"])
    if not stop:  # no stop string to decode and check each step: what the host's share of a step is
        requests = [r.__class__(r.prompt, r.params.model_copy(update={"stop": []})) for r in requests]
    if shape["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine.first_token_s.clear()
    steps_before = engine.stats["decode_steps"]
    decode_before = (engine.stats["decode_s"], engine.stats["device_wait_s"], engine.stats["prefill_s"])
    _sync(shape)
    start = time.perf_counter()
    seqs = sampler.sample_batch(requests)
    elapsed = time.perf_counter() - start
    steps = engine.stats["decode_steps"] - steps_before
    host_s = (engine.stats["decode_s"] - decode_before[0]) - (engine.stats["device_wait_s"] - decode_before[1])
    n = sum(len(s.tokens) for s in seqs)
    ttft = sorted(engine.first_token_s)
    decode_s = elapsed - ttft[-1]
    decode_tokens_per_s = (n - len(seqs)) / decode_s
    mean_context = shape["cb_prompt"] + shape["cb_new"] / 2
    bandwidth = {
        "4.8": 4.8e12,
        **({"copy": float(os.environ["BENCH_COPY_TB_PER_S"]) * 1e12} if os.environ.get("BENCH_COPY_TB_PER_S") else {}),
    }
    bounds = {k: _decode_bound(engine, concurrent, mean_context, v) for k, v in bandwidth.items()}
    # Alone vs in the batch: a few requests again, one at a time, with nothing cached (the weights are reloaded).
    sampler._load_into(engine)
    agree, prefix_logp = [], []
    for r, s in list(zip(requests, seqs))[:4]:
        solo = sampler.sample_batch([r])[0]
        same = next(
            (i for i, (a, c) in enumerate(zip(solo.tokens, s.tokens)) if a != c), min(len(solo.tokens), len(s.tokens))
        )
        agree.append(same / max(1, len(s.tokens)))
        prefix_logp.append(max((abs(a - c) for a, c in zip(solo.logprobs[:same], s.logprobs[:same])), default=0.0))
        sampler._load_into(engine)
    forced = sampler.compute_logprobs(types.ModelInput.from_ints(requests[-1].prompt + seqs[-1].tokens)).result()[
        len(requests[-1].prompt) :
    ]
    diff = torch.tensor(forced) - torch.tensor(seqs[-1].logprobs)
    return {
        "concurrent": concurrent,
        "kernels": engine.kernels,
        "tokens_per_s": round(n / elapsed, 1),
        "decode_tokens_per_s": round(decode_tokens_per_s, 1),
        "new_tokens": n,
        "s": round(elapsed, 2),
        "ms_per_step": round(decode_s / max(1, steps) * 1e3, 3),
        "host_ms_per_step": round(host_s / max(1, steps) * 1e3, 3),
        "prefill_s": round(engine.stats["prefill_s"] - decode_before[2], 3),
        "stop": stop,
        "ttft_median_s": round(ttft[len(ttft) // 2], 3),
        "ttft_max_s": round(ttft[-1], 3),
        **{f"bound_tokens_per_s_at_{k}": round(v) for k, v in bounds.items()},
        **{f"fraction_of_bound_at_{k}": round(decode_tokens_per_s / v, 3) for k, v in bounds.items()},
        "weight_merge_ms": [round(x * 1e3, 1) for x in merge_s],
        "page_tokens": engine.page_tokens,
        "kv_cache_tokens": (len(engine.pool.refs) - 1) * engine.page_tokens,
        "peak_gib": _peak_gib(shape),
        "alone_vs_batch_token_agreement": [round(a, 3) for a in agree],
        "alone_vs_batch_logp_max_abs_before_divergence": round(max(prefix_logp), 4),
        "logprob_vs_teacher_forced_max_abs": round(float(diff.abs().max()), 4),
        "mean_abs": round(float(diff.abs().mean()), 4),
        "graph_captures": engine.stats["graph_captures"],
        **_plan_figures(b),
    }


KERNEL_KINDS = (  # a kernel's kind in the profile of a decode step, by the first pattern its name contains
    ("paged_attn", "attention"),
    ("merge_splits", "attention merge"),
    ("add_rmsnorm", "add + rmsnorm"),
    ("qk_rope", "q/k norm + rope + cache write"),
    ("silu_mul", "silu * up"),
    ("sample_", "sampling"),
    ("advance", "next step's inputs"),
    ("gemm", "matmul"),
    ("nvjet", "matmul"),
    ("cutlass", "matmul"),
    ("xmma", "matmul"),
)


def _decode_profile(shape: dict, concurrent: int) -> dict:
    """Where a decode step's device time goes, at `concurrent` rows of the cb-* rows' mean context.

    The rows are admitted and prefilled as in `cb-*`; their lengths are then set to the mean context (the cache
    slots past the prompt hold zeros: the same bytes to read). Kernel time per kind comes from torch.profiler over
    eager steps (the same kernels the graph replays). Timed with CUDA events: the step's graph replayed; the
    attention kernel and each kind of matmul alone over all layers, replayed from graphs of their own; and the
    whole step as `_launch` queues it (graph, sampling, next inputs, copy to the host) with the host waiting for
    each, which the batcher's one-step-ahead loop does not (its step is the cb-* rows' ms_per_step).
    """
    from torch.profiler import ProfilerActivity, profile

    from tbexp.backends.continuous_batching import BUCKETS, _splits

    b = _backend(shape, _model(shape), continuous_batching=True, max_concurrent_sequences=max(16, concurrent))
    sampler = b.sampler()
    engine = b._continuous_batcher(sampler)
    now = time.perf_counter()
    engine._waiting.extend(
        engine._new_sequence(r, sampler, None, now, None) for r in _cb_requests(shape, concurrent, shape["cb_new"])
    )
    engine._prefill(engine._admit())
    context = shape["cb_prompt"] + shape["cb_new"] // 2
    bucket = next(b for b in BUCKETS if b >= concurrent)
    engine._launch(engine.rows)()  # one step, so every row's inputs have been advanced once on the device
    engine.step_inputs[3, :concurrent] = context
    with torch.no_grad():
        for _ in range(3):
            engine._decode_step(bucket)
        _sync(shape)
        on_gpu = shape["device"] == "cuda"  # on a CPU (--tiny) the ops' CPU time stands in
        with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine._decode_step(bucket)
            _sync(shape)
    kinds: dict[str, float] = {}
    launches = 0
    for event in prof.key_averages():
        total_us = event.device_time_total if on_gpu else event.self_cpu_time_total
        if (on_gpu and event.device_type.name != "CUDA") or not total_us:
            continue
        name = event.key.lower()
        kind = next((k for pattern, k in KERNEL_KINDS if pattern in name), "other")
        kinds[kind] = kinds.get(kind, 0.0) + total_us / 5 / 1e3
        launches += event.count / 5
    logits = engine._decode_logits(bucket)  # captures the bucket's graph
    graph_ms = _events_ms(lambda: engine._decode_logits(bucket), 50)
    del logits
    w = engine.weights
    splits = _splits(bucket * w.n_kv_heads, engine.max_pages_per_seq)
    q = torch.randn(bucket, w.n_q_heads, w.head_dim, dtype=w.dtype, device=engine.device)
    lengths = engine.step_inputs[3, :bucket].to(torch.int32)

    def attention_all_layers():
        for layer in range(w.n_layers):
            engine.ops["attention"](
                q, engine.k_cache[layer], engine.v_cache[layer], engine.block_tables[:bucket], lengths, w.scale, splits
            )

    attention_ms = _graph_ms(attention_all_layers, 20)
    kv_bytes = concurrent * context * 2 * w.n_layers * w.n_kv_heads * w.head_dim * w.embed.element_size()
    # Each matmul of the step alone, over every layer's weights (one launch each, as the graph runs them).
    matmul_ms = {}
    for name in ("qkv", "o", "gate_up", "down"):
        x = torch.randn(bucket, w.layers[0][name].shape[1], dtype=w.dtype, device=engine.device)
        matmul_ms[name] = _graph_ms(lambda: [torch.nn.functional.linear(x, layer[name]) for layer in w.layers], 20)
    x = torch.randn(bucket, w.head.shape[1], dtype=w.dtype, device=engine.device)
    matmul_ms["head"] = _graph_ms(lambda: torch.nn.functional.linear(x, w.head), 20)
    weight_bytes = {k: sum(layer[k].numel() * 2 for layer in w.layers) for k in ("qkv", "o", "gate_up", "down")}
    weight_bytes["head"] = w.head.numel() * 2
    # The whole step as the batcher queues it: graph replay, sampling, the next inputs, the copy to the host.
    engine.step_inputs[3, :concurrent] = context
    rows = list(engine.rows)
    step_ms = _events_ms(lambda: engine._launch(rows)(), 20)
    return {
        "concurrent": concurrent,
        "bucket": bucket,
        "context": context,
        "eager_kernel_ms_per_step": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "eager_kernel_ms_total": round(sum(kinds.values()), 3),
        "kernels_per_step": round(launches),
        "graph_step_ms": round(graph_ms, 3),
        "step_with_sampling_ms": round(step_ms, 3),
        "matmul_ms_per_step": {k: round(v, 3) for k, v in matmul_ms.items()},
        "matmul_tb_per_s": {k: round(weight_bytes[k] / matmul_ms[k] / 1e9, 2) for k in matmul_ms},
        "attention_all_layers_ms": round(attention_ms, 3),
        "attention_tb_per_s": round(kv_bytes / attention_ms / 1e9, 2),
        "attention_splits": splits,
    }


def _lora_unmerged(shape: dict, concurrent: int) -> dict:
    """The decode step's linear layers with the LoRA deltas merged (what the batcher runs) against unmerged.

    Merged: the 4 fused products a layer (QKV, output, gate/up, down) from the batcher's own buffers. Unmerged:
    the same 4 products from the base weights, each plus its LoRA path x·Aᵀ·Bᵀ (the A of a fused product stacked,
    its B block-diagonal: 2 more small products a fused product, added in place by addmm), so no merged copy is
    needed and a new snapshot copies only A and B. Both are captured in a CUDA graph at `concurrent` rows and
    timed replayed; the merge is `ContinuousBatcher.load`, timed as the cb-* rows time it (weight_merge_ms).
    """
    from tbexp.backends.continuous_batching import BUCKETS

    b = _backend(shape, _model(shape), continuous_batching=True, max_concurrent_sequences=max(16, concurrent))
    sampler = b.sampler()
    engine = b._continuous_batcher(sampler)
    w = engine.weights
    bucket = next(n for n in BUCKETS if n >= concurrent)
    groups = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj")}
    groups["down"] = ("down_proj",)
    unmerged = []
    with sampler._model() as (_, lm), torch.no_grad():
        for layer in lm.get_decoder().layers:
            mods = {name: getattr(layer.self_attn, name, None) or getattr(layer.mlp, name) for name in TARGETS}
            fused = {}
            for key, names in groups.items():
                base = torch.cat([mods[n].base_layer.weight for n in names]).contiguous()
                a = torch.cat([mods[n].lora_A["default"].weight for n in names]).to(w.dtype).contiguous()
                b_blocks = [mods[n].lora_B["default"].weight * mods[n].scaling["default"] for n in names]
                b_diag = torch.block_diag(*b_blocks).to(w.dtype).contiguous()
                fused[key] = (base, a, b_diag)
            unmerged.append(fused)
        rank = unmerged[0]["qkv"][1].shape[0] // 3
    x = {
        k: torch.randn(bucket, t.shape[1], dtype=w.dtype, device=engine.device)
        for k, t in w.layers[0].items()
        if k in groups
    }

    def merged_step():
        return [torch.nn.functional.linear(x[k], layer[k]) for layer in w.layers for k in groups]

    def unmerged_step():
        outs = []
        for layer in unmerged:
            for k, (base, a, b_diag) in layer.items():
                y = torch.nn.functional.linear(x[k], base)
                outs.append(torch.addmm(y, torch.nn.functional.linear(x[k], a), b_diag.t()))
        return outs

    times = {"merged": _graph_ms(merged_step, 50), "unmerged": _graph_ms(unmerged_step, 50)}
    merge_ms = [_timed(lambda: sampler._load_into(engine), shape) * 1e3 for _ in range(3)]
    extra = times["unmerged"] - times["merged"]
    return {
        "concurrent": concurrent,
        "lora_rank": rank,
        "merged_linear_ms_per_step": round(times["merged"], 3),
        "unmerged_linear_ms_per_step": round(times["unmerged"], 3),
        "unmerged_extra_ms_per_step": round(extra, 3),
        "weight_merge_ms": [round(t, 1) for t in merge_ms],
        "merge_pays_after_steps": round(min(merge_ms) / extra, 1) if extra > 0 else None,
        "unmerged_extra_ms_per_512_token_reply": round(extra * shape["cb_new"], 1),
    }


def _graph_ms(fn, repeats: int) -> float:
    """`_events_ms` of `fn` captured in a CUDA graph and replayed (no launch overhead), or of `fn` on a CPU."""
    fn()
    if not torch.cuda.is_available():
        return _events_ms(fn, repeats)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _events_ms(graph.replay, repeats)


def _events_ms(fn, repeats: int) -> float:
    """Median milliseconds of `fn` on the device (CUDA events around each call, after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if not torch.cuda.is_available():  # --tiny: wall time
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _timed(fn, shape: dict) -> float:
    _sync(shape)
    start = time.perf_counter()
    fn()
    _sync(shape)
    return time.perf_counter() - start


def _grpo_step(shape: dict, continuous: bool, gradient_checkpointing: bool | None = None) -> dict:
    """One GRPO step: sample the groups, one importance-sampling forward_backward over every reply, optim_step."""
    from tinker import types

    knobs = {"continuous_batching": True} if continuous else {"cuda_graph_sampling": shape["device"] == "cuda"}
    knobs["gradient_checkpointing"] = gradient_checkpointing  # None: the memory plan's choice
    b = _backend(
        shape,
        _model(shape),
        packing=True,
        microbatch_tokens=16384 if shape["device"] == "cuda" else 256,
        logprob_chunk_tokens=4096 if shape["device"] == "cuda" else None,
        max_concurrent_sequences=64,
        **knobs,
    )
    groups, size = shape["grpo_groups"], shape["grpo_group_size"]
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(2, shape["model"]["vocab_size"], (shape["cb_prompt"],), generator=g).tolist()
        for _ in range(groups)
    ]
    adam = types.AdamParams(learning_rate=1e-5)

    def step(max_tokens: int) -> dict:
        start = time.perf_counter()
        sampler = b.sampler()  # new weights each step: the continuous batcher merges them once here
        params = types.SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=1.0, seed=0, stop=["</cmd>"])
        if continuous:
            flat = sampler.sample_batch([r for p in prompts for r in _cb_requests(shape, size, max_tokens, [p] * size)])
            replies = [flat[i * size : (i + 1) * size] for i in range(groups)]
        else:
            replies = [sampler.sample(types.ModelInput.from_ints(p), size, params).result() for p in prompts]
        _sync(shape)
        sampled = time.perf_counter()
        data = []
        for prompt, group in zip(prompts, replies):
            rewards = torch.randn(len(group), generator=g)
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            for seq, adv in zip(group, advantages.tolist()):
                tokens = prompt + seq.tokens
                pad = [0.0] * (len(prompt) - 1)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": tokens[1:],
                            "logprobs": pad + seq.logprobs,
                            "advantages": pad + [adv] * len(seq.tokens),
                        },
                    )
                )
        b.forward_backward(data, "importance_sampling").result()
        b.optim_step(adam).result()
        _sync(shape)
        done = time.perf_counter()
        n = sum(len(s.tokens) for group in replies for s in group)
        return {
            "sample_s": round(sampled - start, 2),
            "train_s": round(done - sampled, 2),
            "step_s": round(done - start, 2),
            "sampling_share": round((sampled - start) / (done - start), 3),
            "sampled_tokens": n,
            "sampling_tokens_per_s": round(n / (sampled - start), 1),
        }

    step(8)  # warm-up: graphs, kernels, allocator
    if shape["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result = step(shape["cb_new"])
    extra = (
        {
            "cached_prompt_tokens": b._batcher.stats["cached_prompt_tokens"],
            "prefill_tokens": b._batcher.stats["prefill_tokens"],
        }
        if continuous
        else {}
    )
    return {
        "continuous": continuous,
        "episodes": groups * size,
        **result,
        "peak_gib": _peak_gib(shape),
        **_plan_figures(b),
        **extra,
    }


def _memory_plan(shape: dict) -> dict:
    """The memory plan of the GRPO step (`grpo-step-after`'s settings) for this shape on this card, or on a card
    of `--card-gib` GiB: the plan alone, from the shapes, with nothing allocated."""
    from transformers import Qwen3Config

    from tbexp.backends import memory_plan as mp

    card = torch.cuda.get_device_properties().total_memory if shape["device"] == "cuda" else shape["card_gib"] * 2**30
    if not card:
        return {"skipped": "no GPU: give --card-gib"}
    config = Qwen3Config(**shape["model"])
    sampling = mp.Sampling(True, shape["grpo_groups"] * shape["grpo_group_size"], shape["cb_prompt"] + shape["cb_new"])
    out = {"card_gib": round(card / 2**30, 1)}
    for checkpointing in (False, True, None):
        training = mp.Training(16384, bool(checkpointing), 32, tuple(TARGETS), 4096)
        key = {False: "checkpointing_off", True: "checkpointing_on", None: "default"}[checkpointing]
        try:
            plan, ckpt = mp.for_backend(config, 2, training, sampling, int(card), mp.DEFAULT_FRACTION, checkpointing)
            out[key] = {"checkpointing": ckpt, "plan": plan.describe()}
            out[f"{key}_peak_gib"] = round(plan.peak_bytes / 2**30, 2)
        except mp.MemoryPlanError as e:
            out[key] = {"refused": str(e)}
    return out


def _train_memory(shape: dict) -> dict:
    """A training pass's memory per token of context, checkpointing off and on, against the plan's count.

    One datum of T tokens, then 2T, through forward_backward; the slope between them is the per-token figure
    (weights and the loss chunk cancel). On a GPU: the peak allocated above what was allocated before the call;
    on a CPU (no allocator statistics): the bytes of the tensors autograd saves for the backward.
    """
    from tbexp.backends import memory_plan as mp

    short = 2048 if shape["device"] == "cuda" else 64
    out = {}
    for checkpointing in (False, True):
        b = _backend(
            shape, _model(shape), packing=True, microbatch_tokens=2 * short, gradient_checkpointing=checkpointing
        )
        figures = []
        for tokens in (short, 2 * short):
            data = _sft_data(shape, 1, [tokens])
            b.forward_backward(data, "cross_entropy").result()  # warm-up: gradients and kernels allocated
            figures.append(_training_bytes(shape, b, data))
        m = mp.ModelShape.of(b._lm.config, 2)
        training = mp.Training(2 * short, checkpointing, 32, tuple(TARGETS))
        plan = [replace(training, microbatch_tokens=n).activation_bytes(m) for n in (short, 2 * short)]
        key = "checkpointing_on" if checkpointing else "checkpointing_off"
        out[f"{key}_bytes_per_token"] = round((figures[1] - figures[0]) / short)
        out[f"{key}_planned_bytes_per_token"] = round((plan[1] - plan[0]) / short)
        # What the backward keeps (no transients): what a CPU's count of saved tensors is compared with.
        kept = m.layer_activation_bytes_per_token(32, len(TARGETS)) if not checkpointing else 2 * m.hidden
        out[f"{key}_planned_kept_bytes_per_token"] = m.layers * kept
        del b
    out["measured"] = "peak allocated" if shape["device"] == "cuda" else "bytes autograd saves"
    return out


def _training_bytes(shape: dict, b, data) -> int:
    if shape["device"] == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        b.forward_backward(data, "cross_entropy").result()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    storages: dict[int, int] = {}

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        b.forward_backward(data, "cross_entropy").result()
    return sum(storages.values())


def _host_work(shape: dict, concurrent: int) -> dict:
    """A decode step's host work at `concurrent` rows, apart from the model's forward and the sampler.

    Requests with distinct prompts and 16 to `cb_new` new tokens (so rows leave at different steps and the
    running batch changes most steps) and a stop string checked every step. The driving thread's CPU time in
    the decode loop less its CPU time in the forward (`_decode_logits`) and the sampler (`ops["sample"]`): on a
    CPU these compute, on a GPU they launch (a graph replay, two kernels). `host_ms_per_step` is the batcher's
    own figure (decode wall time less the time spent waiting for the device).
    """
    b = _backend(shape, _model(shape), continuous_batching=True, max_concurrent_sequences=max(16, concurrent))
    sampler = b.sampler()
    engine = b._continuous_batcher(sampler)
    warm = [r.prompt[::-1] for r in _cb_requests(shape, concurrent, 4)]
    sampler.sample_batch(_cb_requests(shape, concurrent, 4, warm))
    spent = {"forward": 0.0, "sample": 0.0, "decode": 0.0}
    decoding = []  # non-empty inside the decode loop: the prefill's own sampling is not a decode step's

    def timed(key, fn):
        def run(*args, **kwargs):
            start = time.thread_time()
            if key == "decode":
                decoding.append(True)
            try:
                return fn(*args, **kwargs)
            finally:
                if key == "decode":
                    decoding.pop()
                if decoding or key == "decode":
                    spent[key] += time.thread_time() - start

        return run

    torch.set_num_threads(1)  # the model's CPU work on this thread, where thread_time sees it
    engine._decode_logits = timed("forward", engine._decode_logits)
    engine.ops = {**engine.ops, "sample": timed("sample", engine.ops["sample"])}
    engine._decode_run = timed("decode", engine._decode_run)
    longest = shape["host_new"]
    shortest = max(1, longest // 8)
    requests = [
        r.__class__(
            r.prompt, r.params.model_copy(update={"max_tokens": shortest + (i * 37) % (longest - shortest + 1)})
        )
        for i, r in enumerate(_cb_requests(shape, concurrent, longest))
    ]
    before = dict(engine.stats)
    start = time.perf_counter()
    seqs = sampler.sample_batch(requests)
    elapsed = time.perf_counter() - start
    steps = engine.stats["decode_steps"] - before["decode_steps"]
    wall_host = (engine.stats["decode_s"] - before["decode_s"]) - (
        engine.stats["device_wait_s"] - before["device_wait_s"]
    )
    return {
        "concurrent": concurrent,
        "steps": steps,
        "new_tokens": sum(len(s.tokens) for s in seqs),
        "s": round(elapsed, 3),
        "host_cpu_ms_per_step": round((spent["decode"] - spent["forward"] - spent["sample"]) / steps * 1e3, 3),
        "forward_cpu_ms_per_step": round(spent["forward"] / steps * 1e3, 3),
        "sample_cpu_ms_per_step": round(spent["sample"] / steps * 1e3, 3),
        "host_ms_per_step": round(wall_host / steps * 1e3, 3),
    }


def _table(results: list[dict]) -> None:
    print("\n| measurement | card | figure | peak GiB | notes |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r.get('card', '')} | {_row(r)} |")


def _row(r: dict) -> str:
    """A result's figure | peak GiB | notes cells."""
    planned = (
        f"; planned {r['planned_peak_gib']} GiB, pool {r['planned_kv_tokens']:,} tokens"
        if "planned_peak_gib" in r
        else ""
    )
    ckpt = f", checkpointing {'on' if r['gradient_checkpointing'] else 'off'}" if "gradient_checkpointing" in r else ""
    if "error" in r or "oom" in r:
        return f"failed | | {r.get('error') or r.get('oom')}"
    if "merged_linear_ms_per_step" in r:
        return (
            f"{r['merged_linear_ms_per_step']} vs {r['unmerged_linear_ms_per_step']} ms/step (merged vs unmerged "
            f"linears) | | merge {min(r['weight_merge_ms'])} ms once a snapshot: pays after "
            f"{r['merge_pays_after_steps']} steps"
        )
    if "graph_step_ms" in r:
        return (
            f"{r['graph_step_ms']} ms/step (graph) | | attention {r['attention_all_layers_ms']} ms at "
            f"{r['attention_tb_per_s']} TB/s; eager kernels {r['eager_kernel_ms_per_step']}"
        )
    if "host_cpu_ms_per_step" in r:
        return (
            f"{r['host_cpu_ms_per_step']} ms host CPU a step | | {r['concurrent']} rows, {r['steps']} steps; forward "
            f"{r['forward_cpu_ms_per_step']} ms, sampler {r['sample_cpu_ms_per_step']} ms; host (wall) "
            f"{r['host_ms_per_step']} ms"
        )
    if "decode_tokens_per_s" in r:
        return (
            f"{r['tokens_per_s']:,} tokens/s ({r['decode_tokens_per_s']:,} decoding) | {r['peak_gib']} | "
            f"{r['ms_per_step']} ms/step, host {r['host_ms_per_step']} ms, TTFT median {r['ttft_median_s']} s, max "
            f"{r['ttft_max_s']} s, {r['fraction_of_bound_at_4.8']:.0%} of the 4.8 TB/s bound{planned}"
        )
    if "tokens_per_s" in r:
        extra = (
            f"MFU {r['mfu_vs_989']:.1%} of 989 TFLOP/s, {r['s_per_step']} s/step"
            if "mfu_vs_989" in r
            else f"{r['ms_per_step']} ms/step"
        )
        return f"{r['tokens_per_s']:,} tokens/s | {r['peak_gib']} | {extra}{ckpt}{planned}"
    if "sampling_share" in r:
        return (
            f"{r['step_s']} s/step | {r['peak_gib']} | sampling {r['sample_s']} s ({r['sampling_share']:.0%}), "
            f"training {r['train_s']} s{ckpt}{planned}"
        )
    if "real_tokens_per_s" in r:
        return f"{r['real_tokens_per_s']:,} real tokens/s | {r['peak_gib']} | {r['s_per_step']} s/step"
    if "peak_above_inputs_gib" in r:
        return f"{r['s']} s | {r['peak_above_inputs_gib']} | full fp32 logits alone {r['full_fp32_logits_gib']} GiB"
    if "checkpointing_off_bytes_per_token" in r:
        return (
            f"{r['checkpointing_off_bytes_per_token']:,} / {r['checkpointing_on_bytes_per_token']:,} bytes a token "
            f"(checkpointing off / on; {r['measured']}) | | planned peak {r['checkpointing_off_planned_bytes_per_token']:,}"
            f" / {r['checkpointing_on_planned_bytes_per_token']:,}, of which the layers keep "
            f"{r['checkpointing_off_planned_kept_bytes_per_token']:,} / {r['checkpointing_on_planned_kept_bytes_per_token']:,}"
        )
    if "default" in r:
        peak = {k: r.get(f"{k}_peak_gib", "refused") for k in ("checkpointing_off", "checkpointing_on", "default")}
        return (
            f"planned peak {peak['default']} GiB | | checkpointing off {peak['checkpointing_off']}, on "
            f"{peak['checkpointing_on']} (GiB) on {r['card_gib']} GiB"
        )
    return f" | | {json.dumps({k: v for k, v in r.items() if k not in ('name', 'card')})}"


if __name__ == "__main__":
    main()
