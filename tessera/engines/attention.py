"""Attention over a paged KV pool with SDPA: one sequence, or a batch of single-token decodes.

The paged engine's eager step and its captured decode graphs (:mod:`tessera.engines.decode_graphs`)
attend through these two functions, so a replayed graph computes what the eager step would.
Shapes: queries ``[n, H, D]``; keys and values ``[K, H_kv, D]`` (one request's) or a layer of
the pool, ``[S, H_kv, D]``. The scale is ``1/sqrt(D)``; ``H != H_kv`` is grouped-query attention.
This module knows nothing about pages, requests or graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         causal: bool) -> torch.Tensor:
    """One sequence: q ``[n, H, D]``, k/v ``[K, H_kv, D]`` -> ``[n, H, D]``.

    ``mask`` ``[n, K]`` (True = visible) or ``causal`` (the rows are positions 0..n-1, SDPA's
    ``is_causal``: the flash kernel on CUDA).
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=causal and q.shape[0] > 1, scale=q.shape[-1] ** -0.5,
        enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gather: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """Single-token queries ``[B, H, D]`` over their gathered slots -> ``[B, H, D]``.

    ``keys``/``values`` ``[S, H_kv, D]`` (a layer of the pool); ``gather`` ``[B, K]`` the slots
    each row reads, padded; ``mask`` ``[B, 1, 1, K]`` True for a row's real keys.
    """
    kd = keys[gather].transpose(1, 2)  # [B, H_kv, K, D]
    vd = values[gather].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, scale=q.shape[-1] ** -0.5,
                                         enable_gqa=q.shape[1] != keys.shape[1])
    return out[:, :, 0]
