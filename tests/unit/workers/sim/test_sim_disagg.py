"""P/D disaggregation in the sim: per-flavor request validation, the transfer model, the scheduler's
hold / remote-load states, and the side channel's hold, pull, abort, heartbeat and expiry."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
import zmq.asyncio

from router.kv_events import BlockStored
from workers.sim.config import parse_args
from workers.sim.disagg import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    DisaggRuntime,
    Handoff,
    KvSideChannel,
    KvTransferConfig,
    KvTransferModel,
    RemoteSource,
    decode_opaque_state,
    default_kv_bytes_per_token,
    encode_opaque_state,
    side_channel_call,
    sglang_bootstrap,
    vllm_missing_fields,
    vllm_role,
)
from workers.sim.kv_manager import KvBlockManager
from workers.sim.scheduler import Scheduler, SimRequest

FULL_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]], "remote_engine_id": "e",
               "remote_request_id": "r", "remote_host": "localhost", "remote_port": 5600, "tp_size": 1}


# ---- sizes and times ------------------------------------------------------------------------------

def test_kv_bytes_per_token_from_the_model_geometry():
    assert default_kv_bytes_per_token("h200-llama3.1-8b") == 32 * 8 * 128 * 2 * 2 == DEFAULT_KV_BYTES_PER_TOKEN == 131072
    assert default_kv_bytes_per_token("h100-llama3.3-70b-tp4") == 80 * 8 * 128 * 2 * 2


def test_transfer_time_is_bytes_over_bandwidth_plus_latency_scaled_by_speedup():
    m = KvTransferModel(bandwidth_gbps=25.0, bytes_per_token=131072, latency_ms=1.0)
    assert m.seconds(1000) == pytest.approx(0.001 + 1000 * 131072 / 25e9)
    assert KvTransferModel(25.0, 131072, 1.0, speedup=10).seconds(1000) == pytest.approx(m.seconds(1000) / 10)
    assert m.seconds(0) == pytest.approx(0.001)


def test_cli_flags_per_flavor():
    cfg = parse_args([])
    assert cfg.flavor == "vllm" and not cfg.disagg_enabled  # today's behaviour
    cfg = parse_args(["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both",'
                      '"kv_load_failure_policy":"recompute","kv_connector_extra_config":{"kv_lease_duration":7}}'],
                     env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "6000"})
    assert cfg.disagg_enabled and cfg.kv_transfer is not None and cfg.kv_transfer.lease_s == 7
    assert cfg.kv_transfer.kv_load_failure_policy == "recompute" and cfg.kv_transfer.engine_id
    assert (cfg.side_channel_host, cfg.side_channel_port) == ("127.0.0.1", 6000)
    assert not parse_args(["--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1"}']).disagg_enabled
    cfg = parse_args(["--flavor", "sglang", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9100"])
    assert cfg.disagg_enabled and cfg.side_channel_port == 9100
    assert not parse_args(["--flavor", "sglang"]).disagg_enabled
    cfg = parse_args(["--flavor", "trtllm", "--kv-transfer-bandwidth-gbps", "50", "--kv-bytes-per-token", "1000"])
    assert cfg.disagg_enabled and cfg.side_channel_port == 0 and cfg.kv_transfer_bandwidth_gbps == 50
    with pytest.raises(SystemExit):
        parse_args(["--kv-transfer-bandwidth-gbps", "0"])


# ---- per-flavor validation ------------------------------------------------------------------------

def test_vllm_roles_and_required_decode_fields():
    assert vllm_role({"do_remote_decode": True, "do_remote_prefill": False}) == "prefill"
    assert vllm_role(FULL_PARAMS) == "decode"
    assert vllm_role({}) is None and vllm_role(None) is None
    assert vllm_missing_fields(FULL_PARAMS) == []
    assert vllm_missing_fields({**FULL_PARAMS, "remote_block_ids": []}) == ["remote_block_ids"]
    partial = {k: v for k, v in FULL_PARAMS.items() if k not in ("remote_request_id", "tp_size")}
    assert vllm_missing_fields(partial) == ["remote_request_id", "tp_size"]


def _runtime(flavor: str, **kw) -> DisaggRuntime:
    return DisaggRuntime(flavor, transfer=KvTransferModel(), side_host="127.0.0.1", side_port=0, lease_s=30, timeout_s=5,
                         serve=False, **kw)


def test_vllm_classify_marks_invalid_params_failed_per_policy():
    rt = _runtime("vllm", kv_transfer=KvTransferConfig(kv_connector="NixlConnector"))
    h = rt.classify({"kv_transfer_params": {"do_remote_decode": True}})
    assert isinstance(h, Handoff) and h.role == "prefill" and h.max_tokens is None
    h = rt.classify({"kv_transfer_params": FULL_PARAMS})
    assert isinstance(h, Handoff) and h.remote is not None and h.remote.state == "pending" and h.remote.key == "r"
    assert not h.remote.recompute_on_failure and h.remote_cached_tokens is None
    h = rt.classify({"kv_transfer_params": {**FULL_PARAMS, "remote_prefill_cached_tokens": 32}})
    assert isinstance(h, Handoff) and h.remote_cached_tokens == 32  # reported as the decode's cached tokens
    h = rt.classify({"kv_transfer_params": {"do_remote_prefill": True}})
    assert isinstance(h, Handoff) and h.remote is not None and h.remote.state == "failed" and "remote_request_id" in (h.remote.error or "")
    rt = _runtime("vllm", kv_transfer=KvTransferConfig(kv_connector="NixlConnector", kv_load_failure_policy="recompute"))
    h = rt.classify({"kv_transfer_params": FULL_PARAMS})
    assert isinstance(h, Handoff) and h.remote is not None and h.remote.recompute_on_failure
    assert rt.classify({"prompt": "x"}) is None


def test_vllm_prefill_response_fields():
    rt = _runtime("vllm", kv_transfer=KvTransferConfig(kv_connector="NixlConnector", engine_id="eng"))
    ktp = rt.prefill_extras("req-1", Handoff("prefill", key="req-1"), [5, 6, 7], 40, 16, [9])["kv_transfer_params"]
    assert ktp == {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[5, 6, 7]], "remote_engine_id": "eng",
                   "remote_request_id": "req-1", "remote_host": "127.0.0.1", "remote_port": 0, "tp_size": 1, "dcp_size": 1,
                   "pp_size": 1, "remote_num_tokens": 40, "remote_blocks_expiry_time": None, "transfer_mode": "pull",
                   "remote_prefill_cached_tokens": 16}


def test_sglang_bootstrap_fields():
    assert sglang_bootstrap({"bootstrap_host": "h", "bootstrap_port": 8998, "bootstrap_room": 5}) == ("h", 8998, 5)
    assert sglang_bootstrap({"bootstrap_host": ["h"], "bootstrap_port": [8998], "bootstrap_room": [2**63 - 1]}) == ("h", 8998, 2**63 - 1)
    assert sglang_bootstrap({}) == ["bootstrap_host", "bootstrap_port", "bootstrap_room"]
    assert sglang_bootstrap({"bootstrap_host": "h", "bootstrap_port": True, "bootstrap_room": -1}) == ["bootstrap_port", "bootstrap_room"]
    rt = _runtime("sglang", sglang_mode="decode")
    h = rt.classify({"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 3})
    assert isinstance(h, Handoff) and h.role == "decode" and h.remote is not None and h.remote.wait_s == 5 and h.remote.key == "3"
    assert rt.classify({}) == ["bootstrap_host", "bootstrap_port", "bootstrap_room"]
    h = _runtime("sglang", sglang_mode="prefill").classify({"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 3})
    assert isinstance(h, Handoff) and h.role == "prefill" and h.key == "3" and h.max_tokens == 1
    assert _runtime("sglang", sglang_mode="null").classify({}) is None


def test_trtllm_opaque_state_and_request_types():
    s = encode_opaque_state({"host": "127.0.0.1", "port": 7, "ctx_request_id": 11})
    assert decode_opaque_state(s)["ctx_request_id"] == 11
    for bad in (None, "", "not base64!", base64.b64encode(b"{}").decode(), base64.b64encode(json.dumps({"magic": "x"}).encode()).decode()):
        with pytest.raises(ValueError):
            decode_opaque_state(bad)
    rt = _runtime("trtllm")
    ctx = rt.classify({"disaggregated_params": {"request_type": "context_only", "disagg_request_id": 4}})
    assert isinstance(ctx, Handoff) and ctx.role == "prefill" and ctx.max_tokens == 1 and isinstance(ctx.ctx_request_id, int)
    dp = rt.prefill_extras("k", ctx, [1], 20, 0, [77])["disaggregated_params"]
    assert dp["request_type"] == "context_only" and dp["first_gen_tokens"] == [77] and dp["ctx_request_id"] == ctx.ctx_request_id
    assert dp["disagg_request_id"] == 4 and decode_opaque_state(dp["encoded_opaque_state"])["num_tokens"] == 20
    gen = rt.classify({"disaggregated_params": {**dp, "request_type": "generation_only"}})
    assert isinstance(gen, Handoff) and gen.role == "decode" and gen.remote is not None and gen.remote.key == str(ctx.ctx_request_id)
    missing = rt.classify({"disaggregated_params": {"request_type": "generation_only"}})
    assert isinstance(missing, list) and missing[0].startswith("disaggregated_params.encoded_opaque_state")
    assert isinstance(rt.classify({"disaggregated_params": {**dp, "request_type": "generation_only", "ctx_request_id": 1}}), list)
    assert isinstance(rt.classify({"disaggregated_params": {"request_type": "bogus"}}), list)
    assert rt.classify({"disaggregated_params": {"request_type": "context_and_generation"}}) is None
    assert rt.classify({}) is None


# ---- scheduler states -----------------------------------------------------------------------------

def _sched(num_blocks: int = 64) -> Scheduler:
    return Scheduler(KvBlockManager(num_blocks, 16, enable_events=True), max_num_batched_tokens=512)


def _run(s: Scheduler, req: SimRequest) -> None:
    while req.request_id in s.requests:
        plan = s.schedule()
        s.update_from_output(plan)


def test_prefill_holds_blocks_until_released():
    s = _sched()
    req = SimRequest("p", list(range(40)), max_tokens=1, hold_blocks=True)
    s.add_request(req)
    _run(s, req)
    assert "p" in s.held and len(s.kv.req_blocks["p"]) == 3 and s.kv.usage > 0
    assert s.release_held("p") and not s.release_held("p")
    assert s.kv.usage == 0


def test_remote_decode_waits_deferred_then_loads_and_decodes():
    s = _sched()
    s.kv.take_events()
    req = SimRequest("d", list(range(40)), max_tokens=3, remote=object())
    s.add_request(req)
    plan = s.schedule()
    assert not plan and plan.remote_loads == [(req, 0)] and req.kv_load == "loading"
    assert len(s.kv.req_blocks["d"]) == 3 and s.kv.take_events() == []  # allocated, nothing cached yet
    assert not s.has_work and s.num_loading == 1 and len(s.waiting) == 1  # waiting (deferred), nothing to run
    assert not s.schedule()
    assert s.finish_remote_load("d", ok=True) is None
    events = s.kv.take_events()
    assert len(events) == 1 and isinstance(events[0], BlockStored) and len(events[0].block_hashes) == 2  # 2 full blocks arrived
    plan = s.schedule()
    assert plan.decode_contexts == [40] and not plan.prefill_chunks and not plan.starts_prefill  # last token: a decode step
    assert s.external_tokens == 40
    s.update_from_output(plan)
    assert req.output_token_ids and req.status.value == "running"


def test_remote_decode_failure_fails_or_recomputes():
    s = _sched()
    req = SimRequest("d", list(range(40)), max_tokens=3, remote=object())
    s.add_request(req)
    s.schedule()
    failed = s.finish_remote_load("d", ok=False)
    assert failed is req and req.finish_reason == "error" and s.kv.usage == 0 and not s.waiting
    req2 = SimRequest("r", list(range(40)), max_tokens=3, remote=object())
    s.add_request(req2)
    s.schedule()
    assert s.finish_remote_load("r", ok=False, recompute=True) is None
    plan = s.schedule()
    assert plan.prefill_chunks == [(0, 40)] and plan.starts_prefill  # prefilled locally


def test_abort_while_loading_frees_blocks():
    s = _sched()
    s.add_request(SimRequest("d", list(range(40)), max_tokens=3, remote=object()))
    s.schedule()
    assert s.abort("d") is not None and s.num_loading == 0 and s.kv.usage == 0
    assert s.finish_remote_load("d", ok=True) is None  # a late completion is ignored


# ---- the side channel -----------------------------------------------------------------------------

def test_side_channel_pull_done_abort_heartbeat_expiry():
    async def main() -> None:
        released: list[str] = []
        ch = KvSideChannel("127.0.0.1", 0, lambda k: released.append(k) or True, lease_s=0.3)
        ch.start()
        ctx = zmq.asyncio.Context()
        call = lambda msg, t=2.0: side_channel_call(ctx, "127.0.0.1", ch.port, msg, t)  # noqa: E731
        try:
            assert (await call({"op": "pull", "key": "nope"}))["ok"] is False
            ch.expect("a", "req-a")
            ch.on_held("req-a", 40)
            assert await call({"op": "pull", "key": "a"}) == {"ok": True, "num_tokens": 40}
            assert (await call({"op": "done", "key": "a"}))["ok"] and released == ["req-a"]
            assert (await call({"op": "pull", "key": "a"}))["ok"] is False  # already read
            ch.expect("b", "req-b")
            ch.on_held("req-b", 8)
            await call({"op": "abort", "key": "b"})
            assert released[-1] == "req-b"
            ch.expect("c", "req-c")
            ch.on_held("req-c", 8)
            for _ in range(4):  # heartbeats keep it past its 0.3 s lease
                await asyncio.sleep(0.15)
                await call({"op": "heartbeat", "keys": ["c"]})
            assert "req-c" not in released
            await asyncio.sleep(0.5)
            assert released[-1] == "req-c" and ch.stats["expired"] == 1
            # SGLang: the decode asks before the prefill finished, and gets it once it does
            ch.expect("room", "req-r")
            pull = asyncio.ensure_future(call({"op": "pull", "key": "room", "wait_s": 2.0}, 4.0))
            await asyncio.sleep(0.1)
            ch.on_held("req-r", 16)
            assert (await pull)["ok"]
            # ... or learns that it failed
            ch.expect("room2", "req-r2")
            pull = asyncio.ensure_future(call({"op": "pull", "key": "room2", "wait_s": 2.0}, 4.0))
            await asyncio.sleep(0.1)
            ch.on_failed("req-r2", "abort")
            reply = await pull
            assert not reply["ok"] and "abort" in reply["error"]
            # ... or times out when it never comes
            assert not (await call({"op": "pull", "key": "room3", "wait_s": 0.2}, 2.0))["ok"]
            assert "room3" not in ch.entries
            # nobody listening: an answer within the timeout, not a hang
            reply = await side_channel_call(ctx, "127.0.0.1", 1, {"op": "pull", "key": "x"}, 0.2)
            assert not reply["ok"]
        finally:
            await ch.close()
            ctx.term()

    asyncio.run(main())


def test_runtime_load_pulls_waits_and_reports_failure():
    async def main() -> None:
        released: list[str] = []
        p = DisaggRuntime("trtllm", transfer=KvTransferModel(), side_host="127.0.0.1", side_port=0, lease_s=5, timeout_s=5,
                          release=lambda k: released.append(k) or True)
        d = DisaggRuntime("trtllm", transfer=KvTransferModel(bandwidth_gbps=1.0, latency_ms=0.0), side_host="127.0.0.1",
                          side_port=0, lease_s=5, timeout_s=5, serve=False)
        p.start()
        d.start()
        try:
            h = Handoff("prefill", key="9", max_tokens=1, ctx_request_id=9)
            p.submitted("eng-9", h)
            assert p.on_held("eng-9", 100)
            src = RemoteSource("127.0.0.1", p.side_port, "9")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            assert await d.load(src, 100, 0)
            assert loop.time() - t0 >= 100 * 131072 / 1e9 and src.state == "done" and src.loaded_tokens == 100
            await asyncio.sleep(0.05)
            assert released == ["eng-9"]
            again = RemoteSource("127.0.0.1", p.side_port, "9")
            assert not await d.load(again, 100, 0) and again.state == "failed" and "no KV held" in (again.error or "")
            p.submitted("eng-10", Handoff("prefill", key="10", max_tokens=1, ctx_request_id=10))
            p.on_held("eng-10", 50)
            wrong = RemoteSource("127.0.0.1", p.side_port, "10")
            assert not await d.load(wrong, 60, 0) and "covers 50 tokens" in (wrong.error or "")
            await asyncio.sleep(0.05)
            assert released[-1] == "eng-10"  # a mismatched pull gives the blocks back
        finally:
            await d.close()
            await p.close()

    asyncio.run(main())


# ---- the other flavors' observability -------------------------------------------------------------

def test_sglang_events_are_split_per_page_and_round_trip():
    from router.kv_events import BlockRemoved
    from workers.sglang.kv_events import decode_payload, encode_batch
    from workers.sim.flavors import split_per_page

    ev = BlockStored([2**64 - 5, 7, 9], None, list(range(48)), 16, medium="GPU")
    pages = split_per_page([ev, BlockRemoved([3], medium="GPU")])
    assert [p.block_hashes for p in pages[:3]] == [[2**64 - 5], [7], [9]]
    assert [p.parent_block_hash for p in pages[:3]] == [None, 2**64 - 5, 7] and pages[1].token_ids == list(range(16, 32))
    back = decode_payload(encode_batch(1.0, pages, dp_rank=0)).events
    assert [e.block_hashes for e in back] == [[2**64 - 5], [7], [9], [3]]  # signed on the wire, unsigned again


def test_trtllm_event_buffer_and_iteration_stats():
    from workers.sim.flavors import TrtllmEventBuffer, TrtllmIterationStats
    from workers.trtllm.kv_events import decode_events, encode_events

    buf = TrtllmEventBuffer(maxlen=2)
    buf.publish([BlockStored([1], None, list(range(16)), 16), BlockStored([2], 1, list(range(16, 32)), 16),
                 BlockStored([3], 2, list(range(32, 48)), 16)])
    drained = buf.drain()
    assert [eid for eid, _ in drained] == [1, 2] and buf.drain() == []  # the oldest dropped: a gap at 0
    batches = decode_events(encode_events(drained))
    assert [b.seq for b in batches] == [1, 2] and batches[1].events[0].parent_block_hash == 2
    gauges = {"num_requests_running": 2.0, "num_requests_waiting": 1.0, "kv_cache_usage_perc": 0.5,
              "prefix_cache_queries": 64.0, "prefix_cache_hits": 32.0}
    stats = TrtllmIterationStats(lambda: gauges, num_blocks=101, block_size=16, max_num_seqs=8)
    stats.record(12.5, 1, 2, 100, 1)
    (s,) = stats.drain()
    assert s["iter"] == 0 and s["numActiveRequests"] == 2 and s["kvCacheStats"]["usedNumBlocks"] == 50
    assert s["kvCacheStats"]["cacheHitRate"] == 0.5 and s["inflightBatchingStats"]["numCtxTokens"] == 100
    assert stats.drain() == []


def test_sim_backend_reads_every_flavors_metrics():
    from workers.sim.backend import SimBackend

    b = SimBackend()
    sg = ('sglang:num_running_reqs{engine_type="decode",model_name="m",tp_rank="0"} 3.0\n'
          'sglang:num_queue_reqs{engine_type="decode",model_name="m",tp_rank="0"} 1.0\n'
          'sglang:num_decode_transfer_queue_reqs{engine_type="decode",model_name="m",tp_rank="0"} 2.0\n'
          'sglang:token_usage{engine_type="decode",model_name="m",tp_rank="0"} 0.25\n'
          'sglang:prompt_tokens_total{engine_type="decode",model_name="m",tp_rank="0"} 100.0\n'
          'sglang:cached_tokens_total{engine_type="decode",model_name="m",tp_rank="0"} 40.0\n'
          'sglang:generation_tokens_total{engine_type="decode",model_name="m",tp_rank="0"} 7.0\njunk line\n')
    m = b.parse_metrics(sg)
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (3.0, 3.0, 0.25)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.generation_tokens) == (100.0, 40.0, 7.0)
    stats = json.dumps([{"numActiveRequests": 1}, {"numActiveRequests": 4, "numQueuedRequests": 2,
                                                     "kvCacheStats": {"maxNumBlocks": 100, "usedNumBlocks": 30}}])
    m = b.parse_metrics(stats)
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (4.0, 2.0, 0.3)
    assert b.parse_metrics("[]").num_requests_running == 0 and b.parse_metrics("[not json").kv_cache_usage == 0
    assert b.parse_metrics('vllm:num_requests_running{engine="0",model_name="m"} 5.0\n').num_requests_running == 5.0
