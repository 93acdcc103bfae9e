"""Order-free units: deduplication and ordering never change a request's units, and put what
earlier prompts began with first; the API field and the per-scope default decide who is order-free."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.config import RetrievalConfig
from tessera.config_file import dump_toml, load_config, parse_config
from tessera.errors import BadRequest, ConfigError
from tessera.retrieval.chat.request import parse_chat_request
from tessera.retrieval.order import Arranged, UnitOrders, deduplicated, lead_key
from tessera.units import ContextUnit

KEY = b"lead"


def unit(name: str, n: int = 10) -> ContextUnit:
    return ContextUnit(name, "s", f"text of {name}", tuple(range(n)))


def ids(units: list[ContextUnit] | Arranged) -> list[str]:
    return [u.unit_id for u in (units.units if isinstance(units, Arranged) else units)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from("abcdefgh"), max_size=10), min_size=1, max_size=12))
def test_arranging_never_changes_the_set_of_units_or_their_text(requests: list[list[str]]) -> None:
    """Whatever was served before, a request gets each of its units once, with its own text."""
    orders = UnitOrders(max_nodes=16)
    for names in requests:
        units = [unit(n, 5 + ord(n) % 7) for n in names]
        out = orders.arrange(KEY, units)
        assert sorted(ids(out)) == sorted(set(names))
        assert {(u.unit_id, u.text, u.token_ids) for u in out.units} == \
            {(u.unit_id, u.text, u.token_ids) for u in units}
        assert len(orders) <= 16  # pruned back once past its bound


def test_repeated_units_are_kept_once_where_they_first_came() -> None:
    assert ids(deduplicated([unit("a"), unit("b"), unit("a"), unit("c"), unit("b")])) == ["a", "b", "c"]


def test_units_an_earlier_prompt_began_with_go_first_in_its_order() -> None:
    """The second request shares b and c with the first: they lead, in the first's order; its
    other units follow in the order they came."""
    orders = UnitOrders()
    assert ids(orders.arrange(KEY, [unit("a"), unit("b"), unit("c")])) == ["a", "b", "c"]
    assert ids(orders.arrange(KEY, [unit("d"), unit("c"), unit("b")])) == ["d", "c", "b"]  # no path starts with b, c
    assert ids(orders.arrange(KEY, [unit("c"), unit("e"), unit("a"), unit("b")])) == ["a", "b", "c", "e"]


def test_an_order_served_before_whole_or_as_a_beginning_is_recurring() -> None:
    orders = UnitOrders()
    assert not orders.arrange(KEY, [unit("a"), unit("b"), unit("c")]).recurring
    assert orders.arrange(KEY, [unit("b"), unit("a"), unit("c")]).recurring  # the same set, any order
    assert orders.arrange(KEY, [unit("b"), unit("a")]).recurring  # the beginning of a served order
    assert not orders.arrange(KEY, [unit("b"), unit("c")]).recurring  # no served order begins with b, c
    assert not orders.arrange(KEY, []).recurring


def test_the_path_covering_the_most_tokens_wins_and_the_latest_on_a_tie() -> None:
    orders = UnitOrders()
    orders.arrange(KEY, [unit("a", 5), unit("x", 5)])
    orders.arrange(KEY, [unit("b", 30), unit("y", 5)])
    assert ids(orders.arrange(KEY, [unit("a", 5), unit("b", 30)])) == ["b", "a"]  # b's 30 tokens beat a's 5
    orders.arrange(KEY, [unit("c", 30), unit("z", 5)])
    assert ids(orders.arrange(KEY, [unit("b", 30), unit("c", 30)]))[0] == "c"  # equal tokens: the latest path


def test_orders_are_remembered_per_leading_text() -> None:
    """Another system prompt or tenant starts from nothing: its prompts share no prefix."""
    orders = UnitOrders()
    orders.arrange(KEY, [unit("a"), unit("b")])
    assert ids(orders.arrange(b"other", [unit("b"), unit("a")])) == ["b", "a"]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q1"}]
    assert lead_key("t", system, "system") == lead_key("t", [*system[:1], {"role": "user", "content": "q2"}], "system")
    assert lead_key("t", system, "system") != lead_key("u", system, "system")
    assert lead_key("t", system, "system") != lead_key("t", [{"role": "system", "content": "x"}], "system")
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert lead_key("t", [*history, {"role": "user", "content": "q1"}], "user") == \
        lead_key("t", [*history, {"role": "user", "content": "q2"}], "user")
    assert lead_key("t", [*history, {"role": "user", "content": "q1"}], "user") != \
        lead_key("t", [{"role": "user", "content": "q1"}], "user")


def test_the_trie_is_bounded_and_keeps_what_was_served_last() -> None:
    orders = UnitOrders(max_nodes=40)
    rng = random.Random(1)
    names = [f"u{i}" for i in range(30)]
    for _ in range(200):
        orders.arrange(KEY, [unit(n) for n in rng.sample(names, 4)])
    assert len(orders) <= 40
    last = orders.arrange(KEY, [unit("u1"), unit("u2"), unit("u3")])
    assert ids(orders.arrange(KEY, [unit(n) for n in ("u3", "u2", "u1")])) == ids(last)


def _chat(**extra: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "q"}], "context_units": ["x"], **extra}


def test_the_request_says_fixed_or_free_else_its_scopes_default() -> None:
    cfg = RetrievalConfig(order_free_scopes=("memory/*", "docs"))
    parse = dict(default_top_k=5, default_placement="system", served_model="m")
    assert parse_chat_request(_chat(unit_order="free"), **parse).order_free(cfg.order_free)
    assert not parse_chat_request(_chat(unit_order="fixed", scope="docs"), **parse).order_free(cfg.order_free)
    assert parse_chat_request(_chat(scope="docs"), **parse).order_free(cfg.order_free)
    assert parse_chat_request(_chat(scope="memory/alice"), **parse).order_free(cfg.order_free)
    assert not parse_chat_request(_chat(scope="other"), **parse).order_free(cfg.order_free)
    mixed = _chat(context_units=[{"text": "x", "scope": "docs"}, {"text": "y", "scope": "other"}])
    assert not parse_chat_request(mixed, **parse).order_free(cfg.order_free)  # every scope must be free
    retrieval = {"messages": [{"role": "user", "content": "q"}], "retrieval": {"query": "q", "scope": "docs"}}
    assert parse_chat_request(retrieval, **parse).order_free(cfg.order_free)
    assert parse_chat_request(_chat(), **parse).order_free(RetrievalConfig(unit_order="free").order_free)
    with pytest.raises(BadRequest, match="unit_order"):
        parse_chat_request(_chat(unit_order="random"), **parse)


def test_order_free_scopes_load_from_toml_and_bad_values_say_what_to_write(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "c.toml"
    path.write_text('base = "default"\n[retrieval]\norder_free_scopes = ["memory/*", "docs"]\n')
    cfg = load_config(path)
    assert cfg.retrieval.order_free_scopes == ("memory/*", "docs")
    assert load_config_text(dump_toml(cfg), tmp_path).retrieval.order_free_scopes == ("memory/*", "docs")
    for bad in ('["a*b"]', '[""]', '"docs"'):
        path.write_text(f'base = "default"\n[retrieval]\norder_free_scopes = {bad}\n')
        with pytest.raises(ConfigError, match="order_free_scopes"):
            load_config(path)
    with pytest.raises(ConfigError, match="unit_order"):
        parse_config({"retrieval": {"unit_order": "sorted"}})


def load_config_text(text: str, directory) -> object:  # type: ignore[no-untyped-def]
    path = directory / "dumped.toml"
    path.write_text(text)
    return load_config(path)
