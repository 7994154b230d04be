"""TimingModel and profiles: interpolation on known points, step composition, bundled profiles."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from workers.sim.profiles import BUNDLED, Profile, load_profile
from workers.sim.timing import TimingModel, interp, isotonic


def toy_profile() -> Profile:
    # prefill: T(0)=10 (extrapolated), slope 0.01 ms/token; decode rows at c=100 and c=1000
    return Profile(
        name="toy",
        prefill_isl=np.array([100.0, 1100.0, 2100.0]),
        prefill_ttft_ms=np.array([11.0, 21.0, 31.0]),
        decode_kv_usage=np.array([0.1, 0.5, 0.2, 0.6]),
        decode_context=np.array([100.0, 100.0, 1000.0, 1000.0]),
        decode_itl_ms=np.array([5.0, 9.0, 6.0, 14.0]),
        max_kv_tokens=10000,
        tp=1,
        block_size=16,
    )


@pytest.mark.parametrize(
    "x,xs,ys,extrapolate,expected",
    [
        (5, [0, 10], [0, 100], False, 50.0),
        (-5, [0, 10], [0, 100], False, 0.0),
        (-5, [0, 10], [0, 100], True, -50.0),
        (20, [0, 10, 15], [0, 100, 110], True, 120.0),
        (3, [3], [7], False, 7.0),
    ],
)
def test_interp(x, xs, ys, extrapolate, expected):
    assert interp(x, xs, ys, extrapolate) == pytest.approx(expected)


@pytest.mark.parametrize(
    "ys,expected",
    [([1, 2, 3], [1, 2, 3]), ([1, 5, 3, 4], [1, 4, 4, 4]), ([3, 1], [2, 2])],
)
def test_isotonic(ys, expected):
    assert isotonic(ys) == pytest.approx(expected)


@pytest.mark.parametrize(
    "chunks,expected_ms",
    [
        ([], 0.0),
        ([(0, 100)], 11.0),  # exactly the profile TTFT
        ([(0, 1100)], 21.0),
        ([(0, 600), (600, 500)], 21.0),  # two adjacent chunks in one pass telescope to TTFT(1100)
        ([(1000, 100)], 10.0 + 1.0),  # prefix hit of 1000 tokens: T0 + marginal
        ([(0, 100), (0, 100)], 10.0 + 2 * 1.0),  # two prompts batched: one fixed cost
        ([(0, 3100)], 41.0),  # extrapolated past the last point
    ],
)
def test_prefill_ms(chunks, expected_ms):
    assert TimingModel(toy_profile()).prefill_ms(chunks) == pytest.approx(expected_ms)


@pytest.mark.parametrize(
    "u,c,expected",
    [
        (0.1, 100, 5.0),  # on a point
        (0.3, 100, 7.0),  # along a row
        (0.05, 100, 5.0),  # clamped below the row
        (0.9, 1000, 14.0),  # clamped above the row
        (0.2, 550, 6.0),  # between rows: row100(0.2) = 6, row1000(0.2) = 6
        (0.4, 550, (8.0 + 10.0) / 2),  # row100(0.4) = 8, row1000(0.4) = 10, c halfway
        (0.4, 5000, 10.0),  # beyond the last row: the last row
    ],
)
def test_itl_bilinear(u, c, expected):
    assert TimingModel(toy_profile()).itl_ms(u, c) == pytest.approx(expected)


def test_decode_ms_uses_total_kv_over_profile_capacity_and_mean_context():
    t = TimingModel(toy_profile())
    # 4 sequences of 1000 tokens: u = 4000/10000 = 0.4 at c = 1000 -> 6 + (14-6)*(0.2/0.4) = 10
    assert t.decode_ms([1000] * 4) == pytest.approx(10.0)
    assert t.decode_ms([]) == 0.0


def test_step_ms_adds_parts_and_divides_by_speedup():
    t = TimingModel(toy_profile(), speedup=10)
    assert t.step_ms([(0, 100)], [1000] * 4) == pytest.approx((11.0 + 10.0) / 10)
    with pytest.raises(ValueError):
        TimingModel(toy_profile(), speedup=0)


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_profiles_load_and_reproduce_their_points(name):
    p = load_profile(name)
    t = TimingModel(p)
    assert p.max_kv_tokens > 0 and p.tp == BUNDLED[name][1]
    # decode: every measured point is reproduced exactly (it lies on its own row)
    for u, c, z in zip(p.decode_kv_usage, p.decode_context, p.decode_itl_ms):
        assert t.itl_ms(u, c) == pytest.approx(z)
    # prefill: the curve passes through the monotone (isotonic) fit of the measured points, which is
    # the points themselves wherever they already increase
    fit = isotonic(list(p.prefill_ttft_ms))
    for isl, ttft, f in zip(p.prefill_isl, p.prefill_ttft_ms, fit):
        assert t.ttft_ms(isl) == pytest.approx(f)
        if f == ttft:
            assert t.ttft_ms(isl) == pytest.approx(ttft)


def test_chunked_prompt_costs_exactly_its_ttft():
    t = TimingModel(toy_profile())
    assert t.prefill_ms([(0, 600)]) + t.prefill_ms([(600, 500)], starts_request=False) == pytest.approx(21.0)
    assert t.step_ms([(600, 500)], [], starts_request=False) == pytest.approx(5.0)


def test_unknown_profile_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile(str(tmp_path))


@pytest.mark.parametrize(
    "argv,profile,model,names",
    [
        ([], "h200-llama3.1-8b", "h200-llama3.1-8b", ["h200-llama3.1-8b"]),
        (["--model", "h100-llama3.3-70b-tp4"], "h100-llama3.3-70b-tp4", "h100-llama3.3-70b-tp4", ["h100-llama3.3-70b-tp4"]),
        (["--model", "meta-llama/x", "--served-model-name", "a", "b"], "h200-llama3.1-8b", "meta-llama/x", ["a", "b"]),
        (["some/model", "--profile", "h100-llama3.3-70b-tp8", "--enforce-eager"], "h100-llama3.3-70b-tp8", "some/model", ["some/model"]),
    ],
)
def test_cli_profile_and_model_resolution(argv, profile, model, names):
    from workers.sim.config import parse_args

    cfg = parse_args(argv)
    assert (cfg.profile, cfg.model, cfg.served_model_names) == (profile, model, names)


def test_cli_kv_events_config_like_vllm():
    from workers.sim.config import parse_args

    cfg = parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "t"}'])
    assert cfg.kv_events.publisher == "zmq" and cfg.kv_events.active and cfg.kv_events.buffer_steps == 10000
    assert not parse_args([]).kv_events.active and parse_args([]).kv_events.publisher == "null"


def test_new_tokens_pricing_is_the_mockers():
    """--prefill-pricing new-tokens: a step's prefill costs T(its new tokens), cached ones free (Dynamo's mocker);
    the default charges the marginal cost after the cached prefix, which grows with the context on a convex curve."""
    curved = dataclasses.replace(toy_profile(), prefill_ttft_ms=np.array([11.0, 21.0, 41.0]))  # slope 0.01 ms/token up to 1,100 tokens, then 0.02; T0 = 10
    tm, mock = TimingModel(curved), TimingModel(curved, prefill_pricing="new-tokens")
    assert tm.prefill_ms([(1100, 1000)]) == pytest.approx(10.0 + 20.0)  # T0 + T(2100) - T(1100)
    assert mock.prefill_ms([(1100, 1000)]) == pytest.approx(20.0)  # T(1000), the 1,100 cached tokens free
    assert mock.prefill_ms([(0, 2100)]) == pytest.approx(tm.prefill_ms([(0, 2100)])) == pytest.approx(41.0)  # no cache: equal
    assert mock.prefill_ms([(0, 600), (600, 500)], starts_request=False) == pytest.approx(21.0)  # T(600 + 500)
    assert mock.prefill_ms([]) == 0.0
    with pytest.raises(ValueError):
        TimingModel(curved, prefill_pricing="free")
    from workers.sim.config import parse_args
    assert parse_args(["--prefill-pricing", "new-tokens"]).prefill_pricing == "new-tokens"
    assert parse_args([]).prefill_pricing == "profile"
