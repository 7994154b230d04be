"""TelemetryFlusher through a store outage: batches kept in memory (bounded, oldest dropped and counted),
the request path never blocked, everything kept flushed on the first round after the store is back."""

from __future__ import annotations

import time

from planner.telemetry import InMemoryTelemetryStore, TelemetryAggregator, TelemetrySchema, TelemetryUnavailableError
from planner.telemetry.flusher import TelemetryFlusher


class FlakyStore(InMemoryTelemetryStore):
    def __init__(self, schema: TelemetrySchema) -> None:
        super().__init__(schema)
        self.down = False
        self.writes = 0

    async def write(self, batch) -> None:
        if self.down:
            raise TelemetryUnavailableError("redis unavailable: connection refused")
        self.writes += 1
        await super().write(batch)


async def test_outage_buffers_bounded_then_flushes_on_reconnect():
    schema = TelemetrySchema(bucket_s=1)
    base = float(int(time.time()) - 30)  # recent: the store keeps only its retention
    clock = [base]
    agg = TelemetryAggregator(schema, clock=lambda: clock[0], max_pending_buckets=5)
    store = FlakyStore(schema)
    flusher = TelemetryFlusher(agg, store)
    store.down = True
    for second in range(8):  # 8 one-second buckets while the store is down; the bound keeps 5
        clock[0] = base + second
        agg.record_request("m", ttft_s=0.1, duration_s=0.2, isl=10, osl=3)
        assert await flusher.flush() is False
    assert not flusher.store_ok and agg.pending == 5 and agg.dropped_buckets == 3
    store.down = False
    assert await flusher.flush() is True and flusher.store_ok and agg.pending == 0
    buckets = await store.read_pool_buckets(base - 10, base + 10)
    (series,) = buckets.values()
    assert [b.start - base for b in series] == [3.0, 4.0, 5.0, 6.0, 7.0]  # the newest five, oldest dropped
    assert sum(b.requests for b in series) == 5 and store.writes == 1
