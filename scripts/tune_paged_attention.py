"""Time the paged decode attention kernel over launch settings, on a GPU; prints one JSON line per setting.

    python scripts/tune_paged_attention.py [--rows 64] [--context 1280] [--in-order] [--quick] [--default-splits]

The shape is Qwen3-1.7B's (16 query heads, 8 KV heads, head_dim 128, 32-token pages, bf16) at `--rows`
sequences of `--context` tokens each, the decode benchmark's mean context (scripts/bench_gpu.py cb-64). For
each number of pages a step, split-K factor, warp count and pipelining depth it reports the kernel's time (CUDA events: the median
of 30 replays of a CUDA graph of 10 calls, the merge of the splits included) and the bandwidth it reaches reading the batch's K/V once. The best
line is printed last; `ATTENTION_LAUNCH` (tbexp/backends/paged_kernels.py) and `_splits`
(tbexp/backends/continuous_batching.py) hold the settings the batcher uses.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tbexp.backends import paged_kernels as pk  # noqa: E402
from tbexp.backends.continuous_batching import _splits  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=1280)
    p.add_argument(
        "--in-order", action="store_true", help="each sequence's pages consecutive, as a live cache mostly has them"
    )
    p.add_argument("--quick", action="store_true", help="2 or 4 pages a step, 1/2/4/8 splits, 4 or 8 warps only")
    p.add_argument("--default-splits", action="store_true", help="only the split-K factor the batcher picks")
    args = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    hq, hkv, d, page = 16, 8, 128, 32
    per_seq = -(-args.context // page)
    n_pages = args.rows * per_seq + 1
    k_cache = torch.randn(n_pages, hkv, page, d, device=dev, dtype=dt)
    v_cache = torch.randn(n_pages, hkv, page, d, device=dev, dtype=dt)
    order = torch.randperm(n_pages - 1, device=dev) + 1  # pages scattered over the pool (a long-running cache)
    if args.in_order:
        order = torch.arange(1, n_pages, device=dev)
    tables = order[: args.rows * per_seq].view(args.rows, per_seq).to(torch.int32).contiguous()
    lengths = torch.full((args.rows,), args.context, dtype=torch.int32, device=dev)
    q = torch.randn(args.rows, hq, d, device=dev, dtype=dt)
    kv_bytes = 2 * args.rows * args.context * hkv * d * 2
    reference = pk.OPS["torch"]["attention"](q, k_cache, v_cache, tables, lengths, d**-0.5, 1)
    default_splits = _splits(args.rows * hkv, per_seq)
    results = []
    grid = ((2, 4), (1, 2, 4, 8), (4, 8), (2, 3)) if args.quick else ((1, 2, 4), (1, 2, 3, 4, 8), (2, 4, 8), (2, 3))
    if args.default_splits:
        grid = (grid[0], (default_splits,), grid[2], grid[3])
    for chunk, splits, warps, stages in itertools.product(*grid):
        launch = {"CHUNK": chunk, "num_warps": warps, "num_stages": stages}
        try:
            out = pk.paged_decode_attention_triton(q, k_cache, v_cache, tables, lengths, d**-0.5, splits, launch)
        except Exception as err:  # a setting the compiler refuses (e.g. out of shared memory)
            print(json.dumps({"splits": splits, **launch, "error": str(err)[:120]}), flush=True)
            continue
        error = float((out.float() - reference.float()).norm() / reference.float().norm())
        # 10 calls captured in a CUDA graph and replayed, as the batcher runs them: an event pair around one
        # eager call would time the host's launch too (tens of microseconds against a ~90 us kernel).
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                pk.paged_decode_attention_triton(q, k_cache, v_cache, tables, lengths, d**-0.5, splits, launch)
        times_ms = []
        for _ in range(30):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times_ms.append(start.elapsed_time(end) / 10)
        ms = statistics.median(times_ms)
        row = {"splits": splits, **launch, "us": round(ms * 1e3, 1), "tb_per_s": round(kv_bytes / ms / 1e9, 2)}
        row["rel_error"], row["default_splits"] = round(error, 5), splits == default_splits
        results.append(row)
        print(json.dumps(row), flush=True)
    now = [r for r in results if r["default_splits"] and all(r[k] == v for k, v in pk.ATTENTION_LAUNCH.items())]
    print(json.dumps({"current": now[0] if now else None, "best": min(results, key=lambda r: r["us"])}))


if __name__ == "__main__":
    main()
