"""Sampling: greedy, seeded temperature/top-p, stop tokens, and the parameters' bounds."""

from __future__ import annotations

import pytest
import torch

from tessera.engines.sampling import Sampler, greedy
from tessera.errors import DecodeError
from tessera.messages.generation import SamplingParams
from tessera.wire import from_wire


def flat_logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(1000, generator=torch.Generator().manual_seed(seed)) * 0.1


def draw(params: SamplingParams, n: int = 20) -> list[int]:
    sampler = Sampler(params)
    return [sampler.pick(flat_logits(i)) for i in range(n)]


def test_greedy_picks_the_argmax() -> None:
    """temperature 0 is argmax, for one request and for a batch."""
    logits = flat_logits()
    assert Sampler(SamplingParams()).pick(logits) == int(logits.argmax())
    assert greedy(torch.stack([logits, -logits])) == [int(logits.argmax()), int((-logits).argmax())]


def test_seeded_sampling_is_reproducible() -> None:
    """The same seed gives the same tokens; another seed gives others."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    assert draw(params) == draw(params)
    assert draw(params) != draw(SamplingParams(temperature=1.0, top_p=0.9, seed=8))


def test_tiny_top_p_keeps_only_the_most_likely_token() -> None:
    """Nucleus sampling always keeps the head token; with a tiny top_p it is the only one."""
    params = SamplingParams(temperature=1.0, top_p=1e-6, seed=1)
    assert draw(params) == [int(flat_logits(i).argmax()) for i in range(20)]


@pytest.mark.parametrize("top_p", [1e-46, 5e-324])
def test_a_top_p_below_float32s_range_still_keeps_the_head_token(top_p: float) -> None:
    """Regression (found by tests/test_api_fuzz.py): top_p = 5e-324 rounded to 0 against the
    float32 probabilities, kept no token, and the generation node's multinomial raised (a 503)."""
    assert draw(SamplingParams(temperature=1.0, top_p=top_p, seed=1)) == [int(flat_logits(i).argmax())
                                                                          for i in range(20)]


def test_sampling_does_not_modify_logits() -> None:
    """Logits are read only (the engine may hand out views of a batch tensor)."""
    logits = flat_logits()
    before = logits.clone()
    Sampler(SamplingParams(temperature=0.7, top_p=0.5, seed=3)).pick(logits)
    assert torch.equal(logits, before)


def test_stop_tokens_and_eos() -> None:
    """EOS stops unless ignore_eos; explicit stop tokens always stop."""
    assert Sampler(SamplingParams(), eos_token_ids=(2,)).is_stop(2)
    assert not Sampler(SamplingParams(ignore_eos=True), eos_token_ids=(2,)).is_stop(2)
    assert Sampler(SamplingParams(stop_token_ids=(9,), ignore_eos=True), eos_token_ids=(2,)).is_stop(9)
    assert not Sampler(SamplingParams(), eos_token_ids=(2,)).is_stop(5)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [({"temperature": -1}, "temperature"), ({"temperature": 2.5}, "temperature"), ({"top_p": 0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"top_logprobs": 21}, "top_logprobs")],
)
def test_unservable_parameters_cannot_be_built(fields: dict[str, float], needle: str) -> None:
    """SamplingParams refuses values the sampler cannot serve, naming the field."""
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**fields)  # type: ignore[arg-type]


def test_an_execute_request_with_bad_sampling_is_a_decode_error() -> None:
    """A peer sending unservable sampling parameters gets a DecodeError (HTTP 400), not a crash."""
    with pytest.raises(DecodeError, match="temperature"):
        from_wire(SamplingParams, {"temperature": -1.0})
