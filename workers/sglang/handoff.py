"""SGLang's P/D hand-off (as the sgl-model-gateway PD router and Dynamo do it).

One body goes to the prefill and the decode engine at the same time:
    the client's body + bootstrap_host (the prefill engine's host), bootstrap_port (its
    --disaggregation-bootstrap-port), bootstrap_room (random in 0..2**63-1, pairs the two sides)
The decode engine waits on the prefill engine's bootstrap server for that room and pulls the KV;
the client gets the decode engine's response. A failed prefill cancels the decode request.
Pure functions; the frontend does the I/O.
"""

from __future__ import annotations

import random

__all__ = ["BOOTSTRAP_FIELDS", "DEFAULT_BOOTSTRAP_PORT", "new_room", "bootstrap_body"]

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's default --disaggregation-bootstrap-port

_rng = random.SystemRandom()


def new_room(rng: random.Random | None = None) -> int:
    """A bootstrap room: uniform in 0..2**63-1 (the gateway's `rand::<u64>() & i64::MAX`)."""
    return (rng or _rng).randint(0, 2**63 - 1)


def bootstrap_body(body: dict, host: str, port: int, room: int) -> dict:
    """The one body both engines get."""
    return {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
