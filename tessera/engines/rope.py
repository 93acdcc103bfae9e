"""Rotary position embedding: frequencies from a checkpoint config, and cos/sin tables.

A key's reusable form is taken *before* RoPE, so the same tables serve the forward pass
(queries and fresh keys) and placement (rotating a cached unit's keys to its new offset).
Both read rows of one :class:`RopeTable`, so a placed key is bit-for-bit the key the forward
pass would have produced at that position.

Supported ``rope_type``: ``default``, ``linear`` and ``llama3`` (Llama 3.1+ frequency
scaling); anything else raises :class:`ModelLoadError`. This module knows nothing about
layers or caches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tessera.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """What determines the rotation frequencies (parsed from config.json)."""

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @classmethod
    def from_config(cls, config: Mapping[str, Any], head_dim: int) -> RopeSpec:
        """Read both the transformers>=5 ``rope_parameters`` and the older ``rope_theta``/``rope_scaling``."""
        params = dict(config.get("rope_parameters") or {})
        params.update(config.get("rope_scaling") or {})
        theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            raise ModelLoadError(f"partial_rotary_factor = {partial} is not supported (only full rotary)")
        if rope_type == "default":
            return cls(head_dim=head_dim, theta=theta)
        if rope_type == "linear":
            return cls(head_dim=head_dim, theta=theta, rope_type="linear", factor=float(params["factor"]))
        return cls(
            head_dim=head_dim,
            theta=theta,
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )

    def inv_freq(self) -> torch.Tensor:
        """Inverse frequencies ``[D/2]`` in float32, computed the way transformers computes them."""
        dim = self.head_dim
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            # long wavelengths are divided by `factor`, short ones kept, the middle band interpolated
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv


class RopeTable:
    """cos/sin rows ``[P, D]`` (halves duplicated, as ``rotate_half`` expects), grown on demand.

    Tables are float32 (what the angles are computed in) plus a copy in the compute dtype, so
    the hot path gathers rows and never converts. Growth doubles the table up to ``max_positions``.
    """

    def __init__(self, spec: RopeSpec, max_positions: int, dtype: torch.dtype, device: torch.device,
                 initial: int = 4096) -> None:
        self.spec = spec
        self.max_positions = max_positions
        self.dtype = dtype
        self.device = device
        self._inv_freq = spec.inv_freq()
        self._size = 0
        self.cos = self.sin = torch.empty(0)
        self._grow(min(initial, max_positions))

    def _grow(self, size: int) -> None:
        # one multiply per entry in float32: the same rounding as transformers' matmul of positions
        freqs = torch.outer(torch.arange(size, dtype=torch.float32), self._inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=self.device, dtype=self.dtype)
        self.sin = emb.sin().to(device=self.device, dtype=self.dtype)
        self._size = size

    def ensure(self, n_positions: int) -> None:
        """Make rows ``0 .. n_positions-1`` available."""
        if n_positions > self.max_positions:
            raise ValueError(f"position {n_positions - 1} exceeds the model's context of {self.max_positions}")
        if n_positions > self._size:
            self._grow(min(self.max_positions, max(n_positions, 2 * self._size)))

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows for ``positions`` ``[N]`` -> ``[N, 1, D]`` each (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with cos/sin broadcastable to ``x`` (``[..., D]``)."""
    return x * cos + rotate_half(x) * sin
