"""Next-token choice for one request: greedy, temperature and nucleus (top-p), seedable.

A :class:`Sampler` lives as long as its request: with ``seed`` set it owns a private
``torch.Generator``, so the same prompt and seed give the same tokens whatever else is in
the batch. Logits are only read, never modified in place. The parameters are valid by
construction (``SamplingParams`` checks its own bounds).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tessera.messages.generation import SamplingParams

# below this temperature sampling is greedy: logits / t overflow to inf (NaN probabilities)
# long before t reaches 0, and the distribution is one-hot anyway
GREEDY_BELOW = 1e-5


def greedy(logits: torch.Tensor) -> list[int]:
    """Argmax per row of ``[B, vocab]`` logits (one call for a whole decode batch)."""
    return [int(t) for t in logits.argmax(dim=-1).tolist()]


class Sampler:
    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int] = ()) -> None:
        self.params = params
        self._stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stops.update(eos_token_ids)
        self._generator: torch.Generator | None = None
        if params.seed is not None:
            self._generator = torch.Generator().manual_seed(params.seed)

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature < GREEDY_BELOW

    def pick(self, logits: torch.Tensor) -> int:
        """Choose the next token from ``[vocab]`` logits."""
        if self.is_greedy:
            return int(logits.argmax())
        probs = torch.softmax(logits.float().cpu() / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest head whose mass reaches top_p (the first token always stays)
            keep = (sorted_probs.cumsum(0) - sorted_probs) < self.params.top_p
            # a valid top_p below half float32's smallest subnormal (1e-46, 5e-324) rounds to 0 in
            # the comparison and would keep nothing: multinomial then raised on an all-zero row
            keep[0] = True
            sorted_probs = sorted_probs * keep
            choice = torch.multinomial(sorted_probs, 1, generator=self._generator)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self._generator))

    def is_stop(self, token: int) -> bool:
        """Whether ``token`` ends the request (stop tokens, and EOS unless ``ignore_eos``)."""
        return token in self._stops
