"""Block hashing: golden values, C and Python twins agree, LoRA seeds, chaining, errors."""

from __future__ import annotations

import random
import struct
from array import array

import numpy as np
import pytest
import xxhash

from router import BlockHashError, block_hashes
from router import hashing
from router.hashing import BASE_SEED, lora_seed, py_chain_hashes


def reference(tokens: list[int], bs: int, seed: int = 1337, parent: int | None = None) -> list[int]:
    """Dynamo's block hash (lib/kv-router/src/protocols.rs) written out the slow, obvious way."""
    out, prev = [], parent
    for i in range(len(tokens) // bs):
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{bs}I", *tokens[i * bs:(i + 1) * bs]), seed)
        prev = local if prev is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, local), 1337)
        out.append(prev)
    return out


@pytest.mark.parametrize(
    "tokens, bs, kwargs, expected",
    [
        (list(range(32)), 16, {}, [15310707395893867146, 13769157705258532664]),
        (list(range(32)), 16, {"lora_name": "sql-adapter"}, [14536852851305923245, 8425625934314863947]),
        # continuing after block 0's hash gives block 1's hash of the whole prompt
        (list(range(16, 32)), 16, {"parent": 15310707395893867146}, [13769157705258532664]),
        ([0] * 4 + [2**32 - 1] * 4, 4, {}, [13277122834585657784, 18181746249547481049]),
        (list(range(47)), 16, {}, [15310707395893867146, 13769157705258532664]),  # 2 full blocks; 15 tokens left over
        ([], 16, {}, []),
        (list(range(15)), 16, {}, []),  # a partial block is never hashed
    ],
)
def test_golden_values(impl, tokens, bs, kwargs, expected):
    got = block_hashes(tokens, bs, **kwargs)
    assert got == expected
    seed = lora_seed(kwargs.get("lora_name"))
    assert got == reference(tokens, bs, seed, kwargs.get("parent"))


def test_lora_seed():
    assert lora_seed(None) == lora_seed("") == BASE_SEED == 1337
    assert lora_seed("sql-adapter") == (1337 + xxhash.xxh3_64_intdigest(b"sql-adapter")) % 2**64 == 9867606577583457700


@pytest.mark.parametrize("n, bs", [(0, 1), (1, 1), (63, 16), (64, 16), (4096, 16), (4096, 32), (1000, 7), (2048, 600)])
def test_c_and_python_agree(n, bs):
    rng = random.Random(n * 31 + bs)
    tokens = [rng.randrange(2**32) for _ in range(n)]
    for seed in (1337, lora_seed("x")):
        for parent in (None, 0, 2**64 - 1):
            want = reference(tokens, bs, seed, parent)
            assert py_chain_hashes(tokens, bs, seed, parent) == want
            assert hashing._chain_hashes(tokens, bs, seed, parent) == want


@pytest.mark.parametrize("make", [list, tuple, lambda t: array("I", t), lambda t: np.asarray(t, dtype=np.uint32)])
def test_accepts_lists_tuples_and_uint32_buffers(impl, make):
    tokens = list(range(100, 164))
    assert block_hashes(make(tokens), 16) == reference(tokens, 16)


@pytest.mark.parametrize(
    "tokens, bs",
    [
        ([-1] * 16, 16),  # negative
        ([2**32] * 16, 16),  # wider than uint32
        ([1.5] * 16, 16),  # not an int
        (["7"] * 16, 16),
        ([None] * 16, 16),
        (list(range(16)), 0),  # block size
        (np.zeros(16, dtype=np.int64), 16),  # a buffer of the wrong item type
    ],
)
def test_bad_input_raises_block_hash_error(impl, tokens, bs):
    with pytest.raises(BlockHashError):
        block_hashes(tokens, bs)


def test_bad_token_after_full_blocks_is_not_read(impl):
    # only full blocks are read, so junk in the trailing partial block is never looked at
    assert block_hashes(list(range(16)) + ["junk"], 16) == reference(list(range(16)), 16)
