"""What one engine forward costs by the number of tokens it computes (prints, never asserts).

    flock /tmp/tessera-cpu.lock python bench/forward_cost.py [--tokens 1,50,90,150,244] [--context 301]
        [--compare 244,116] [--batch 3] [--fused 36] [--threads 1] [--repeats 12] [--config tessera.toml]

Each size computes its tokens as one extend over a request's slots of ``--context`` positions
(the last ones, so every query attends to the whole context, as a served prompt's do), with
the node's thread count (1). A least-squares line through the medians splits a forward into
a fixed part, paid by every forward whatever its size (on CPU mostly reading every weight
once), and a part per computed token. ``--compare A,B`` prints what that line predicts for
two requests computing A and B tokens in a forward of their own: the ratio of their engine
time, which bounds how much faster the second system can serve than the first when each
request is its own forward (docs/bench/locomo.md, "What bounds the sustained ratio").

``--batch K`` then times 1..K requests of A tokens each (their own slots) in ONE forward, as
the scheduler batches them, against that many forwards apart: if the fixed part were paid
once per forward, a batch of K would save (K-1) times it; what it saves is the part the batch
really shares. It is also what every member of a batch waits for before its first token.

``--fused U`` times a request of B tokens (``--compare``'s second) that misses a unit of U
tokens both ways the node can serve it: the unit prefilled in a forward of its own, placed,
then the request's extend (two forwards, as before the reference engine fused them), against
one forward that prefills the unit and places it layer by layer (``Extend.units``).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tessera.config_file import load_config
from tessera.engines.base import Extend, UnitFeed, UnitPrefill
from tessera.engines.reference import ReferenceEngine, TorchSlots


def median_ms(run: Callable[[], None], repeats: int) -> float:
    """Median milliseconds of ``run()`` over ``repeats`` calls, after two warm-up calls (allocator
    and kernel caches)."""
    samples = []
    for _ in range(repeats + 2):
        t = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples[2:]) * 1000


def zeroed_slots(engine: ReferenceEngine, context: int) -> TorchSlots:
    """A request's slots of ``context`` positions, zeroed: a served request's slots below its
    computed tokens hold placed states; allocate() leaves them uninitialised, and garbage there
    (denormals, NaN) would time the wrong arithmetic."""
    s = engine.allocate(context)
    s.keys.zero_()
    s.values.zero_()
    return s


def forward_ms(engine: ReferenceEngine, n_tokens: int, context: int, repeats: int, requests: int = 1) -> float:
    """Median milliseconds of one step holding ``requests`` extends (each its own request's
    slots) of ``n_tokens`` at the last positions of ``context``."""
    rng = random.Random(n_tokens)
    ids = [rng.randrange(1000, 20000) for _ in range(n_tokens)]
    positions = list(range(context - n_tokens, context))
    slots = [zeroed_slots(engine, context) for _ in range(requests)]
    try:
        return median_ms(lambda: engine.step([Extend(s, ids, positions) for s in slots]), repeats)
    finally:
        for s in slots:
            engine.free(s)


def miss_ms(engine: ReferenceEngine, unit: int, n_tokens: int, context: int, repeats: int) -> tuple[float, float]:
    """Median milliseconds of serving a request of ``n_tokens`` computed tokens that misses a unit
    of ``unit`` tokens (placed just before them): (prefill + place + extend, one fused extend)."""
    rng = random.Random(unit)
    unit_ids = [rng.randrange(1000, 20000) for _ in range(unit)]
    ids = [rng.randrange(1000, 20000) for _ in range(n_tokens)]
    positions = list(range(context - n_tokens, context))
    at = context - n_tokens - unit
    slots = zeroed_slots(engine, context)

    def separate() -> None:
        prefill = UnitPrefill(unit_ids)
        engine.step([prefill])
        assert prefill.state is not None
        engine.place(slots, at, prefill.state)
        engine.step([Extend(slots, ids, positions)])

    def fused() -> None:
        engine.step([Extend(slots, ids, positions, units=[UnitFeed(unit_ids, [(0, unit, at)])])])

    try:
        return median_ms(separate, repeats), median_ms(fused, repeats)
    finally:
        engine.free(slots)


def fit_line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = fixed + per_token * x``; returns (fixed, per_token)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    assert sxx > 0, "two different sizes are needed (main() checks --tokens)"
    per_token = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - per_token * mx, per_token


def sizes(text: str, flag: str) -> list[int]:
    try:
        out = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated token counts, e.g. 1,50,90; got {text!r}") from None
    if not out or min(out) < 1:
        raise SystemExit(f"{flag} takes token counts >= 1; got {text!r}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,50,90,150,244", help="computed tokens per forward, comma-separated")
    ap.add_argument("--context", type=int, default=301, help="positions of the request (its prompt length)")
    ap.add_argument("--compare", default="244,116", help="A,B: the engine-time ratio of A- and B-token requests")
    ap.add_argument("--batch", type=int, default=0, help="K: also time 1..K requests of A tokens in one forward")
    ap.add_argument("--fused", type=int, default=0,
                    help="U: also time a B-token request missing a U-token unit, two forwards vs one")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a generation node's default: 1)")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--config", type=Path, default=None)
    args = ap.parse_args()
    tokens, compare = sizes(args.tokens, "--tokens"), sizes(args.compare, "--compare")
    if len(set(tokens)) < 2:
        raise SystemExit("--tokens needs at least two different sizes to split fixed and per-token cost")
    if max(tokens) > args.context:
        raise SystemExit(f"--context {args.context} is shorter than the largest of --tokens ({max(tokens)})")
    if len(compare) != 2 or args.repeats < 1 or args.threads < 1 or args.batch < 0 or args.fused < 0:
        raise SystemExit("--compare takes two counts (A,B); --repeats and --threads must be >= 1, "
                         "--batch and --fused >= 0")
    if max(compare) > args.context:
        raise SystemExit(f"--context {args.context} is shorter than the largest of --compare ({max(compare)})")
    if args.fused and args.fused + compare[1] > args.context:
        raise SystemExit(f"--context {args.context} cannot hold the --fused unit ({args.fused}) before "
                         f"the request's {compare[1]} computed tokens")
    cfg = load_config(args.config)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, threads=args.threads))
    engine = ReferenceEngine.from_config(cfg)
    print(f"{cfg.model.dtype} compute, {args.threads} thread(s), {args.context}-position request, "
          f"median of {args.repeats}:")
    measured = [forward_ms(engine, n, args.context, args.repeats) for n in tokens]
    for n, ms in zip(tokens, measured, strict=True):
        print(f"  {n:5d} tokens: {ms:8.1f} ms")
    fixed, per_token = fit_line(tokens, measured)
    print(f"fit: {fixed:.1f} ms per forward + {per_token:.2f} ms per computed token")
    a, b = compare
    ta, tb = fixed + per_token * a, fixed + per_token * b
    print(f"a request computing {a} tokens {ta:.0f} ms, one computing {b} tokens {tb:.0f} ms: "
          f"engine-time ratio {ta / tb:.2f}x (token ratio {a / b:.2f}x)")
    if args.batch:
        alone = forward_ms(engine, a, args.context, args.repeats)
        for k in range(2, args.batch + 1):
            together = forward_ms(engine, a, args.context, args.repeats, requests=k)
            saved = k * alone - together
            print(f"{k} requests of {a} tokens in one forward: {together:.0f} ms vs {k * alone:.0f} ms apart; "
                  f"the batch shares {saved / (k - 1):.0f} ms per extra request (fit's fixed part {fixed:.0f} ms), "
                  f"and each member waits {together:.0f} ms, not {alone:.0f}, for its first token")
    if args.fused:
        two, one = miss_ms(engine, args.fused, b, args.context, args.repeats)
        print(f"a {b}-token request missing a {args.fused}-token unit: {two:.0f} ms as prefill + place + extend, "
              f"{one:.0f} ms as one fused extend ({two - one:.0f} ms saved, {two / one:.2f}x)")


if __name__ == "__main__":
    main()
