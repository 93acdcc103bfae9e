"""Answer fidelity of composition policies against full prefill (prints, never asserts).

For each question: system prompt + top passages + question, chat-rendered; passages are
prefilled independently once, then composed with ``naive`` and ``epic`` (k in --ks) and
compared with a full prefill of the same tokens: mean KL(full || composed) of the next-token
distribution, top-1 next-token agreement, and greedy-continuation agreement (share of the
reference continuation reproduced before the first divergence; and exact-match rate).

Reusable states are captured in float32 and also cast to float16 (the default ``kv_dtype``),
so both storage dtypes are reported from one run. Two unit layouts are compared: plain
passages, and passages led by a sink token (``--lead-token``, default ``<|endoftext|>``) that
is part of the unit and of the prompt, as each chunk of EPIC's evaluation starts with BOS.

    flock /tmp/tessera-cpu.lock python bench/fidelity.py --questions 50
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch
from prompts import build_layout, load_questions

from tessera.composition.policies import get_policy
from tessera.config import ClusterConfig, GenerationNodeConfig, ModelConfig
from tessera.engines.base import UnitState
from tessera.engines.offline import compose, prefill, prefill_units
from tessera.engines.reference import ReferenceEngine


def agreement(ref: list[int], got: list[int]) -> float:
    n = 0
    for a, b in zip(ref, got, strict=False):
        if a != b:
            break
        n += 1
    return n / max(1, len(ref))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=None,
                    help="MuSiQue json (default ../shared/data/musique/musique_s.json)")
    ap.add_argument("--questions", type=int, default=50)
    ap.add_argument("--passages", type=int, default=5)
    ap.add_argument("--passage-tokens", type=int, default=160, help="truncate each passage to this many tokens")
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 16, 32])
    ap.add_argument("--continue-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lead-token", default="<|endoftext|>", help="token leading every unit in the 'led' layout")
    ap.add_argument("--layouts", nargs="+", default=["plain", "led"], choices=["plain", "led"])
    args = ap.parse_args()

    cfg = ClusterConfig(kv_dtype="float32", model=ModelConfig(source=args.model, threads=args.threads),
                        generation=(GenerationNodeConfig("gen0"),))
    engine = ReferenceEngine.from_config(cfg, prefix_cache_tokens=0)
    questions, source = load_questions(args.data, args.questions, args.passages)
    # EPIC's plain rule (the first k tokens of every passage), not the served length-aware one
    policies = {"naive": get_policy("naive")} | {
        f"epic k={k}": get_policy("epic", recompute_tokens=k, recompute_fraction=1.0) for k in args.ks}
    stops = engine.eos_token_ids
    lead_id = int(engine.tokenizer.hf.convert_tokens_to_ids(args.lead_token))
    leads = {"plain": (), "led": (lead_id,)}
    stats: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    lengths = []
    t0 = time.perf_counter()
    for i, q in enumerate(questions):
        for layout_name in args.layouts:
            layout = build_layout(engine, q, args.passage_tokens, leads[layout_name])
            lengths.append(layout.n_tokens)
            ref = prefill(engine, layout.token_ids(), max_new_tokens=args.continue_tokens, stop_ids=stops)
            ref_logp = torch.log_softmax(ref.logits, -1)
            states32 = prefill_units(engine, layout)
            # float16 storage, read back for this float32 engine: the rounding a float16 tier applies
            # (handing it float16 tensors raised PlacementError: the engine places kv_dtype states only)
            states16 = {u: UnitState(s.keys.half().float(), s.values.half().float()) for u, s in states32.items()}
            for dtype, states in (("float32", states32), ("float16", states16)):
                for name, policy in policies.items():
                    out = compose(engine, layout, policy, states, max_new_tokens=args.continue_tokens,
                                  stop_ids=stops, use_prefix_cache=False)
                    logp = torch.log_softmax(out.logits, -1)
                    s = stats[(layout_name, name, dtype)]
                    s["kl"].append(float((ref_logp.exp() * (ref_logp - logp)).sum()))
                    s["top1"].append(float(int(out.logits.argmax()) == int(ref.logits.argmax())))
                    s["cont"].append(agreement(ref.generated, out.generated))
                    s["exact"].append(float(out.generated == ref.generated))
        print(f"[{i + 1}/{len(questions)}] {layout.n_tokens} tokens, {time.perf_counter() - t0:.0f} s", flush=True)

    n = len(questions)
    print(f"\n{engine.fingerprint.model.split(':')[0]} fidelity vs full prefill: {n} questions from {source}, "
          f"{args.passages} passages x <= {args.passage_tokens} tokens, prompts {min(lengths)}-{max(lengths)} tokens "
          f"(mean {sum(lengths) / len(lengths):.0f}), greedy continuation of {args.continue_tokens} tokens; "
          f"'led' units start with {args.lead_token}\n")
    print("| units | policy | kv dtype | mean KL | top-1 agreement | continuation agreement | continuation exact |")
    print("|---|---|---|---|---|---|---|")
    for (layout_name, name, dtype), s in stats.items():
        mean = {k: sum(v) / len(v) for k, v in s.items()}
        print(f"| {layout_name} | {name} | {dtype} | {mean['kl']:.4f} | {mean['top1']:.3f} | {mean['cont']:.3f} | "
              f"{mean['exact']:.3f} |")


if __name__ == "__main__":
    main()
