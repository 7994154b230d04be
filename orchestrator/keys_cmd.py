"""`kvyard keys`: manage the inference API key file (orchestrator/security/keys.py).

    kvyard keys create --name team-a [--rpm 600] [--tpm 200000] [--priority high|normal|low] [--weight 2]
                                                                  prints the new key ONCE
    kvyard keys list                                              ids, names, limits, state (never keys)
    kvyard keys revoke <id>                                       the key stops working within ~1 s
    kvyard keys set-limits <id> [--rpm N|none] [--tpm N|none] [--priority P] [--weight W]

--priority is the key's admission class (high requests are admitted before normal, normal before low) and
--weight its share of admission slots against the other keys of its class when requests queue (default 1).

The file is --file, else $KVYARD_API_KEYS_FILE, else .kvyard/api-keys.yaml; it is written atomically,
mode 0600, and a running frontend (--api-keys-file) picks changes up without a restart. Every change
(create, revoke, set-limits) reads, edits and writes the file under an exclusive lock (flock on
`.<name>.lock` beside it), so concurrent commands never lose a key or undo a revocation.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from orchestrator.security.keys import KeyFile, KeyFileError, generate_key, load_key_file, save_key_file

__all__ = ["add_keys_parser", "run_keys_command", "default_keys_file"]


def default_keys_file() -> Path:
    return Path(os.environ.get("KVYARD_API_KEYS_FILE") or ".kvyard/api-keys.yaml")


def _limit(raw: str) -> int | None:
    if raw.lower() in ("none", "unlimited", "0"):
        return None
    value = int(raw)
    if value < 0:
        raise argparse.ArgumentTypeError("a limit is a positive integer, or none")
    return value


def _weight(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a weight is a number, got {raw!r}") from None
    if not 0 < value <= 1000:
        raise argparse.ArgumentTypeError("a weight is > 0 and <= 1000")
    return value


def add_keys_parser(sub) -> None:
    kp = sub.add_parser("keys", help="create, list and revoke inference API keys",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ks = kp.add_subparsers(dest="keys_command", required=True)
    for name, helptext in (("create", "create a key and print it once"), ("list", "list keys (never the keys themselves)"),
                           ("revoke", "revoke a key by id"), ("set-limits", "change a key's rate limits")):
        p = ks.add_parser(name, help=helptext)
        p.add_argument("--file", type=Path, default=None, help="key file (default $KVYARD_API_KEYS_FILE or .kvyard/api-keys.yaml)")
        if name == "create":
            p.add_argument("--name", default="", help="who the key is for (shown by list, in logs by id only)")
        if name in ("revoke", "set-limits"):
            p.add_argument("key_id", help="the key's id (12 hex characters, as `list` shows)")
        if name in ("create", "set-limits"):
            p.add_argument("--rpm", type=_limit, default=argparse.SUPPRESS if name == "set-limits" else None,
                           help="requests per minute (none: unlimited)")
            p.add_argument("--tpm", type=_limit, default=argparse.SUPPRESS if name == "set-limits" else None,
                           help="tokens per minute: prompt estimate + max_tokens (none: unlimited)")
            p.add_argument("--priority", choices=["high", "normal", "low"], default=argparse.SUPPRESS if name == "set-limits" else "normal",
                           help="admission class: high is admitted before normal, normal before low (default normal)")
            p.add_argument("--weight", type=_weight, default=argparse.SUPPRESS if name == "set-limits" else 1.0,
                           help="share of admission slots against the other keys of its class (default 1)")


def _open(path: Path, create: bool) -> KeyFile:
    if not path.exists():
        if create:
            return KeyFile()
        raise KeyFileError(f"{path}: no such key file (create a key first: kvyard keys create --file {path})")
    return load_key_file(path)


@contextmanager
def _locked(path: Path, exclusive: bool):
    """An advisory lock for a read-modify-write of the key file (a no-op for reads: writes are atomic renames)."""
    if not exclusive:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def run_keys_command(ns: argparse.Namespace) -> int:
    path = ns.file or default_keys_file()
    with _locked(path, exclusive=ns.keys_command != "list"):
        return _run(ns, path)


def _run(ns: argparse.Namespace, path: Path) -> int:
    try:
        kf = _open(path, create=ns.keys_command == "create")
        if ns.keys_command == "create":
            key, rec = generate_key(ns.name, ns.rpm, ns.tpm, existing={k.id for k in kf.keys}, priority=ns.priority, weight=ns.weight)
            kf.keys.append(rec)
            save_key_file(path, kf)
            print(f"created key {rec.id} ({rec.name or 'no name'}) in {path}; store it now, it is not shown again:", file=sys.stderr)
            print(key)  # alone on stdout, so `KEY=$(kvyard keys create ...)` works
            return 0
        if ns.keys_command == "list":
            print(f"{'id':12}  {'state':8}  {'rpm':>8}  {'tpm':>10}  {'priority':8}  {'weight':>6}  {'created (UTC)':20}  name")
            for k in kf.keys:
                created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(k.created_at)) if k.created_at else "-"
                print(f"{k.id:12}  {'revoked' if k.revoked_at else 'active':8}  {k.rpm or '-':>8}  {k.tpm or '-':>10}  {k.priority:8}  "
                      f"{k.weight:>6g}  {created:20}  {k.name}")
            return 0
        rec = next((k for k in kf.keys if k.id == ns.key_id), None)
        if rec is None:
            print(f"no key with id {ns.key_id} in {path}", file=sys.stderr)
            return 1
        if ns.keys_command == "revoke":
            if rec.revoked_at is None:
                rec.revoked_at = round(time.time(), 3)
            save_key_file(path, kf)
            print(f"revoked key {rec.id} ({rec.name or 'no name'}); frontends reading {path} refuse it within a second or two")
            return 0
        for field in ("rpm", "tpm", "priority", "weight"):
            if hasattr(ns, field):
                setattr(rec, field, getattr(ns, field))
        save_key_file(path, kf)
        print(f"key {rec.id}: rpm {rec.rpm or 'unlimited'}, tpm {rec.tpm or 'unlimited'}, priority {rec.priority}, weight {rec.weight:g}")
        return 0
    except KeyFileError as exc:
        print(f"kvyard keys: {exc}", file=sys.stderr)
        return 2
