"""The router's own exceptions.

    RouterError
     ├─ BlockHashError (also ValueError)   token ids not uint32, or a block size below 1
     └─ KvEventRejected                    an event the index cannot apply (bad lengths, unknown
                                           parent); the index is unchanged, the caller logs and skips
    NoEndpointsError (LookupError, in router.router)  no live endpoint serves the model
"""

from __future__ import annotations

__all__ = ["RouterError", "BlockHashError", "KvEventRejected"]


class RouterError(Exception):
    """Base of the router's exceptions."""


class BlockHashError(RouterError, ValueError):
    """Token ids cannot be hashed (not ints in [0, 2^32), or block_size < 1)."""


class KvEventRejected(RouterError):
    """A KV event was not applied; the index is exactly as before the call."""
