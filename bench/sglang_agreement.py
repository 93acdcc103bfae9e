"""Greedy agreement between engines on the same prompts (prints, never asserts).

Full prefill of each prompt (built as the retrieval role builds it, units as text) and a greedy
continuation of ``--answer-tokens`` tokens (end of sequence ignored) on:

* Tessera on SGLang (``model.engine = "sglang"``, bfloat16, SGLang's CPU kernels);
* unmodified SGLang (its offline ``sglang.Engine``, radix cache off, same dtype and backend);
* Tessera's reference engine (float32).

Printed: how many continuations are identical, and the mean share of each continuation that
agrees before the first differing token, for each pair. SGLang must be installed.

    flock /tmp/tessera-cpu.lock python bench/sglang_agreement.py --prompts 24
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Sequence

from tessera.benchmark.verify import Layouts, Prompt, prompts_from_workload, sample
from tessera.benchmark.workloads import synthetic_workload
from tessera.composition.policies import get_policy
from tessera.config_file import load_config
from tessera.engines.base import EngineAdapter, load_engine
from tessera.engines.checkpoint import resolve
from tessera.engines.offline import compose
from tessera.engines.tokenizer import load_tokenizer


def greedy(engine: EngineAdapter, layouts: Layouts, prompts: Sequence[Prompt], n: int) -> list[list[int]]:
    full = get_policy("full")
    out = []
    for p in prompts:
        plain = layouts.build(p, "", full, n).served
        out.append(compose(engine, plain, full, {}, max_new_tokens=n, use_prefix_cache=False).generated)
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    same, shares = 0, []
    for x, y in zip(a, b, strict=True):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        same += x == y
        shares.append(k / max(len(x), 1))
    return same, statistics.mean(shares)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    base = load_config()
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, threads=args.threads))
    on_sglang = dataclasses.replace(base, model=dataclasses.replace(base.model, engine="sglang",
                                                                    dtype=base.sglang.dtype))
    checkpoint = resolve(base.model)
    tokenizer = load_tokenizer(checkpoint)
    pool = prompts_from_workload(base, synthetic_workload(4 * args.prompts, seed=args.seed), tokenizer)
    prompts = sample(pool, args.prompts, args.seed)

    # the reference engine first and SGLang's own server before Tessera's runner joins this process
    reference_engine = load_engine(base, 0)
    layouts = Layouts(reference_engine, tokenizer, base)
    ids = [layouts.build(p, "", get_policy("full"), args.answer_tokens).served.token_ids() for p in prompts]
    reference = greedy(reference_engine, layouts, prompts, args.answer_tokens)
    del reference_engine

    import sglang

    s = base.sglang
    server = sglang.Engine(model_path=str(checkpoint.path), device=base.model.device,
                           attention_backend=s.attention_backend, dtype=s.dtype, tp_size=1,
                           max_total_tokens=s.max_total_tokens, disable_radix_cache=True, log_level="warning")
    try:
        outs = server.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": args.answer_tokens,
                                                               "ignore_eos": True})
    finally:
        server.shutdown()
    unmodified = [list(o["output_ids"]) for o in outs]
    tessera_sglang = greedy(load_engine(on_sglang, 0), layouts, prompts, args.answer_tokens)

    print(f"\n{len(prompts)} synthetic prompts ({min(map(len, ids))}-{max(map(len, ids))} tokens), "
          f"{args.answer_tokens} greedy tokens each, end of sequence ignored\n")
    print("| pair | identical continuations | mean agreeing share before the first difference |")
    print("|---|---|---|")
    for name, a, b in (("Tessera on SGLang vs unmodified SGLang (both bf16)", tessera_sglang, unmodified),
                       ("Tessera on SGLang (bf16) vs reference engine (fp32)", tessera_sglang, reference),
                       ("unmodified SGLang (bf16) vs reference engine (fp32)", unmodified, reference)):
        same, share = agreement(a, b)
        print(f"| {name} | {same}/{len(prompts)} | {share:.3f} |")


if __name__ == "__main__":
    main()
