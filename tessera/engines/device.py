"""Where unit states live and how they move between the engine's device and host memory.

Unit states are produced on the engine's device. The local unit cache and the KV Pool keep
them in host memory; on CUDA that memory is *pinned*, so both directions are asynchronous
DMA copies on a side stream and never stall the compute stream:

* :func:`to_host`: device -> pinned host, issued after the producing kernels (the side stream
  waits on the compute stream), completion signalled by an event (:func:`wait_host`);
* :func:`to_device`: pinned host -> device with non-blocking copies on the side stream; the
  compute stream waits for them before the placement kernel reads the result;
* :func:`check_state`: the invariants a state must meet before placement (shape, dtype,
  device, pinning), with messages that name the tensor.

Any failure is a :class:`PlacementError`; the executor then computes the unit instead.
On CPU every function is the identity and no stream or event exists. This module knows
nothing about units, plans or transports.
"""

from __future__ import annotations

import asyncio
import functools

import torch

from tessera.engines.base import UnitState
from tessera.engines.geometry import ModelGeometry
from tessera.errors import PlacementError


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per device, shared by every copy in both directions."""
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


def concrete(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:N`` (the current device), as tensors report it; other devices unchanged."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _named(state: UnitState) -> tuple[tuple[str, torch.Tensor], ...]:
    return (("state.keys", state.keys), ("state.values", state.values))


def placement(state: UnitState, offset: int, n_slots: int, geometry: ModelGeometry, kv_dtype: torch.dtype,
              device: torch.device) -> UnitState | None:
    """``state`` checked to fit a request of ``n_slots`` at ``offset`` and this engine, on ``device``;
    None for an empty state (nothing to place). The adapter boundary every engine's ``place``
    crosses: a state from the cache, the pool or a prefill must fit the engine it is placed on."""
    n = state.n_tokens
    if not 0 <= offset <= n_slots - n:
        raise ValueError(f"unit of {n} tokens at offset {offset} does not fit {n_slots} slots")
    if n == 0:
        return None
    check_state(state, geometry, kv_dtype, device)
    return to_device(state, device)


def check_state(state: UnitState, geometry: ModelGeometry, dtype: torch.dtype, device: torch.device) -> None:
    """Raise PlacementError naming the tensor unless ``state`` can be placed on ``device``.

    A state may live on ``device`` itself or in host memory; a host state placed on a CUDA
    device must be pinned (a pageable source makes the copy synchronous and hides a bug in
    the staging path).
    """
    g = geometry
    device = concrete(device)
    for name, t in _named(state):
        if t.dim() != 4 or (t.shape[0], t.shape[2], t.shape[3]) != (g.n_layers, g.n_kv_heads, g.head_dim):
            raise PlacementError(f"{name} has shape {tuple(t.shape)}; this model's units are "
                                 f"[L={g.n_layers}, T, H_kv={g.n_kv_heads}, D={g.head_dim}]")
        if t.dtype != dtype:
            raise PlacementError(f"{name} is {t.dtype} but this engine stores units as {dtype} "
                                 f"(kv_dtype = {g.kv_dtype!r}): a state from another deployment?")
        if t.device != device and t.device.type != "cpu":
            raise PlacementError(f"{name} is on {t.device}; the engine runs on {device} and accepts "
                                 "states on its own device or in host memory")
        if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
            raise PlacementError(f"{name} is in pageable host memory; states placed on {device} must be "
                                 "staged in pinned memory (tessera.engines.device.to_host / pinned fetch buffers)")


def to_device(state: UnitState, device: torch.device) -> UnitState:
    """``state`` on ``device``: itself if already there, else non-blocking copies on the side stream.

    The current (compute) stream waits for the copies, so kernels queued after this call see
    the data; the caching allocator is told the tensors are used on the compute stream.
    """
    device = concrete(device)
    if state.keys.device == device and state.values.device == device:
        return state
    if device.type != "cuda":
        raise PlacementError(f"state.keys is on {state.keys.device}; cannot place it on {device}")
    try:
        compute = torch.cuda.current_stream(device)
        side = _side_stream(device)
        with torch.cuda.stream(side):
            keys = state.keys.to(device, non_blocking=True)
            values = state.values.to(device, non_blocking=True)
        compute.wait_stream(side)
        keys.record_stream(compute)
        values.record_stream(compute)
    except RuntimeError as exc:  # CUDA OOM or a failed copy
        raise PlacementError(f"copying state.keys/state.values ({state.nbytes()} B) to {device} failed: {exc}") from exc
    return UnitState(keys, values)


def to_host(state: UnitState) -> tuple[UnitState, torch.cuda.Event | None]:
    """A host copy of ``state`` (pinned on CUDA) and the event that marks it complete.

    A host state is returned as is (no event). A CUDA state is copied on the side stream after
    every kernel queued so far on the compute stream (which produced it); the source stays
    alive until the copy is done (``record_stream``).
    """
    src = state.keys.device
    if src.type != "cuda":
        return state, None
    try:
        side = _side_stream(src)
        side.wait_stream(torch.cuda.current_stream(src))
        keys = torch.empty(state.keys.shape, dtype=state.keys.dtype, pin_memory=True)
        values = torch.empty(state.values.shape, dtype=state.values.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            keys.copy_(state.keys, non_blocking=True)
            values.copy_(state.values, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        state.keys.record_stream(side)
        state.values.record_stream(side)
    except RuntimeError as exc:
        raise PlacementError(f"copying state.keys/state.values ({state.nbytes()} B) from {src} to host "
                             f"failed: {exc}") from exc
    return UnitState(keys, values), done


async def host_copy(state: UnitState) -> UnitState:
    """:func:`to_host`, awaited without blocking the event loop (identity on CPU)."""
    host, done = to_host(state)
    if done is not None:
        await asyncio.to_thread(done.synchronize)
    return host

