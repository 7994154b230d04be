"""Performance profiles (Dynamo profiler NPZ format) bundled with the sim, and how they are named.

A profile directory holds `prefill.npz` (`prefill_isl`, `prefill_ttft` in ms) and `decode.npz`
(`x_kv_usage`, `y_context_length`, `z_itl` in ms, `max_kv_tokens`). Arrays are either 1-D (one
configuration) or 2-D with one row per configuration; the row is picked by its `tp` value.

Bundled names (data: NVIDIA Dynamo, Apache-2.0, see PROFILES_LICENSE.md):

| name                    | GPU      | model                           | tp |
|-------------------------|----------|---------------------------------|----|
| h200-llama3.1-8b        | H200 SXM | nvidia/Llama-3.1-8B-Instruct-FP8 | 1  |
| h100-llama3.3-70b-tp2   | H100 SXM | nvidia/Llama-3.3-70B-Instruct-FP8 | 2 |
| h100-llama3.3-70b-tp4   | H100 SXM | nvidia/Llama-3.3-70B-Instruct-FP8 | 4 |
| h100-llama3.3-70b-tp8   | H100 SXM | nvidia/Llama-3.3-70B-Instruct-FP8 | 8 |

A path to any directory with the two files also works (its first row is used unless `tp` is given).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["BUNDLED", "DEFAULT_PROFILE", "PROFILES_DIR", "Profile", "load_profile"]

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "h200-llama3.1-8b"
_H200_8B = "h200_sxm/vllm/nvidia/Llama-3.1-8B-Instruct-FP8"
_H100_70B = "h100_sxm/vllm/nvidia/Llama-3.3-70B-Instruct-FP8"
#: name -> (directory under PROFILES_DIR, tp)
BUNDLED: dict[str, tuple[str, int]] = {
    "h200-llama3.1-8b": (_H200_8B, 1),
    "h100-llama3.3-70b-tp2": (_H100_70B, 2),
    "h100-llama3.3-70b-tp4": (_H100_70B, 4),
    "h100-llama3.3-70b-tp8": (_H100_70B, 8),
}


@dataclass(frozen=True)
class Profile:
    name: str
    prefill_isl: np.ndarray  # tokens, ascending
    prefill_ttft_ms: np.ndarray
    decode_kv_usage: np.ndarray  # fraction of max_kv_tokens
    decode_context: np.ndarray  # tokens
    decode_itl_ms: np.ndarray
    max_kv_tokens: int
    tp: int
    block_size: int  # the block size the profile was measured with (informational)


def _row(arr: np.ndarray, idx: int) -> np.ndarray:
    a = np.asarray(arr)
    if a.ndim == 0:
        return a.reshape(1)
    return a[idx] if a.ndim == 2 else a


def _scalar(npz: np.lib.npyio.NpzFile, key: str, idx: int, default: int) -> int:
    if key not in npz.files:
        return default
    return int(np.asarray(_row(npz[key], idx)).reshape(-1)[0])


def _max_kv_tokens(npz: np.lib.npyio.NpzFile, idx: int, directory: Path) -> int:
    value = _scalar(npz, "max_kv_tokens", idx, 0)
    if value <= 0:
        raise ValueError(f"{directory}/decode.npz has no positive max_kv_tokens")
    return value


def _row_index(npz: np.lib.npyio.NpzFile, tp: int | None) -> int:
    if tp is None or "tp" not in npz.files:
        return 0
    tps = np.asarray(npz["tp"]).reshape(-1)
    matches = np.nonzero(tps == tp)[0]
    if len(matches) == 0:
        raise ValueError(f"profile has no tp={tp} row (has {sorted(set(tps.tolist()))})")
    return int(matches[0])


def load_profile(name_or_path: str, tp: int | None = None) -> Profile:
    """Load a bundled profile by name, or a profile directory by path."""
    if name_or_path in BUNDLED:
        sub, tp = BUNDLED[name_or_path]
        directory = PROFILES_DIR / sub
    else:
        directory = Path(name_or_path)
        if not (directory / "prefill.npz").is_file() or not (directory / "decode.npz").is_file():
            known = ", ".join(sorted(BUNDLED))
            raise ValueError(f"unknown profile {name_or_path!r}: not a bundled name ({known}) nor a directory with prefill.npz and decode.npz")
    with np.load(directory / "prefill.npz") as pre, np.load(directory / "decode.npz") as dec:
        pi, di = _row_index(pre, tp), _row_index(dec, tp)
        isl = _row(pre["prefill_isl"], pi).astype(float)
        ttft = _row(pre["prefill_ttft"], pi).astype(float)
        order = np.argsort(isl)
        x = _row(dec["x_kv_usage"], di).astype(float)
        y = _row(dec["y_context_length"], di).astype(float)
        z = _row(dec["z_itl"], di).astype(float)
        ok = np.isfinite(x) & np.isfinite(y) & np.isfinite(z)
        return Profile(
            name=name_or_path,
            prefill_isl=isl[order],
            prefill_ttft_ms=ttft[order],
            decode_kv_usage=x[ok],
            decode_context=y[ok],
            decode_itl_ms=z[ok],
            max_kv_tokens=_max_kv_tokens(dec, di, directory),
            tp=_scalar(dec, "tp", di, tp or 1),
            block_size=_scalar(dec, "block_size", di, 16),
        )
