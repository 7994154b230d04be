"""The chunked prompt tokenizer (orchestrator/token_cache.py) gives exactly the ids of tokenizing the whole text."""

from __future__ import annotations

import random

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from orchestrator.token_cache import ChunkedTokenizer, _looks_behind, _self_test_text, exact_cuts, exact_cuts_reason
from orchestrator.tokenizer import load_tokenizer
from workers.sim.backend import SIM_TOKENIZER_DIR


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(SIM_TOKENIZER_DIR))


def _listed(result):
    """count_or_ids' (count, ids) with the ids as a list (the chunked path gives a uint32 array)."""
    n, ids = result
    return n, (None if ids is None else list(ids))


def whole(tok, text: str, add_special_tokens: bool = False) -> list[int]:
    return tok.encode(text, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("text, chunk, cuts", [
    ("ab\ncd", 1, [3]),            # letter, newline, letter: a cut right after the newline
    ("ab\n\ncd", 1, []),           # a run of two newlines: never
    ("ab \ncd", 1, []),            # space before the newline: never
    ("ab\n cd", 1, []),            # space after: never
    ("ab\r\ncd", 1, []),           # CR is whitespace
    ("a.\n'sb\nc", 1, [3, 7]),
    ("x\ny\nz\nw", 3, [4]),        # the first cut at or after 3, the next at least 3 after it
    ("x\ny\nz\nw", 1, [2, 4, 6]),
    ("abc\n", 1, []),              # no character after the newline: not a cut (it depends on what follows)
    ("a\u200b\nb", 1, []),         # a zero-width space is not "solid"
    ("", 4, []),
    ("ab cd", 1, [2]),             # letter, space, letter: a cut before the space
    ("ab  cd", 1, []),             # two spaces: never
    ("a. cd", 1, []),              # punctuation before the space: never
    ("ab 7d", 1, []),              # a digit after it: never
    ("ab cd\nef gh", 1, [2, 6, 8]),  # whichever comes first: a space cut (before it), a newline cut (after it)
    ("é 中", 1, [1]),              # letters are Unicode letters
])
def test_exact_cuts(text, chunk, cuts):
    assert exact_cuts(text, chunk) == cuts


def test_cuts_inside_a_shared_prefix_are_shared():
    rng = random.Random(1)
    base = _self_test_text(rng, 3000)
    longer = base + _self_test_text(rng, 500)
    inside = [c for c in exact_cuts(base, 64) if c < len(base)]
    assert inside and exact_cuts(longer, 64)[:len(inside)] == inside


@pytest.mark.parametrize("pattern, behind", [
    (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\s++$|\s+(?!\S)|\s", False),  # cl100k: ^ only inside a class
    (r"(?<=a)b", True), (r"(?<!a)b", True), (r"^a", True), (r"\bword", True), (r"\Aa", True),
    (r"[\^]a", False), (r"[]^]a", False), (r"\^a", False),
])
def test_looks_behind(pattern, behind):
    assert _looks_behind(pattern) is behind


def test_the_sim_tokenizer_qualifies(tok):
    assert exact_cuts_reason(tok.raw) is None


def _bpe(pre) -> Tokenizer:
    t = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "\n": 2, "▁": 3, "Ġ": 4, "Ċ": 5, "\na": 6}, merges=[("\n", "a")]))
    t.pre_tokenizer = pre
    return t


@pytest.mark.parametrize("pre, why", [
    (pre_tokenizers.Metaspace(), "pre-tokenizer Metaspace"),  # SentencePiece's prefix space: a chunk would get one too
    (pre_tokenizers.ByteLevel(add_prefix_space=True), "ByteLevel adds a prefix space"),
    (pre_tokenizers.Split(Regex(r"(?<=a)b|."), behavior="isolated"), "the split pattern looks behind"),
    (pre_tokenizers.Split(Regex(r"\s+"), behavior="removed"), "Split behaviour Removed"),
])
def test_tokenizers_the_argument_does_not_cover_are_refused(pre, why):
    assert exact_cuts_reason(_bpe(pre)) == why


def test_a_tokenizer_failing_the_self_test_is_refused():
    # a split that joins a newline with the letter after it: cutting after the newline would change the pieces
    t = _bpe(pre_tokenizers.Split(Regex(r"\n\p{L}|."), behavior="isolated"))
    assert exact_cuts_reason(t) == "the self-test found a cut that changes the tokens"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_ids_equal_whole_text_ids_on_tricky_text(tok, seed, chunk):
    rng = random.Random(seed)
    cached = ChunkedTokenizer(tok, 1_000_000, chunk_chars=chunk)
    text = _self_test_text(rng, 2500)
    want = whole(tok, text)
    for _ in range(2):  # cold, then from the cache
        assert _listed(cached.count_or_ids(text, 1 << 30, add_special_tokens=False)) == (len(want), want)
    # every prefix length class: a text cut anywhere, continued with anything
    for end in rng.sample(range(1, len(text)), 40):
        t2 = text[:end] + _self_test_text(rng, 30)
        w2 = whole(tok, t2)
        assert _listed(cached.count_or_ids(t2, 1 << 30, add_special_tokens=False)) == (len(w2), w2)
    assert cached.hits > 0


def test_a_growing_conversation_is_exact_and_mostly_cached(tok):
    rng = random.Random(3)
    words = "the cache router token stream prefill decode, don't 123 it's: é 中文 😀 ok.".split()
    para = lambda n: " ".join(rng.choice(words) for _ in range(n)) + ".\n" + " ".join(rng.choice(words) for _ in range(n))
    msgs = [{"role": "system", "content": para(400)}, {"role": "user", "content": para(2000)}]
    cached = ChunkedTokenizer(tok, 1_000_000, chunk_chars=256)
    for turn in range(4):
        text = tok.render_chat(msgs)
        want = tok.encode_chat(msgs)
        before = cached.misses
        assert _listed(cached.count_or_ids(text, 1 << 30, add_special_tokens=False)) == (len(want), want)
        if turn:
            assert cached.misses - before <= 8  # only the new turn's chunks (and the last one) were tokenized
        msgs = msgs + [{"role": "assistant", "content": para(60)}, {"role": "user", "content": para(80)}]


def test_limit_and_special_tokens_match_the_tokenizer(tok):
    text = _self_test_text(random.Random(9), 3000)
    cached = ChunkedTokenizer(tok, 1_000_000, chunk_chars=64)
    n = len(whole(tok, text))
    assert cached.count_or_ids(text, n - 1, add_special_tokens=False) == (n, None)
    assert cached._tokens == 0 and not cached._lru  # a refused prompt leaves nothing in the cache
    assert _listed(cached.count_or_ids(text, n, add_special_tokens=True)) == tok.count_or_ids(text, n, add_special_tokens=True)


def test_the_cache_is_bounded_and_can_be_off(tok):
    rng = random.Random(5)
    cached = ChunkedTokenizer(tok, 2_000, chunk_chars=64)
    for _ in range(5):
        text = _self_test_text(rng, 2000)
        want = whole(tok, text)
        assert list(cached.count_or_ids(text, 1 << 30, add_special_tokens=False)[1]) == want
        assert cached._tokens <= 2_000
    before = cached.hits + cached.misses
    huge = "ab\ncd " * (200_000)  # past MAX_CHUNKED_CHARS: tokenized whole, nothing cached
    assert len(huge) > 1 << 20
    assert cached.count_or_ids(huge, 1 << 30, add_special_tokens=False)[0] == len(whole(tok, huge)) and cached.hits + cached.misses == before
    off = ChunkedTokenizer(tok, 0)
    assert not off.enabled and list(off.count_or_ids("a\nb" * 2000, 1 << 30, add_special_tokens=False)[1]) == whole(tok, "a\nb" * 2000)


async def test_long_chat_prompts_through_the_preparer_are_exact(tok):
    from orchestrator.prepare import PromptPreparer
    from orchestrator.protocol import ChatCompletionRequest

    class Pool:
        def tokenizer_dir(self, model):
            return str(SIM_TOKENIZER_DIR)

    prep = PromptPreparer(Pool(), cache_tokens=1_000_000)
    rng = random.Random(4)
    msgs = [{"role": "system", "content": _self_test_text(rng, 3000)}, {"role": "user", "content": "hello\nthere"}]
    try:
        for _ in range(3):
            req = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs})
            ids = (await prep.prompt_ids(req, "m", 1 << 20)).ids
            assert list(ids) == tok.encode_chat(msgs)
            msgs = msgs + [{"role": "assistant", "content": _self_test_text(rng, 50)}, {"role": "user", "content": "and?"}]
        assert prep.chunked(tok).hits > 0
    finally:
        prep.close()


def test_cuts_skip_refused_candidates_and_give_up_on_hostile_text():
    assert exact_cuts("a\u200b\nb" + "x\ny", 1) == [6]  # the format character's newline refused, the next one taken
    assert exact_cuts("\n" * 1_000_000, 16) == []  # one regex search, no per-newline Python loop
    assert exact_cuts(". " * 1_000_000, 16) == []  # spaces between non-letters: refused, a bounded number looked at
    assert exact_cuts("a\u200b\nb" * 100 + "x\ny", 1) == []  # past _MAX_REJECTS refusals the rest stays one chunk


def _gpt2_style() -> Tokenizer:
    """GPT-2's shape: ByteLevel with its own regex (`\\s+(?!\\S)` backs off a character), merges across whitespace
    runs and newlines, so a wrong cut would change the ids."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    merges = [("Ġ", "Ċ"), ("Ċ", "Ċ"), ("Ġ", "Ġ"), ("Ċ", "a"), ("Ġ", "a"), (".", "Ċ"), ("a", "Ċ")]
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return t


def test_a_gpt2_style_tokenizer_qualifies_and_chunks_exactly():
    t = _gpt2_style()
    assert exact_cuts_reason(t) is None
    rng = random.Random(11)
    for _ in range(40):
        text = _self_test_text(rng, 600)
        cuts = exact_cuts(text, 1)
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert [i for e in t.encode_batch(pieces, add_special_tokens=False) for i in e.ids] == t.encode(text, add_special_tokens=False).ids


# ---- lazy: a long prompt tokenized only as far as routing needs (orchestrator/prepare.py, 4)

def test_lazy_begin_tokenizes_the_first_new_chunk_and_the_rest_on_its_second_sight(tok):
    rng = random.Random(21)
    text = _self_test_text(rng, 6000)
    want = whole(tok, text)
    cached = ChunkedTokenizer(tok, 1_000_000, chunk_chars=256)
    assert cached.chunkable(text, False)
    p = cached.begin(text, False)
    assert len(p.chunks) > 4 and p.done == 1 and not p.complete  # never seen: its first chunk only
    assert list(p.ids) == want[:len(p.ids)] and p.ids  # exactly the whole text's first tokens
    assert len(want) <= p.upper and p.estimate() <= p.upper
    assert 0.5 < p.estimate() / len(want) < 2
    cached.extend(p, 2)
    assert p.done == 3 and list(p.ids) == want[:len(p.ids)]
    cached.extend(p, 1000)
    assert p.complete and list(p.ids) == want and p.estimate() == len(want)
    again = cached.begin(text, False)  # every chunk seen (or cached) before: all of it, as a copy sent meanwhile needs
    assert again.complete and list(again.ids) == want
    longer = text + "\nanother question about it"
    p2 = cached.begin(longer, False)  # the shared chunks and one more (where the new text starts)
    assert p2.complete and list(p2.ids) == whole(tok, longer)
    turn = longer + "\n" + _self_test_text(rng, 700)  # a new turn of ~3 chunks: at once, not in another step
    p3 = cached.begin(turn, False)
    assert p3.complete and list(p3.ids) == whole(tok, turn)
    fresh = _self_test_text(rng, 600) + "\n" + text  # new text first: a prompt nobody sent, so its first chunk only
    assert cached.begin(fresh, False).done == 1


def test_lazy_first_zero_tokenizes_nothing_and_bounds_the_count(tok):
    text = "naïve café 中文 😀 words\n" * 400
    cached = ChunkedTokenizer(tok, 1_000_000, chunk_chars=256)
    p = cached.begin(text, False, first=0)
    assert list(p.ids) == [] and p.done == 0 and not p.complete
    n = len(whole(tok, text))
    assert n <= p.upper == len(text.encode())  # no normalizer: a token covers at least one byte
    assert p.estimate() <= p.upper


def test_lazy_does_not_apply_where_chunking_does_not(tok):
    cached = ChunkedTokenizer(tok, 1_000_000, chunk_chars=256)
    assert not cached.chunkable("short\ntext", False)  # under two chunks
    assert not ChunkedTokenizer(tok, 0).chunkable("a\nb" * 2000, False)  # cache off


def _preparer(**fields):
    from orchestrator.prepare import PromptPreparer

    class Pool:
        def tokenizer_dir(self, model):
            return str(SIM_TOKENIZER_DIR)

    return PromptPreparer(Pool(), cache_tokens=1_000_000, **fields)


def _long_chat(tok, rng: random.Random):
    """(request, its exact ids): a 12k-character chat nobody sent before."""
    from orchestrator.protocol import ChatCompletionRequest

    msgs = [{"role": "user", "content": _self_test_text(rng, 12000)}]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": msgs}), tok.encode_chat(msgs)


async def test_the_preparer_goes_on_while_the_probe_matches_and_completes_on_demand(tok):
    from orchestrator.prepare import EAGER

    req, want = _long_chat(tok, random.Random(22))
    prep = _preparer()
    try:
        seen: list[int] = []

        def probe(ids):  # "cached somewhere" for the first 1,000 tokens
            seen.append(len(ids))
            return len(ids) < 1000

        p = await prep.prompt_ids(req, "m", 1 << 20, how_far=lambda: probe)
        assert not p.complete and list(p.ids) == want[:len(p.ids)] and len(p.ids) >= 1000 and seen[-1] == len(p.ids)
        assert len(seen) >= 2 and seen == sorted(seen)  # asked again after each step
        assert p.obtainable and 0.5 < p.count / len(want) < 2 and len(want) <= p.partial.upper
        assert list(await prep.complete(p)) == want and p.complete and p.count == len(want)
        none = await prep.prompt_ids(req, "m", 1 << 20, how_far=lambda: None)  # no index: no ids at all
        assert list(none.ids) == [] and not none.complete and none.obtainable
        eager = await prep.prompt_ids(req, "m", 1 << 20, how_far=lambda: EAGER)
        assert eager.complete and list(eager.ids) == want
    finally:
        prep.close()


async def test_a_lazy_prompt_near_a_limit_is_counted_exactly(tok):
    from orchestrator.errors import ContextLengthError

    rng = random.Random(23)
    req, want = _long_chat(tok, rng)
    prep = _preparer()
    try:
        ctx = len(want) + 10  # fits, but under the byte bound: counted exactly
        p = await prep.prompt_ids(req, "m", ctx, how_far=lambda: lambda ids: False)
        assert p.complete and list(p.ids) == want and p.count == len(want)
        with pytest.raises(ContextLengthError):
            await prep.prompt_ids(req, "m", len(want) - 1, how_far=lambda: lambda ids: False)
        assert (await prep.prompt_ids(req, "m", 1 << 20, how_far=lambda: lambda ids: False)).complete  # every chunk cached now
        fresh, _ = _long_chat(tok, rng)
        assert not (await prep.prompt_ids(fresh, "m", 1 << 20, how_far=lambda: lambda ids: False)).complete  # far from it: lazy
    finally:
        prep.close()
    capped = _preparer(max_tokens_cap=1 << 19)
    try:  # a cap filled in as max_tokens needs ctx - count: exact when the bound leaves less than the cap
        p = await capped.prompt_ids(req, "m", (1 << 19) + len(want) + 5, how_far=lambda: lambda ids: False)
        assert p.complete and p.count == len(want)
    finally:
        capped.close()


def test_the_bound_counts_what_is_done_and_what_the_cache_holds(tok):
    rng = random.Random(31)
    history, turn = _self_test_text(rng, 6000), "\n" + _self_test_text(rng, 3000)
    cached = ChunkedTokenizer(tok, 1_000_000, chunk_chars=256)
    n_history = cached.count_or_ids(history, 1 << 30, add_special_tokens=False)[0]  # a turn counted before
    p = cached.begin(history + turn, False, first=0)  # nothing tokenized (no probe)
    n = len(whole(tok, history + turn))
    assert p.upper == len((history + turn).encode())
    tight = cached.upper(p)
    assert n <= tight < p.upper  # sound, and tighter: the history's chunks count exactly
    # the history's last chunk (it ends where the history does, not at a cut of the whole) is bounded by its bytes
    last = history[exact_cuts(history, 256)[-1]:]
    assert tight <= n_history + len(last.encode()) + len(turn.encode())
    cached.extend(p, 3)
    assert p.upper == len(p.ids) + len((history + turn)[p.done_chars:].encode()) and n <= cached.upper(p) <= p.upper


async def test_a_conversation_counted_once_is_not_counted_again_for_a_limit(tok):
    from orchestrator.protocol import ChatCompletionRequest

    rng = random.Random(32)
    msgs = [{"role": "user", "content": _self_test_text(rng, 12000)}]
    prep = _preparer()
    try:
        first = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs})
        n1 = len(tok.encode_chat(msgs))
        ctx = n1 + 3000  # under the first turn's byte bound: the first turn is counted exactly
        p1 = await prep.prompt_ids(first, "m", ctx, how_far=lambda: None)
        assert p1.complete and p1.count == n1
        msgs2 = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
        second = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs2})
        p2 = await prep.prompt_ids(second, "m", ctx, how_far=lambda: None)
        assert not p2.complete and list(p2.ids) == []  # its history's chunks bound it under ctx: nothing tokenized
        assert len(tok.encode_chat(msgs2)) <= p2.partial.upper
    finally:
        prep.close()


# ---- learning the untokenized chunks from the engine's ids (ChunkedTokenizer.learn)

def _engine_ids(ids) -> bytes:
    from array import array
    return array("I", ids).tobytes()


def _lazy(tok, text: str, chunk_chars: int = 256):
    cached = ChunkedTokenizer(tok, 1_000_000, chunk_chars=chunk_chars)
    p = cached.begin(text, False)
    assert not p.complete and p.done >= 1
    return cached, p


@pytest.mark.parametrize("seed", range(4))
def test_learned_chunks_are_the_ids_tokenizing_would_give(tok, seed):
    """The engine's ids of the whole prompt fill the chunks left untokenized; the text's next sight is then all cached,
    with exactly the tokenizer's ids, and nothing more is encoded."""
    rng = random.Random(seed)
    text = _self_test_text(rng, 6000)
    want = whole(tok, text)
    cached, p = _lazy(tok, text)
    rest = len(p.chunks) - p.done
    assert cached.learns and cached.learn(p, p.done, len(p.ids), _engine_ids(want)) == rest
    assert cached.learned == rest and cached.learn_refused == 0
    misses = cached.misses
    again = cached.begin(text, False)
    assert again.complete and list(again.ids) == want and cached.misses == misses
    assert cached.learn(p, p.done, len(p.ids), _engine_ids(want)) == 0  # known already: nothing new


def test_the_engine_ids_of_another_text_teach_nothing(tok):
    text = _self_test_text(random.Random(7), 6000)
    want = whole(tok, text)
    cached, p = _lazy(tok, text)
    done, n = p.done, len(p.ids)
    other = text[:-40] + "x" + text[-39:]  # one character changed near the end
    cases = [
        [1] + want,                           # a BOS the engine added
        [want[0] + 1] + want[1:],             # the tokenized part differs
        whole(tok, other),                    # another text (another chat rendering)
        want[:-1],                            # cut short
        want + [want[-1]],                    # one token more
        want[:n],                             # nothing past the tokenized part
        want[:-1] + [10 ** 9],                # an id the vocabulary lacks
    ]
    for ids in cases:
        assert cached.learn(p, done, n, _engine_ids(ids)) == 0
    assert cached.learn_refused == len(cases) and cached.learned == 0 and cached.learns
    misses = cached.misses
    assert cached.begin(text, False).complete and cached.misses > misses  # its second sight tokenizes the rest


def test_a_token_across_a_cut_teaches_nothing(tok):
    """The same bytes, but a token spanning the boundary of two chunks: not the exact-cut tokenization."""
    from orchestrator.token_cache import _TokenBytes

    text = _self_test_text(random.Random(8), 6000)
    want = whole(tok, text)
    cached, p = _lazy(tok, text)
    table = cached._table()
    k = p.done + 2  # a later chunk's start: the audit (first chunk learned) passes
    at = sum(len(tok.encode(c, False)) for c in p.chunks[:k])  # the first token of chunk k
    pieces = {i: table.blob[table.starts[i]:table.starts[i] + table.lens[i]].tobytes() for i in set(want)}
    span = pieces[want[at - 1]] + pieces[want[at]]
    cached._bytes = _TokenBytes.of_pieces({**pieces, 1 << 20: span})  # a vocabulary with one token across the cut
    ids = want[:at - 1] + [1 << 20] + want[at + 1:]
    assert cached.learn(p, p.done, len(p.ids), _engine_ids(ids)) == 0 and cached.learn_refused == 1
    cached._bytes = table
    assert cached.learn(p, p.done, len(p.ids), _engine_ids(want)) > 0


def test_an_engine_with_another_tokenizer_turns_learning_off(tok):
    """Byte for byte the same text, but one byte a token (what another vocabulary could give): the audit of the
    first learned prompt tokenizes its first chunk, sees other ids, and learning stops."""
    text = _self_test_text(random.Random(9), 6000)
    want = whole(tok, text)
    cached, p = _lazy(tok, text)
    table = cached._table()
    byte_id = {table.blob[table.starts[i]:table.starts[i] + table.lens[i]].tobytes(): i
               for i in range(table.lens.size) if table.lens[i] == 1}
    rest = "".join(p.chunks[p.done:]).encode()
    bytewise = list(p.ids) + [byte_id[rest[i:i + 1]] for i in range(len(rest))]
    assert cached.learn(p, p.done, len(p.ids), _engine_ids(bytewise)) == 0
    assert not cached.learns and "differ" in cached.learn_reason and cached.learned == 0
    assert cached.learn(p, p.done, len(p.ids), _engine_ids(want)) == 0  # off for good


def test_learning_needs_a_table_that_spells_the_text():
    """A vocabulary whose tokens do not spell the text byte for byte (here: a lowercasing normalizer) is not learned
    from; a byte-level one is."""
    from tokenizers import normalizers

    from orchestrator.token_cache import _TokenBytes

    t = _gpt2_style()
    assert _TokenBytes.of(t)[1] is None
    t.normalizer = normalizers.Lowercase()
    table, why = _TokenBytes.of(t)
    assert table is None and "spell" in why


async def test_the_preparer_learns_what_it_left_untokenized(tok):
    """`learner` is there only for a prompt routed on some ids and left incomplete; its callback offers the engine's
    ids, learned when the same chat comes again, which then needs no tokenizing."""
    from array import array

    req, want = _long_chat(tok, random.Random(24))
    prep = _preparer()
    off = _preparer(learn=False)
    try:
        p = await prep.prompt_ids(req, "m", 1 << 20, how_far=lambda: lambda ids: False)
        assert not p.complete and p.partial.done >= 1
        assert (await off.prompt_ids(req, "m", 1 << 20, how_far=lambda: lambda ids: False)) and off.learner(p) is None
        unrouted = await prep.prompt_ids(_long_chat(tok, random.Random(25))[0], "m", 1 << 20, how_far=lambda: None)
        assert prep.learner(unrouted) is None  # no ids needed, none learned
        learn = prep.learner(p)
        cache = p.chunked
        learn(array("I", want).tobytes())  # offered: learned only when the text is seen again
        assert cache.learned == 0
        misses = cache.misses
        again = await prep.prompt_ids(req, "m", 1 << 20, how_far=lambda: lambda ids: False)
        assert again.complete and list(again.ids) == want and cache.misses == misses
        assert cache.learned == len(p.partial.chunks) - p.partial.done and not cache._pending
        assert prep.learner(again) is None  # complete: nothing to learn
    finally:
        prep.close()
        off.close()


@pytest.mark.parametrize("seed", range(40))
def test_the_c_token_cuts_match_the_numpy_twin(tok, seed):
    """orchestrator._relaycore.token_cuts and token_cache._token_cuts give the same answer: real spellings with their
    chunk cuts, and spoilt ones (an unknown id, a changed byte, a cut inside a token, a short or long text)."""
    import numpy as np

    from orchestrator import token_cache

    if token_cache.token_cuts is token_cache._token_cuts:
        pytest.skip("orchestrator._relaycore not built")
    rng = random.Random(seed)
    table = ChunkedTokenizer(tok, 1 << 20, chunk_chars=64)._table()
    text = _self_test_text(rng, rng.randint(0, 400))
    chunks = [text[a:b] for a, b in zip([0, *exact_cuts(text, 64)], [*exact_cuts(text, 64), len(text)])] if text else []
    ids = np.asarray([i for c in chunks for i in whole(tok, c)], dtype=np.uint32)
    raw = text.encode("utf-8", "surrogatepass")
    cuts = [len("".join(chunks[:k + 1]).encode("utf-8", "surrogatepass")) for k in range(len(chunks))]
    spoilt = rng.choice(["none", "id", "byte", "cut", "short", "long", "cuts"])
    if spoilt == "id" and ids.size:
        ids[rng.randrange(ids.size)] = rng.choice([table.lens.size, 2 ** 32 - 1])
    elif spoilt == "byte" and raw:
        k = rng.randrange(len(raw))
        raw = raw[:k] + bytes([raw[k] ^ 1]) + raw[k + 1:]
    elif spoilt == "cut" and cuts:
        cuts[rng.randrange(len(cuts))] -= 1
    elif spoilt == "short":
        raw = raw[:-1]
    elif spoilt == "long":
        raw += b"x"
    elif spoilt == "cuts":
        cuts = cuts[:-1]
    args = (ids, table.starts, table.lens, table.blob, raw, cuts)
    got = token_cache.token_cuts(*args)
    assert got == token_cache._token_cuts(*args)
    if spoilt == "none":
        assert got == [sum(len(whole(tok, c)) for c in chunks[:k + 1]) for k in range(len(chunks))]


async def test_a_prompt_far_from_its_limit_by_its_estimate_is_not_counted(tok):
    """Past the UTF-8 bound but within ESTIMATE_MARGIN x its estimate of the context: admitted on the estimate, with
    a recheck for the engine's 400; a prompt denser than its start promised (hostile) then gets this frontend's own
    context-length error from the exact count, and one that fits leaves the engine's refusal standing."""
    from orchestrator.errors import ContextLengthError
    from orchestrator.prepare import ESTIMATE_MARGIN
    from orchestrator.protocol import ChatCompletionRequest

    rng = random.Random(40)
    vocab = ["token", "words", "cost", "little", "prose", "reads", "cheap"]
    words, more = (" ".join(rng.choice(vocab) for _ in range(6000)) for _ in range(2))
    dense = "".join(random.Random(41).choice("中文😀字") for _ in range(40000))  # ~1 token a character
    for content, tight in ((words + "\n" + more, False), (words + "\n" + dense, True)):
        msgs = [{"role": "user", "content": content}]
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs, "max_tokens": 16})
        n = len(tok.encode_chat(msgs))
        first = _preparer()
        try:  # the estimate (its own first chunk's density), far from any limit
            est = (await first.prompt_ids(req, "m", 1 << 30, how_far=lambda: lambda ids: False)).count
        finally:
            first.close()
        # within the margin, under the byte bound (without the estimate: counted exactly); the dense one cannot fit
        ctx = ESTIMATE_MARGIN * est + 100
        assert ctx < len(content.encode()) and (n > ctx if tight else n + 16 <= ctx)
        prep = _preparer()
        try:
            p = await prep.prompt_ids(req, "m", ctx, how_far=lambda: lambda ids: False)
            assert not p.complete and p.recheck is not None and ESTIMATE_MARGIN * p.count + 16 <= ctx
            if tight:
                with pytest.raises(ContextLengthError):
                    await prep.recheck(p)
            else:
                await prep.recheck(p)  # fits: the engine's own 400 stands
                assert p.complete and p.count == n
            assert p.recheck is None
            other = _preparer()  # engines whose refusal is not known to be vLLM's 400: counted exactly, as before
            try:
                if tight:
                    with pytest.raises(ContextLengthError):
                        await other.prompt_ids(req, "m", ctx, how_far=lambda: lambda ids: False, engine_refuses=False)
                else:
                    assert (await other.prompt_ids(req, "m", ctx, how_far=lambda: lambda ids: False, engine_refuses=False)).complete
            finally:
                other.close()
            # max_tokens_cap filling max_tokens needs the count: exact, as before
            capped = _preparer(max_tokens_cap=ctx)
            bare = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs})
            try:
                if tight:
                    with pytest.raises(ContextLengthError):
                        await capped.prompt_ids(bare, "m", ctx, how_far=lambda: lambda ids: False)
                else:
                    assert (await capped.prompt_ids(bare, "m", ctx, how_far=lambda: lambda ids: False)).complete
            finally:
                capped.close()
        finally:
            prep.close()


def test_offered_ids_are_learned_on_the_next_sight_only(tok):
    """`offer` keeps the engine's ids; a prompt nobody sends again costs no learning; the next sight of any of its
    chunks learns them all (and drops the record); the kept records are bounded."""
    rng = random.Random(51)
    texts = [_self_test_text(rng, 6000) for _ in range(3)]
    cached = ChunkedTokenizer(tok, 1_000_000, chunk_chars=256)
    parts = [cached.begin(t, False) for t in texts]
    for t, p in zip(texts, parts):
        cached.offer(p, p.done, len(p.ids), _engine_ids(whole(tok, t)))
    assert cached.learned == 0 and len(cached._pending) == sum(len(p.chunks) - p.done for p in parts)
    misses = cached.misses
    n, ids = cached.count_or_ids(texts[1], 1 << 30, add_special_tokens=False)  # the second prompt seen again
    assert list(ids) == whole(tok, texts[1]) and cached.misses == misses
    assert cached.learned == len(parts[1].chunks) - parts[1].done
    assert len(cached._pending) == sum(len(p.chunks) - p.done for i, p in enumerate(parts) if i != 1)
    small = ChunkedTokenizer(tok, 1_000_000, chunk_chars=256)
    small._pending_cap = 5
    p = small.begin(texts[0], False)
    small.offer(p, p.done, len(p.ids), _engine_ids(whole(tok, texts[0])))
    assert len(small._pending) == 5  # the newest chunks' entries
    off = ChunkedTokenizer(tok, 1_000_000, chunk_chars=256)
    off.learn_reason = "off"
    off.offer(p, p.done, len(p.ids), _engine_ids(whole(tok, texts[0])))
    assert not off._pending
