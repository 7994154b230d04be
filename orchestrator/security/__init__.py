"""Security of the frontend: API keys and rate limits for inference, the admin token for the operator
surfaces, TLS, and log redaction. See each module's header; `kvyard keys` manages the key file."""

from orchestrator.security.guards import AdminGuard, InferenceGuard, bearer_token, is_loopback, presented_key
from orchestrator.security.keys import (
    KEY_PREFIX,
    KeyFile,
    KeyFileError,
    KeyRecord,
    KeyStore,
    Principal,
    generate_key,
    hash_key,
    key_id_of,
    load_key_file,
    save_key_file,
)
from orchestrator.security.ratelimit import Grant, RateLimiter, TokenBucket, estimate_tokens
from orchestrator.security.ratelimit_redis import RedisRateLimiter
from orchestrator.security.redact import install_redaction, redact, register_secret
from orchestrator.security.tls import TlsConfigError, TlsFiles

__all__ = [
    "AdminGuard", "InferenceGuard", "bearer_token", "is_loopback", "presented_key",
    "KEY_PREFIX", "KeyFile", "KeyFileError", "KeyRecord", "KeyStore", "Principal", "generate_key", "hash_key", "key_id_of",
    "load_key_file", "save_key_file",
    "Grant", "RateLimiter", "RedisRateLimiter", "TokenBucket", "estimate_tokens",
    "install_redaction", "redact", "register_secret",
    "TlsConfigError", "TlsFiles",
]
