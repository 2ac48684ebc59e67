"""Check paged_kernels.py's Triton kernels against their torch references on fresh random inputs.

    python scripts/check_paged_kernels.py cuda                     # on a GPU, bf16
    TRITON_INTERPRET=1 python scripts/check_paged_kernels.py cpu   # Triton's interpreter on a CPU, fp32

Prints one line per check (relative error ‖out − ref‖ / ‖ref‖, or token agreement) and `ALL OK` last
when every check is within its bound (fp32: 1e-5; bf16: 2e-2); exits 1 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tbexp.backends import paged_kernels as pk  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main() -> int:
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    dt = torch.float32 if dev == "cpu" else torch.bfloat16
    bound = 1e-5 if dt == torch.float32 else 2e-2
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    tri, ref = pk.OPS["triton"], pk.OPS["torch"]
    results: dict[str, float] = {}
    n, d_model = 5, 64
    x, r = torch.randn(n, d_model, device=dev, dtype=dt), torch.randn(n, d_model, device=dev, dtype=dt)
    w = torch.randn(d_model, device=dev, dtype=dt)
    for res in (r, None):
        a, b = tri["add_rmsnorm"](x, res, w, 1e-6), ref["add_rmsnorm"](x, res, w, 1e-6)
        results[f"add_rmsnorm residual={res is not None}"] = max(rel(a[0], b[0]), rel(a[1], b[1]))
    hq, hkv, d, page, pages = 4, 2, 32, 16, 12
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device=dev, dtype=dt)
    cos, sin = torch.randn(n, d, device=dev), torch.randn(n, d, device=dev)
    qn, kn = torch.randn(d, device=dev, dtype=dt), torch.randn(d, device=dev, dtype=dt)
    slots = torch.tensor([3, 17, 40, 41, 100], device=dev)
    for norm in (True, False):
        caches = [torch.randn(pages, hkv, page, d, device=dev, dtype=dt) for _ in range(2)]
        caches += [c.clone() for c in caches]
        q1 = tri["qk_norm_rope_store"](
            qkv, cos, sin, qn if norm else None, kn if norm else None, 1e-6, caches[0], caches[1], slots, hq, hkv
        )
        q2 = ref["qk_norm_rope_store"](
            qkv, cos, sin, qn if norm else None, kn if norm else None, 1e-6, caches[2], caches[3], slots, hq, hkv
        )
        results[f"qk_norm_rope_store norm={norm}"] = max(
            rel(q1, q2), rel(caches[0], caches[2]), rel(caches[1], caches[3])
        )
    for group in (2, 8):
        kc = torch.randn(pages, hkv, page, d, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        table = torch.randperm(pages, device=dev)[:8].repeat(n, 1).int()
        lens = torch.tensor([1, 16, 17, 50, 128], device=dev, dtype=torch.int32)
        q = torch.randn(n, hkv * group, d, device=dev, dtype=dt)
        want = ref["attention"](q, kc, vc, table, lens, d**-0.5)
        for splits, chunk in ((1, 1), (3, 1), (8, 1), (1, 2), (3, 2), (2, 4)):
            results[f"paged_attention group={group} splits={splits} pages a step={chunk}"] = rel(
                tri["attention"](q, kc, vc, table, lens, d**-0.5, splits, {"CHUNK": chunk}), want
            )
    gu = torch.randn(n, 2 * 1100, device=dev, dtype=dt)
    results["silu_mul"] = rel(tri["silu_mul"](gu), ref["silu_mul"](gu))
    vocab = 10000
    logits = torch.randn(6, vocab, device=dev) * 3
    temps = torch.tensor([0.0, 0.7, 1.0, 1.0, 0.3, 2.0], device=dev)
    seeds = torch.tensor([0, 1, 2**40 + 5, 2**61, 7, 7], device=dev)
    steps = torch.tensor([0, 3, 9, 100000, 5, 6], device=dev)
    (t1, l1), (t2, l2) = tri["sample"](logits, temps, seeds, steps), ref["sample"](logits, temps, seeds, steps)
    results["sample tokens differing"] = float((t1 != t2).float().mean())
    results["sample logp"] = float((l1 - l2).abs().max())
    ok = True
    for name, err in results.items():
        good = err <= bound
        ok &= good
        print(f"{name}: {err:.3g} {'ok' if good else 'FAIL'}")
    print("ALL OK" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
