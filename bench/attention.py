"""Ragged-batch attention: one SDPA per item vs one SDPA over the packed batch with a dense mask.

The choice behind the paged engine's attention (tessera/engines/paged.py). Prints, never asserts.

    python bench/attention.py            # CPU, 1 thread
    python bench/attention.py --cuda     # the same on a GPU (bf16)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

H, H_KV, D = 8, 2, 64


def run(n_items: int, n: int, device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    total = n_items * n
    q = torch.randn(total, H, D, device=device, dtype=dtype)
    k = torch.randn(total, H_KV, D, device=device, dtype=dtype)
    v = torch.randn(total, H_KV, D, device=device, dtype=dtype)
    doc, pos = torch.arange(total, device=device) // n, torch.arange(total, device=device) % n

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).unsqueeze(0)

    def per_item() -> torch.Tensor:
        out = torch.empty_like(q)
        for i in range(n_items):
            s = slice(i * n, (i + 1) * n)
            out[s] = F.scaled_dot_product_attention(heads(q[s]), heads(k[s]), heads(v[s]), is_causal=True,
                                                    enable_gqa=True)[0].transpose(0, 1)
        return out

    def packed() -> torch.Tensor:
        mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
        return F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask,
                                              enable_gqa=True)[0].transpose(0, 1)

    torch.testing.assert_close(per_item().float(), packed().float(), atol=2e-2, rtol=2e-2)
    times = []
    for fn in (per_item, packed):
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / 5)
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    device = torch.device("cuda" if args.cuda else "cpu")
    dtype = torch.bfloat16 if args.cuda else torch.float32
    for n_items, n in ((4, 128), (4, 512), (8, 256), (2, 1024)):
        a, b = run(n_items, n, device, dtype)
        print(f"{n_items} items x {n} tokens: per-item {a * 1e3:.1f} ms, packed + mask {b * 1e3:.1f} ms "
              f"({b / a:.1f}x)")


if __name__ == "__main__":
    main()
