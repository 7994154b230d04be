"""Router stages: session affinity and LoRA adapter affinity, driven with literals and a fake clock."""

from __future__ import annotations

import pytest

from router import Endpoint, EndpointLoad, RouteRequest, Router, build_policy
from router.plugins import AdapterAffinity, SessionAffinity


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def eps(n: int, inflight=(), adapters=None) -> list[Endpoint]:
    out = []
    for i in range(n):
        ld = EndpointLoad(inflight_requests=inflight[i] if i < len(inflight) else 0)
        out.append(Endpoint(worker_id=f"w{i}", url=f"http://w{i}", model="m", block_size=16, load=ld,
                            adapters=frozenset((adapters or {}).get(i, ()))))
    return out


def req(i: int, session: str | None = None, lora: str | None = None, tokens: list[int] | None = None) -> RouteRequest:
    return RouteRequest(request_id=f"r{i}", model="m", token_ids=tokens or list(range(40)), session_id=session, lora_name=lora)


def ids(ranked: list[Endpoint]) -> list[str]:
    return [e.worker_id for e in ranked]


def test_a_session_returns_to_its_worker_and_a_new_one_follows_the_policy():
    clock = Clock()
    aff = SessionAffinity(ttl_s=60, clock=clock)
    r = Router("round-robin", stages=[aff])
    first = r.route(req(0, "s1"), eps(3)).best.worker_id
    r.on_complete("r0")
    for i in range(1, 6):  # round-robin alone would rotate; the session stays
        assert r.route(req(i, "s1"), eps(3)).best.worker_id == first
        r.on_complete(f"r{i}")
    assert aff.outcomes["new"] == 1 and aff.outcomes["hit"] + aff.outcomes["kept"] == 5
    assert aff.pinned_per_worker() == {first: 1}


@pytest.mark.parametrize("gap,pinned_load,moves", [(4, 4, True), (4, 5, False), (0, 1, False), (0, 0, True)])
def test_load_wins_past_the_gap(gap, pinned_load, moves):
    clock = Clock()
    aff = SessionAffinity(ttl_s=60, max_load_gap=gap, clock=clock)
    aff.on_booked(req(0, "s"), eps(3)[2])
    ranked = eps(3, inflight=(0, 1, pinned_load))
    out = aff.rerank(req(1, "s"), ranked)
    assert ids(out) == (["w2", "w0", "w1"] if moves else ["w0", "w1", "w2"])
    assert aff.outcomes["overloaded"] == (0 if moves else 1)


def test_a_saturated_engine_is_overloaded_whatever_the_gap():
    aff = SessionAffinity(max_load_gap=100, saturation_kv_usage=0.9, clock=Clock())
    aff.on_booked(req(0, "s"), eps(2)[1])
    ranked = eps(2)
    ranked[1].load.engine_kv_usage, ranked[1].load.engine_waiting = 0.95, 1
    assert ids(aff.rerank(req(1, "s"), ranked)) == ["w0", "w1"]
    ranked[1].load.engine_waiting = 0  # full but nothing waiting: still fine
    assert ids(aff.rerank(req(1, "s"), ranked)) == ["w1", "w0"]


def test_pins_expire_slide_and_follow_failover_and_departures():
    clock = Clock()
    aff = SessionAffinity(ttl_s=10, clock=clock)
    r = Router("round-robin", stages=[aff])
    e = eps(3)
    aff.on_booked(req(0, "s"), e[1])
    clock.t += 9
    assert ids(aff.rerank(req(1, "s"), e))[0] == "w1"
    aff.on_booked(req(1, "s"), e[1])  # a turn slides the TTL
    clock.t += 9
    assert aff.pinned_worker("s") == "w1"
    clock.t += 2
    assert aff.pinned_worker("s") is None and aff.expire() == 1
    r.book(req(2, "s"), e[2])  # a failover books the next worker: the session follows it
    assert aff.pinned_worker("s") == "w2"
    r.remove_worker("w2")
    assert aff.pinned_worker("s") is None
    aff.on_booked(req(3, "s"), e[0])
    assert ids(aff.rerank(req(4, "s"), e[1:])) == ["w1", "w2"]  # its worker is not a candidate (breaker open)
    assert aff.outcomes["gone"] == 1


def test_the_session_table_is_bounded_lru():
    aff = SessionAffinity(max_sessions=2, clock=Clock())
    e = eps(1)
    for s in ("a", "b", "c"):
        aff.on_booked(req(0, s), e[0])
    assert len(aff) == 2 and aff.pinned_worker("a") is None and aff.pinned_worker("c") == "w0"


def test_kv_stays_the_tie_break_behind_the_pin():
    """The kv policy ranks by cost; the stage moves only the pinned worker forward, the rest keep the kv order."""
    tokens = list(range(64))

    def router(stages=()) -> Router:
        r = Router(build_policy("kv", seed=1), stages=list(stages))
        r.kv_index.store("w2", [11, 12], None, tokens[:32], 16)  # w2 caches the prompt's first 2 blocks
        r.kv_index.store("w1", [21], None, tokens[:16], 16)  # w1 its first block
        r.kv_index.add_worker("w0")  # w0 nothing
        return r

    plain = router().route(req(0, tokens=tokens), eps(3))
    assert ids(plain.ranked) == ["w2", "w1", "w0"]  # no session: the kv cost alone
    aff = SessionAffinity(max_load_gap=10, clock=Clock())
    aff.on_booked(req(0, "s"), eps(1)[0])  # the session is pinned on w0
    d = router([aff]).route(req(1, "s", tokens=tokens), eps(3))
    assert ids(d.ranked) == ["w0", "w2", "w1"]
    assert d.scores["w2"] > d.scores["w1"] > d.scores["w0"]


def test_adapter_holders_first_unless_overloaded():
    st = AdapterAffinity(max_load_gap=2)
    ranked = eps(4, inflight=(0, 1, 2, 5), adapters={2: {"a"}, 3: {"a"}})
    assert ids(st.rerank(req(0, lora="a"), ranked)) == ["w2", "w0", "w1", "w3"]  # w3 holds it but is 5 over the floor
    assert ids(st.rerank(req(0, lora="b"), ranked)) == ["w0", "w1", "w2", "w3"]  # nobody holds b
    assert ids(st.rerank(req(0), ranked)) == ["w0", "w1", "w2", "w3"]  # base model


def test_stages_run_in_order_and_book_the_final_first():
    aff = SessionAffinity(clock=Clock())
    r = Router("round-robin", stages=[AdapterAffinity(), aff])
    e = eps(3, adapters={1: {"a"}})
    d = r.route(req(0, "s", "a"), e)
    assert d.best.worker_id == "w1" and r.loads.load("w1").inflight_requests == 1
    assert aff.pinned_worker("s") == "w1"
