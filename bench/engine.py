"""Time to first token: composed prefill over cached units vs full prefill (prints, never asserts).

Prompt: system prompt + 5 passages (truncated to --unit-tokens) + question, chat-rendered.
Measured on the reference engine (default tessera.toml: fp32 compute, fp16 unit storage), or
with ``--engine sglang`` on SGLang's model runner (bf16 compute, its CPU kernels):

* full prefill of the whole prompt (and transformers' own model on the same tokens, --hf);
* independent prefill of the 5 units (the cost of a miss);
* composed prefill with the system prompt in the exact-prefix cache and all units cached,
  split into RoPE placement and the final extend; the final extend of ``naive`` (suffix and
  separators only) is timed too, so recompute = epic extend - naive extend.

    flock /tmp/tessera-cpu.lock python bench/engine.py
    flock /tmp/tessera-cpu.lock python bench/engine.py --engine sglang --no-hf   # SGLang installed
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from prompts import build_layout, load_questions

from tessera.composition.layout import leading_text_tokens, placements, tokens_to_compute
from tessera.composition.policies import get_policy
from tessera.config_file import load_config
from tessera.engines.base import EngineAdapter, Extend, load_engine
from tessera.engines.offline import place_units, prefill_units
from tessera.messages.prompt import PromptLayout


def timed(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def composed(engine: EngineAdapter, layout: PromptLayout, policy: str, k: int, states: dict, repeats: int
             ) -> dict[str, float]:
    """Median time of each stage of one composed prefill."""
    pol = get_policy(policy, recompute_tokens=k, recompute_fraction=1.0)  # epic: the first k of every unit
    ranges = pol.select(layout)
    stages: dict[str, list[float]] = {"match": [], "place": [], "extend": [], "total": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        slots = engine.allocate(layout.n_tokens + 1)
        prefix_len = engine.match_prefix(slots, leading_text_tokens(layout))
        t1 = time.perf_counter()
        place_units(engine, slots, placements(layout, ranges, prefix_len), states)
        t2 = time.perf_counter()
        ids, positions = tokens_to_compute(layout, ranges, prefix_len)
        engine.step([Extend(slots, ids, positions)])
        t3 = time.perf_counter()
        engine.free(slots)
        for key, value in (("match", t1 - t0), ("place", t2 - t1), ("extend", t3 - t2), ("total", t3 - t0)):
            stages[key].append(value)
    out = {key: statistics.median(v) for key, v in stages.items()}
    out["computed"] = len(ids)
    return out


def decode_step_time(engine: EngineAdapter, layout: PromptLayout, states: dict, batch: int, steps: int) -> float:
    """Median seconds of one decode step for ``batch`` requests whose prompts were composed (epic k=16)."""
    ranges = get_policy("epic", recompute_tokens=16, recompute_fraction=1.0).select(layout)
    n = layout.n_tokens
    requests = []
    for _ in range(batch):
        slots = engine.allocate(n + steps)
        place_units(engine, slots, placements(layout, ranges, 0), states)
        ids, positions = tokens_to_compute(layout, ranges, 0)
        engine.step([Extend(slots, ids, positions)])
        requests.append(slots)
    samples = []
    for i in range(steps):
        work = [Extend(slots, [100 + i], [n + i]) for slots in requests]
        t = time.perf_counter()
        engine.decode(work)
        samples.append(time.perf_counter() - t)
    for slots in requests:
        engine.free(slots)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=None)
    ap.add_argument("--unit-tokens", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' own model")
    ap.add_argument("--engine", choices=("reference", "sglang"), default="reference",
                    help="sglang: SGLang's model runner in bfloat16 (SGLang must be installed)")
    args = ap.parse_args()

    cfg = load_config()
    dtype = "bfloat16" if args.engine == "sglang" else cfg.model.dtype
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, threads=args.threads, engine=args.engine,
                                                             dtype=dtype))
    engine = load_engine(cfg, 16384)
    (question,), _ = load_questions(args.data, 1, 5)
    layout = build_layout(engine, question, args.unit_tokens)
    tokens = layout.token_ids()
    n = len(tokens)
    n_units = sum(len(s.token_ids) for _, s in layout.unit_offsets())

    def full() -> None:
        slots = engine.allocate(n)
        engine.step([Extend(slots, tokens, range(n))])
        engine.free(slots)

    full()  # warm-up (allocator, rope tables)
    t_full = timed(full, args.repeats)
    t_units = timed(lambda: prefill_units(engine, layout), args.repeats)
    states = prefill_units(engine, layout)
    warm = engine.allocate(n)  # cache the system prompt in the exact-prefix cache
    lead = leading_text_tokens(layout)
    engine.step([Extend(warm, lead, range(len(lead)))])
    engine.insert_prefix(warm, lead)
    rows = {"naive": composed(engine, layout, "naive", 0, states, args.repeats)}
    for k in (4, 16, 32):
        rows[f"epic k={k}"] = composed(engine, layout, "epic", k, states, args.repeats)

    decode = {b: decode_step_time(engine, layout, states, b, 16) for b in (1, 8)}
    t_hf = t_hf_decode = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        from tessera.engines.checkpoint import resolve

        hf = AutoModelForCausalLM.from_pretrained(str(resolve(cfg.model).path), dtype=torch.float32).eval()
        ids = torch.tensor([tokens])
        with torch.no_grad():
            hf(ids[:, :64])
            t_hf = timed(lambda: hf(ids), args.repeats)
            out = hf(ids, use_cache=True)
            cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
            cache = getattr(out, cache_kw, None) or out.past_key_values
            samples = []
            for i in range(16):
                t = time.perf_counter()
                hf(torch.tensor([[100 + i]]), use_cache=True, **{cache_kw: cache})
                samples.append(time.perf_counter() - t)
            t_hf_decode = statistics.median(samples)

    print(f"\nSmolLM2-135M, {args.engine} engine, {args.threads} threads, {dtype} compute, {cfg.kv_dtype} unit "
          f"storage; prompt {n} tokens "
          f"= {len(lead)} system + 5 units ({n_units} tokens) + {n - len(lead) - n_units} separators/question; "
          f"median of {args.repeats}\n")
    print("| path | tokens computed | placement | final extend | TTFT | speed-up vs full |")
    print("|---|---|---|---|---|---|")
    print(f"| full prefill (ours) | {n} | - | {t_full:.3f} s | {t_full:.3f} s | 1.0x ({n / t_full:.0f} tok/s) |")
    if t_hf is not None:
        print(f"| full prefill (transformers) | {n} | - | {t_hf:.3f} s | {t_hf:.3f} s | {t_full / t_hf:.2f}x |")
    print(f"| unit prefill (5 misses, one step) | {n_units} | - | {t_units:.3f} s | - | - |")
    for name, r in rows.items():
        print(f"| composed, {name} | {int(r['computed'])} | {r['place']:.3f} s | {r['extend']:.3f} s | "
              f"{r['total']:.3f} s | {t_full / r['total']:.1f}x |")
    recompute = rows["epic k=16"]["extend"] - rows["naive"]["extend"]
    print(f"\nsplit of epic k=16: placement {rows['epic k=16']['place']:.3f} s, recompute of the 5x16 unit heads "
          f"{recompute:.3f} s (epic extend - naive extend), suffix {rows['naive']['extend']:.3f} s, "
          f"prefix match {rows['epic k=16']['match']:.3f} s")
    print(f"decode step at {n} tokens of context: batch 1 {decode[1] * 1e3:.1f} ms, batch 8 {decode[8] * 1e3:.1f} ms "
          f"({8 / decode[8]:.0f} tok/s)"
          + (f"; transformers batch 1 {t_hf_decode * 1e3:.1f} ms" if t_hf_decode else ""))


if __name__ == "__main__":
    main()
