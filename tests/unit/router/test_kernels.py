"""The C kernels and their pure-Python twins agree, op by op, on random input."""

from __future__ import annotations

import random
from array import array

import pytest

from router import Endpoint, EndpointLoad, _kernels
from router.hashing import block_hashes, block_hashes_view, py_chain_hashes

C = pytest.mark.skipif(_kernels.IMPLEMENTATION != "c", reason="router._kvcore is not built")


def as_view(keys: list[int]) -> memoryview:
    return memoryview(array("Q", keys)).cast("B").cast("Q")


@C
@pytest.mark.parametrize("workers", [3, 64, 65, 200])
def test_mask_table_twins_agree(workers):
    rng = random.Random(workers)
    for trial in range(150):
        a, b = _kernels.MaskTable(), _kernels.PyMaskTable()
        keys = [rng.getrandbits(64) for _ in range(rng.choice([5, 40, 3000]))]
        for _ in range(30):
            ks = [rng.choice(keys) for _ in range(rng.randrange(0, 20))]
            slot = rng.randrange(workers)
            arg = as_view(ks) if rng.random() < 0.5 else ks  # lists and uint64 buffers alike
            if rng.random() < 0.6:
                assert a.add(arg, slot) == b.add(ks, slot)
            else:
                a.remove(arg, slot)
                b.remove(ks, slot)
            assert len(a) == len(b)
        for k in keys:
            assert a.get(k) == b.get(k)
        for _ in range(10):
            hs = [rng.choice(keys) for _ in range(rng.randrange(0, 12))]
            assert a.match(hs) == a.match(as_view(hs)) == b.match(hs)


@C
@pytest.mark.parametrize("workers, also_workers", [(3, 3), (64, 70), (130, 10), (8, 200)])
def test_match_with_a_second_table_ors_the_masks(workers, also_workers):
    """match(keys, also): each key's mask is the OR of both tables' (tables of any widths); an empty or absent
    second table changes nothing; C and Python agree."""
    rng = random.Random(workers * 1000 + also_workers)
    for trial in range(100):
        a, b, pa, pb = _kernels.MaskTable(), _kernels.PyMaskTable(), _kernels.MaskTable(), _kernels.PyMaskTable()
        keys = [rng.getrandbits(64) for _ in range(rng.choice([5, 40]))]
        for table, twin, n in ((a, b, workers), (pa, pb, also_workers)):
            for _ in range(rng.randrange(0, 25)):
                ks = [rng.choice(keys) for _ in range(rng.randrange(0, 10))]
                slot = rng.randrange(n)
                table.add(ks, slot)
                twin.add(ks, slot)
        for _ in range(10):
            hs = [rng.choice(keys) for _ in range(rng.randrange(0, 12))]
            got = a.match(as_view(hs), pa)
            assert got == a.match(hs, pa) == b.match(hs, pb)
            masks = [a.get(h) | pa.get(h) for h in hs]  # the walk, from the OR'd masks
            want, active = [], masks[0] if masks else 0
            for k in range(1, len(hs)):
                if not active:
                    break
                kept = masks[k] & active
                if kept != active:
                    want.append((k, active & ~kept))
                    active = kept
            if hs and active:
                want.append((len(hs), active))
            assert got == want
            assert a.match(hs, _kernels.MaskTable()) == a.match(hs, None) == a.match(hs)
    with pytest.raises(TypeError):
        _kernels.MaskTable().match([1], {})


def test_mask_table_grows_and_deletes_without_losing_entries():
    t = _kernels.MaskTable()
    keys = list(range(1, 20_000))
    t.add(keys, 1)
    t.remove(keys[::2], 1)
    assert len(t) == len(keys[1::2]) and all(t.get(k) == 2 for k in keys[1::2]) and t.get(16) == 2 and t.get(15) == 0
    assert t.get(keys[0]) == 0 and t.nbytes > 0


@C
def test_packed_hashes_are_the_same_values():
    rng = random.Random(3)
    toks = [rng.randrange(2**32) for _ in range(1000)]
    want = block_hashes(toks, 16)
    assert list(block_hashes_view(toks, 16)) == want
    assert py_chain_hashes(toks, 16, packed=True) == array("Q", want).tobytes()
    with pytest.raises(TypeError):
        _kernels.MaskTable().match(memoryview(b"\x00" * 16))  # bytes, not uint64 items


@C
def test_rank_and_merge_twins_agree():
    rng = random.Random(5)
    for _ in range(300):
        eps = [Endpoint(worker_id=f"w{i}", url="u", model="m") for i in range(rng.randrange(1, 70))]
        scores = {ep.worker_id: rng.choice([0.0, 0.5, 1.0, rng.random()]) for ep in eps if rng.random() < 0.9}
        r = rng.getrandbits(62)
        assert _kernels.rank_by_score(scores, eps, r) == _kernels.py_rank_by_score(scores, eps, r)
        own = {ep.worker_id: EndpointLoad(inflight_requests=i) for i, ep in enumerate(eps) if rng.random() < 0.5}
        for ep in eps:
            ep.load = EndpointLoad(engine_waiting=rng.random(), engine_kv_usage=rng.random())
        twins = [[Endpoint(ep.worker_id, ep.url, ep.model, load=EndpointLoad(ep.load.inflight_requests, 0, 0, ep.load.engine_waiting,
                                                                                 ep.load.engine_kv_usage)) for ep in eps] for _ in range(2)]
        owns = [{k: EndpointLoad(v.inflight_requests) for k, v in own.items()} for _ in range(2)]
        _kernels.merge_loads(twins[0], owns[0])
        _kernels.py_merge_loads(twins[1], owns[1])
        assert [ep.load for ep in twins[0]] == [ep.load for ep in twins[1]]
        assert all(ep.load is owns[0][ep.worker_id] for ep in twins[0] if ep.worker_id in owns[0])


@C
def test_kv_rank_is_kv_scores_then_rank_by_score():
    """The fused kernel (Router.route's fast path) ranks exactly as the two steps, C and Python alike, and hands
    over the very scores kv_scores computes, in endpoint order."""
    rng = random.Random(9)
    for _ in range(400):
        eps = [Endpoint(worker_id=f"w{i}", url="u", model="m", block_size=rng.choice([16, 16, 32])) for i in range(rng.randrange(0, 140))]
        for ep in eps:  # equal loads now and then, so ties for first place are common
            ep.load = EndpointLoad(inflight_requests=rng.randrange(4), prefill_tokens=rng.choice([0, 0, rng.randrange(9000), 2.5]),
                                   active_blocks=rng.choice([0, rng.randrange(300)]))
        ov = {ep.worker_id: rng.randrange(1, 60) for ep in eps if rng.random() < 0.3}
        args = (eps, ov, rng.randrange(1, 5000), 16, rng.choice([1.0, 16.0]), rng.choice([1.0, 8.0]), rng.choice([0.0, 16.0]))
        r = rng.getrandbits(62)
        ranked, packed = _kernels.kv_rank(*args, r)
        py_ranked, py_packed = _kernels.py_kv_rank(*args, r)
        assert ranked == py_ranked and packed == py_packed
        if eps:
            scores = _kernels.kv_scores(*args)
            assert ranked == _kernels.rank_by_score(scores, eps, r)
            assert memoryview(packed).cast("d").tolist() == [scores[ep.worker_id] for ep in eps]
        else:
            assert ranked == [] and packed == b""
    with pytest.raises(ValueError):
        _kernels.kv_rank([Endpoint(worker_id="w", url="u", model="m", block_size=0)], {}, 10, 16, 1.0, 1.0, 0.0, 0)
    with pytest.raises(TypeError):
        _kernels.kv_rank((), {}, 10, 16, 1.0, 1.0, 0.0, 0)  # a list of endpoints, as Router.route passes
