"""Token ids of long prompts from cached chunks: a conversation's every turn re-sends its history, tokenized once.

Tokenizing is most of the frontend's CPU for a long prompt (cl100k, ~19k tokens: ~23 ms of ~27 ms per request,
benchmarks/results/frontend_cpu.md), and a multi-turn chat sends the same history again with each turn. So a prompt
is cut into chunks of about `chunk_chars` characters at *exact cuts*, each chunk is tokenized on its own and its ids
are kept in an LRU keyed by the chunk's text; the prompt's ids are the chunks' ids end to end. Only chunks not seen
before are tokenized (one `encode_batch_fast` call: GIL released, chunks in parallel).

Exact cut (what makes the concatenation equal to tokenizing the whole text): position c with
    text[c-2] printable and not whitespace,  text[c-1] == "\\n",  text[c] printable and not whitespace.
Why this is exact, for the tokenizers it is enabled on: Hugging Face `tokenizers` pre-tokenizes with a regex
split (GPT-2, cl100k, o200k, Llama 3, Qwen 2 all have this shape), then BPE-encodes each piece on its own. In
those regexes no piece holds a lone newline together with a non-space character after it, and the piece holding
that newline is the same whether text ends there (a chunk's end) or goes on with a non-space character: `\\s+(?!\\S)`
vs `\\s+`, `\\s++$` vs `\\s*[\\r\\n]` all give "\\n" (or "<punctuation>\\n", which stops at the next non-newline).
With no look-behind in the pattern, the pieces after c are those of text[c:] tokenized alone. A single whitespace
character is required on purpose: runs such as "\\n\\n" or " \\n" split differently before a letter than at the end
(GPT-2's `\\s+(?!\\S)` backs off one character).
Space cut: position c with text[c-1] a letter, text[c] == " ", text[c+1] a letter (prose without newlines, as
synthetic benchmark text and many pasted documents are). In those regexes no piece runs from a letter into the
space after it (letter runs are `\\p{L}+`, contractions end in a letter, the whitespace alternatives start at the
space), so a piece ends at c whether the text ends there or not, and the piece at c is the same " word" either way.

Learning from the engine (`learn`): a lazily tokenized prompt leaves chunks untokenized, and the second time they
are seen they are tokenized on the request's path. But vLLM tokenized the whole prompt already, and with
`return_token_ids` (which the frontend asks for, for migrations) it sends the ids back on the stream's first chunk.
The relay hands them over (resilience/migration.py, `on_prompt_ids`); `offer` keeps them, and when one of the chunks
left untokenized is looked up again (most never are), `learn` splits them into those chunks: each token's bytes (a table built from the vocabulary, `_TokenBytes`) are laid end to end and must be
exactly the chunks' UTF-8 text, and every cut must fall between two tokens; the ids of the part tokenized here must
equal the engine's first ids. Anything else teaches nothing (a different chat rendering, a normalizer that changed
the text, a BOS the engine added). A learned chunk is then what tokenizing it would give (an exact cut starts and
ends it), and the first learned chunk and every 32nd after are tokenized here too as an audit: a mismatch (an engine
serving another tokenizer) turns learning off. A learned prompt costs a parse and one pass over its ids in C
(`token_cuts` in orchestrator/_relaycore.c) and an array a chunk: benchmarks/prompt_prep.py's `learn` mode measures
it against tokenizing the text on its next sight.

The rule is not trusted blindly: `exact_cuts_reason(tok)` enables the cache only for a tokenizer whose normalizer,
pre-tokenizer, post-processor and added tokens have the shape the argument needs, *and* that passes a self-test at
load (random text dense in cuts, tokenized whole and by chunks cut at every exact cut, must agree). Any other
tokenizer (SentencePiece/Metaspace with its prefix space, look-behind patterns, added tokens that strip whitespace)
is tokenized whole, as before, and so is any text over MAX_CHUNKED_CHARS (hostile sizes). An over-limit prompt builds
no list of ids and leaves nothing cached. `ChunkedTokenizer.count_or_ids` returns the ids `PromptTokenizer.count_or_ids`
would.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import weakref
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from orchestrator.fast_bpe import _bytes_to_unicode

__all__ = ["ChunkedTokenizer", "PartialIds", "exact_cuts", "exact_cuts_reason"]

log = logging.getLogger("kvyard.token_cache")


def _solid(ch: str) -> bool:
    """A character no regex `\\s` matches (stricter than needed: format and control characters count as not solid)."""
    return ch.isprintable() and not ch.isspace()


# longer texts (past any context of 256k tokens) are tokenized whole, as before: a hostile prompt takes the path
# benchmarks/hostile_prompt.py measured, and fills no cache
MAX_CHUNKED_CHARS = 1 << 20
_MAX_REJECTS = 64  # newlines refused in a row (blank lines, spaces around them) before the rest stays one chunk


def exact_cuts(text: str, chunk_chars: int) -> list[int]:
    """Exact cut positions (see the module header), the first at or after `chunk_chars`, then each at least
    `chunk_chars` after the one before: whichever comes first of a newline cut (just after a lone newline) and a
    space cut (just before a lone space between two letters, for prose with no newlines). A cut depends only on the
    text up to one character past it, so two texts that share a prefix share every cut strictly inside it (what
    makes a conversation's chunks repeat).
    Candidates are found with str.find (memchr: ~0.1 ms for 4 MB, the GIL held that long at most) and at most
    _MAX_REJECTS refused ones are looked at per cut, so a hostile prompt of newlines or spaces costs no Python loop."""
    cuts: list[int] = []
    n, find, rejects = len(text), text.find, 0
    nl = find("\n", max(chunk_chars - 1, 1))  # a newline at i gives the cut i + 1
    sp = find(" ", max(chunk_chars, 1))        # a space at i gives the cut i
    while True:
        nl_cut = nl + 1 if nl != -1 and nl + 1 < n else n
        sp_cut = sp if sp != -1 and sp + 1 < n else n
        if nl_cut >= n and sp_cut >= n:
            return cuts
        if nl_cut <= sp_cut:
            cut, ok = nl_cut, _solid(text[nl - 1]) and _solid(text[nl + 1])
        else:
            cut, ok = sp_cut, text[sp - 1].isalpha() and text[sp + 1].isalpha()
        if ok:
            cuts.append(cut)
            rejects = 0
            nl = find("\n", cut + chunk_chars - 1)  # the next cut at least chunk_chars on
            sp = find(" ", cut + chunk_chars)
            continue
        rejects += 1
        if rejects > _MAX_REJECTS:
            return cuts
        if cut == nl_cut:
            nl = find("\n", nl + 1)
        else:
            sp = find(" ", sp + 1)


_SAFE_PRE = {"Sequence", "Split", "ByteLevel", "Digits"}
_SAFE_NORM = {None, "NFC"}
_SAFE_POST = {None, "ByteLevel"}  # add nothing to the ids of one sequence


def _looks_behind(regex: str) -> bool:
    """True if the pattern can depend on text before a match: look-behind, `^`, or the \\b \\B \\A \\G anchors
    (outside character classes, where `^` negates and escapes mean characters)."""
    i, in_class = 0, False
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            if not in_class and regex[i + 1:i + 2] in ("b", "B", "A", "G"):
                return True
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            if regex[i + 1:i + 2] == "^":
                i += 1
            if regex[i + 1:i + 2] == "]":  # a leading ] is a literal
                i += 1
        elif ch == "^" or regex.startswith("(?<", i):
            return True
        i += 1
    return False


def _pre_tokenizer_reason(node: dict | None) -> str | None:
    if node is None:
        return "no pre-tokenizer"
    kind = node.get("type")
    if kind not in _SAFE_PRE:
        return f"pre-tokenizer {kind}"
    if kind == "Sequence":
        return next((r for r in map(_pre_tokenizer_reason, node.get("pretokenizers", [])) if r), None)
    if kind == "ByteLevel" and node.get("add_prefix_space"):
        return "ByteLevel adds a prefix space"
    if kind == "Split":
        pattern = node.get("pattern", {})
        regex = pattern.get("Regex", pattern.get("String", ""))
        if node.get("behavior") != "Isolated" or node.get("invert"):
            return f"Split behaviour {node.get('behavior')}"
        if _looks_behind(regex):
            return "the split pattern looks behind"
    return None


def _state(obj) -> dict | None:
    return json.loads(obj.__getstate__()) if obj is not None else None


def _self_test_text(rng: random.Random, n: int) -> str:
    """Text dense in the places where cuts could go wrong: newlines between letters, digits, punctuation,
    apostrophes, spaces, tabs, CRs, non-ASCII letters, combining marks, emoji, and runs of them."""
    atoms = ["a", "Z", "é", "中", "7", "123", " ", "  ", "\t", "\r", "\n", "\n\n", ".", "!", "'", "'s", "<|", "|>", "-", "😀",
             "\u0301", "\u00a0", "don't", "word", " word", "\r\n", "?\n", ":", "#", "\u200b"]
    return "".join(rng.choice(atoms) for _ in range(n))


def exact_cuts_reason(tok) -> str | None:
    """None when cutting at exact cuts reproduces whole-text tokenization for `tok` (a tokenizers.Tokenizer), else why not."""
    if tok.normalizer is not None and _state(tok.normalizer).get("type") not in _SAFE_NORM:
        return f"normalizer {_state(tok.normalizer).get('type')}"
    reason = _pre_tokenizer_reason(_state(tok.pre_tokenizer))
    if reason:
        return reason
    for added in tok.get_added_tokens_decoder().values():
        if added.lstrip or added.rstrip or any(ch.isspace() for ch in added.content):
            return f"added token {added.content!r} strips or holds whitespace"
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    rng = random.Random(22)
    texts = [_self_test_text(rng, 400) for _ in range(24)]
    for text in texts:
        cuts = exact_cuts(text, 1)
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        whole = encode([text], add_special_tokens=False)[0].ids
        parts = [i for e in encode(pieces, add_special_tokens=False) for i in e.ids]
        if whole != parts:
            return "the self-test found a cut that changes the tokens"
    return None


class _TokenBytes:
    """Each token id's bytes (the UTF-8 text it stands for), from the vocabulary: GPT-2's byte alphabet mapped back
    for a ByteLevel decoder, the string's UTF-8 otherwise, added tokens as their content. `of` self-tests the table."""

    def __init__(self, ids: np.ndarray, lens: np.ndarray, blob: bytes) -> None:
        """Token ids[k] is lens[k] bytes of blob, the tokens' bytes end to end in that order."""
        size = int(ids.max()) + 1 if ids.size else 0
        self.lens = np.zeros(size, dtype=np.int64)  # 0: no such id (every token covers at least one byte)
        self.starts = np.zeros(size, dtype=np.int64)
        self.lens[ids] = lens
        self.starts[ids] = np.cumsum(lens) - lens
        self.blob = np.frombuffer(blob, dtype=np.uint8)

    @classmethod
    def of_pieces(cls, pieces: dict[int, bytes]) -> "_TokenBytes":
        ids = np.fromiter(pieces.keys(), dtype=np.int64, count=len(pieces))
        lens = np.fromiter(map(len, pieces.values()), dtype=np.int64, count=len(pieces))
        return cls(ids, lens, b"".join(pieces.values()))

    @classmethod
    def of(cls, raw) -> tuple["_TokenBytes | None", str | None]:
        """(the table, None) for a tokenizers.Tokenizer whose ids it spells back into their text, else (None, why
        not). A vocabulary in GPT-2's byte alphabet is read as bytes (one character a byte), else as UTF-8 strings;
        the self-test decides. Made with a few large objects, not one per token (what the garbage collector would
        walk)."""
        added = {i: t.content.encode("utf-8", "surrogatepass") for i, t in raw.get_added_tokens_decoder().items()}
        vocab = {i: text for text, i in raw.get_vocab(with_added_tokens=False).items() if i not in added}
        ids = np.fromiter([*vocab.keys(), *added.keys()], dtype=np.int64, count=len(vocab) + len(added))
        tail_lens = [len(b) for b in added.values()]
        tail = b"".join(added.values())
        rng = random.Random(23)
        texts = [_self_test_text(rng, 300) for _ in range(8)]
        tests = [(np.asarray(e.ids, dtype=np.uint32), t.encode("utf-8", "surrogatepass"))
                 for e, t in zip(raw.encode_batch(texts, add_special_tokens=False), texts)]

        def byte_level() -> "_TokenBytes | None":
            # GPT-2's alphabet back to bytes (as latin-1 characters); any other character to one latin-1 refuses
            back = {ord(c): chr(b) for b, c in _bytes_to_unicode().items()}
            back.update((c, "\uffff") for c in range(256) if c not in back)
            try:
                blob = "".join(vocab.values()).translate(back).encode("latin-1")
            except UnicodeEncodeError:
                return None
            lens = np.fromiter([*map(len, vocab.values()), *tail_lens], dtype=np.int64, count=ids.size)
            return cls(ids, lens, blob + tail)

        def utf8() -> "_TokenBytes":
            return cls.of_pieces({**{i: t.encode("utf-8", "surrogatepass") for i, t in vocab.items()}, **added})

        for reading in (byte_level, utf8):
            table = reading()
            if table is not None and all(table.cuts(i, want, [len(want)]) is not None for i, want in tests):
                return table, None
        return None, "the token bytes do not spell the text (a normalizer, or no byte-level or UTF-8 vocabulary)"

    def cuts(self, ids, text: bytes, cuts: list[int]) -> list[int] | None:
        """The number of tokens before each cut (ascending byte offsets into text, the last len(text)) when the ids'
        bytes end to end are exactly text with a token boundary at every cut, else None (also for an unknown id)."""
        return token_cuts(ids, self.starts, self.lens, self.blob, text, cuts)


def _token_cuts(ids, starts: np.ndarray, lens: np.ndarray, blob: np.ndarray, text: bytes, cuts: list[int]) -> list[int] | None:
    """`_TokenBytes.cuts` with numpy: the Python twin of orchestrator._relaycore.token_cuts (tests run both)."""
    ids = np.frombuffer(ids, dtype=np.uint32)
    if len(starts) != len(lens) or (ids.size and int(ids.max()) >= lens.size):
        return None
    n = lens[ids]
    if not n.all() or (ids.size and int((starts[ids] + n).max()) > blob.size):
        return None
    ends = np.cumsum(n)
    if (int(ends[-1]) if ids.size else 0) != len(text):
        return None
    # byte k of the spelling is blob[starts[id] + (k - where that token's bytes begin)]
    at = np.repeat(starts[ids] - (ends - n), n) + np.arange(len(text), dtype=np.int64)
    if blob[at].tobytes() != text:
        return None
    if not cuts:
        return []
    last = np.searchsorted(ends, cuts)  # the token that ends at (or spans) each cut
    if int(last.max()) >= ends.size or not np.array_equal(ends[last], cuts):
        return None
    return (last + 1).tolist()


try:  # the same check in C, one pass with memcmp (setup.py builds it; without a compiler the twin above serves)
    from orchestrator._relaycore import token_cuts
except ImportError:  # pragma: no cover - depends on the build
    token_cuts = _token_cuts


_AUDIT_EVERY = 32  # learned prompts between two audits (module header)
_TABLES: "weakref.WeakKeyDictionary[object, tuple[_TokenBytes | None, str | None]]" = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()  # not a cache's LRU lock: requests tokenize while a table is made


def _token_bytes(tok) -> tuple[_TokenBytes | None, str | None]:
    """_TokenBytes.of(tok.raw), made once per PromptTokenizer and shared by every chunk cache of it."""
    with _TABLES_LOCK:
        got = _TABLES.get(tok)
        if got is None:
            got = _TABLES[tok] = _TokenBytes.of(tok.raw)
            if got[1] is not None:
                log.info("prompt ids are not learned from the engine for this tokenizer: %s", got[1])
    return got


@dataclass(eq=False)
class PartialIds:
    """A long prompt tokenized from its start only as far as asked (ChunkedTokenizer.begin / extend).

    `ids` are exactly the ids of `chunks[:done]` (the whole text's first tokens: every chunk ends at an exact cut).
    `upper` bounds the whole text's token count from above without tokenizing the rest: the ids so far, plus the
    rest's UTF-8 length, since the rest's tokens are those of `text[done_chars:]` alone (an exact cut) and every
    token of a byte-level or character-level model covers at least one UTF-8 byte (one of the text after NFC
    normalizing, which is at most 3x longer; other normalizers never reach here, see ChunkedTokenizer.chunkable).
    ChunkedTokenizer.upper tightens it further with the cached chunks of the rest."""

    text: str
    chunks: list[str]
    ids: array | list[int]  # a uint32 array once a step ran
    done: int
    done_chars: int
    expand: int  # 3 under NFC, else 1
    ratio: float  # tokens per character, to estimate the rest (of this prompt's tokenized part, else the cache's)
    _upper: int = -1

    @property
    def chars(self) -> int:
        return len(self.text)

    @property
    def complete(self) -> bool:
        return self.done == len(self.chunks)

    @property
    def upper(self) -> int:
        if self._upper < 0:  # only an incomplete prompt asks (a limit check, the estimate); once per step
            self._upper = len(self.ids) + len(self.text[self.done_chars:].encode("utf-8", "surrogatepass")) * self.expand
        return self._upper

    def estimate(self) -> int:
        """The token count: exact when complete, else the tokenized part's plus the rest at its ratio (<= upper)."""
        if self.complete:
            return len(self.ids)
        ratio = len(self.ids) / self.done_chars if self.done_chars else self.ratio
        return min(self.upper, len(self.ids) + round((self.chars - self.done_chars) * ratio))


class ChunkedTokenizer:
    """`count_or_ids` of a PromptTokenizer, from a shared LRU of chunk ids (bounded by `capacity_tokens`).

    Thread-safe: the frontend tokenizes long prompts on a small thread pool (orchestrator/prepare.py)."""

    def __init__(self, tok, capacity_tokens: int, chunk_chars: int = 1024) -> None:
        self._tok = tok  # orchestrator.tokenizer.PromptTokenizer
        self._encode_many = tok.encode_many
        self.capacity_tokens = capacity_tokens
        self.chunk_chars = chunk_chars
        self.reason = exact_cuts_reason(tok.raw) if capacity_tokens > 0 else "disabled"
        post = _state(tok.raw.post_processor)
        self._specials_free = post is None or post.get("type") in _SAFE_POST
        self._lru: OrderedDict[str, array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0  # chunks
        # chunks a lazy prompt left untokenized, by str hash: seen again, they are tokenized (see begin)
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._seen_cap = max(1024, 4 * capacity_tokens // 256)
        # engine answers offered for learning (`offer`), by chunk hash; each record holds its prompt's text and ids
        self._pending: OrderedDict[int, tuple] = OrderedDict()
        self._pending_cap = max(1024, capacity_tokens // 256)
        self._enc_chars, self._enc_tokens = 1, 0  # what this cache has encoded: the tokens-per-character ratio
        self._expand = 3 if tok.raw.normalizer is not None else 1  # NFC (the only normalizer allowed) grows text <= 3x
        # learning from the engine's ids (module header): the token bytes, made by the first `learn` (a fraction of a
        # second of CPU once per tokenizer, on the tokenizer pool), or why not
        self._bytes: _TokenBytes | None = None
        self.learn_reason = self.reason
        self.learned = 0  # chunks
        self.learn_refused = 0  # prompts whose engine ids did not fit their text
        self._learns = 0  # prompts learned from (the audit's count)

    @property
    def learns(self) -> bool:
        """Whether `learn` may take the engine's ids of this tokenizer's prompts (until its checks say otherwise)."""
        return self.learn_reason is None

    def _table(self) -> _TokenBytes | None:
        if self._bytes is None and self.learn_reason is None:
            self._bytes, self.learn_reason = _token_bytes(self._tok)
        return self._bytes if self.learn_reason is None else None

    @property
    def enabled(self) -> bool:
        return self.reason is None

    def chunkable(self, text: str, add_special_tokens: bool) -> bool:
        """Whether this text is cut into cached chunks (`begin` applies; count_or_ids uses the chunks), else it is
        tokenized whole."""
        return (self.reason is None and 2 * self.chunk_chars <= len(text) <= MAX_CHUNKED_CHARS
                and not (add_special_tokens and not self._specials_free))

    def _chunks(self, text: str) -> tuple[list[int], list[str]]:
        """(the exact cuts, the chunks between them)."""
        cuts = exact_cuts(text, self.chunk_chars)
        return cuts, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]

    def begin(self, text: str, add_special_tokens: bool, first: int | None = None) -> PartialIds:
        """Tokenize the start of `text` only (chunkable() must be true). With `first` None: the leading chunks that are
        cached or were seen before (in an earlier prompt that left them untokenized), and one chunk more; the rest
        is remembered as seen. The router's prefix match cannot reach past a chunk no prompt has held before, unless
        the index (fed by every engine) says so; the caller asks for more with `extend` while it does. A rest under
        a quarter of the text (and under 4 chunks) is tokenized at once: a conversation's new turn, where another
        step would cost more than it saves. With `first`: that many chunks."""
        cuts, chunks = self._chunks(text)
        p = PartialIds(text, chunks, [], 0, 0, self._expand, self._enc_tokens / self._enc_chars)
        if first is None:
            keys = [hash(c) for c in chunks]
            with self._lock:
                lru, seen = self._lru, self._seen
                first = next((i for i, (c, k) in enumerate(zip(chunks, keys)) if c not in lru and k not in seen), len(chunks) - 1) + 1
                rest = len(text) - cuts[first - 1] if first < len(chunks) else 0
                if rest <= min(4 * self.chunk_chars, len(text) // 4):
                    first = len(chunks)
                for k in keys[first:]:
                    seen[k] = None
                    seen.move_to_end(k)
                while len(seen) > self._seen_cap:
                    seen.popitem(last=False)
        return self.extend(p, first)

    def extend(self, p: PartialIds, more: int) -> PartialIds:
        """Tokenize `more` chunks past the ones done (cached ones cost a lookup)."""
        start, stop = p.done, min(len(p.chunks), p.done + more)
        ids = self._ids_of(p.chunks[start:stop])
        if p.ids:
            p.ids.extend(ids)
        else:  # the first step: the array as made (no copy); PromptTokens (prepare.py) takes p.ids after each step
            p.ids = ids
        p.done_chars += sum(map(len, p.chunks[start:stop]))
        p.done = stop
        p._upper = -1
        return p

    def upper(self, p: PartialIds) -> int:
        """A bound on p's whole token count, at most p.upper, without tokenizing: the chunks of the rest that the
        cache holds count exactly (their ids are what tokenizing them gives: exact cuts), the others by their
        UTF-8 length. A long conversation whose history was counted once is not counted again for a limit."""
        rest = p.chunks[p.done:]
        with self._lock:
            known = [self._lru.get(c) for c in rest]
        return len(p.ids) + sum(len(k) if k is not None else len(c.encode("utf-8", "surrogatepass")) * p.expand
                                for c, k in zip(rest, known))

    def learn(self, p: PartialIds, done: int, n: int, engine_ids: bytes) -> int:
        """Caches the chunks p.chunks[done:] with their ids from `engine_ids` (native uint32s: the whole prompt as the
        engine tokenized it), where p.ids[:n] are the ids of p.chunks[:done]. Returns how many chunks were learned;
        0 when the engine's ids are not this text's (module header). Thread-safe; run off the event loop."""
        table = self._table()
        if table is None:
            return 0
        ids = np.frombuffer(engine_ids, dtype=np.uint32)
        rest = p.chunks[done:]
        mine = p.ids[:n]
        if not rest or ids.size <= n or ids[:n].tobytes() != (mine if isinstance(mine, array) else array("I", mine)).tobytes():
            return self._refused()
        tail = ids[n:]
        # each chunk's UTF-8 length (an ASCII chunk's is its length: str.isascii is a flag) and end in the rest's bytes
        cuts = list(accumulate(len(c) if c.isascii() else len(c.encode("utf-8", "surrogatepass")) for c in rest))
        counts = table.cuts(tail, "".join(rest).encode("utf-8", "surrogatepass"), cuts)
        if counts is None:  # not this text, or a token across a cut: not tokenized as exact cuts say
            return self._refused()
        parts, start = [], 0
        for stop in counts:
            part = array("I")
            part.frombytes(tail[start:stop].tobytes())
            parts.append(part)
            start = stop
        with self._lock:
            self._learns += 1
            audit = self._learns % _AUDIT_EVERY == 1
        if audit and self._tok.encode_many([rest[0]], add_special_tokens=False)[0] != parts[0].tolist():
            self.learn_reason = "the engine's ids differ from this tokenizer's"
            log.warning("learning prompt ids from the engine is off: the engine tokenized a chunk of %d characters "
                        "differently from this frontend's tokenizer", len(rest[0]))
            return 0
        with self._lock:
            new = [(c, i) for c, i in zip(rest, parts) if c not in self._lru]
            self.learned += len(new)
            self._enc_chars += sum(len(c) for c, _ in new)
            self._enc_tokens += sum(len(i) for _, i in new)
            self._insert(new)
        return len(new)

    def _refused(self) -> int:
        with self._lock:
            self.learn_refused += 1
        return 0

    def count_or_ids(self, text: str, limit: int, add_special_tokens: bool = True) -> tuple[int, array | list[int] | None]:
        """(token count, ids), the ids only when the count is at most `limit`: exactly the tokenizer's own answer (a
        uint32 array where chunks were joined, else the tokenizer's list)."""
        if not self.chunkable(text, add_special_tokens):
            return self._tok.count_or_ids(text, limit, add_special_tokens)
        cuts, chunks = self._chunks(text)
        if not cuts:
            return self._tok.count_or_ids(text, limit, add_special_tokens)
        found, missing, encoded = self._lookup(chunks)
        n = sum(len(ids) for ids in found if ids is not None) + sum(map(len, encoded))
        if n > limit:  # refused: no Python list of its ids is built (a hostile prompt), nothing of it is kept
            return n, None
        return n, self._join(found, missing, encoded)

    def _ids_of(self, chunks: list[str]) -> array:
        return self._join(*self._lookup(chunks)) if chunks else array("I")

    def _lookup(self, chunks: list[str]) -> tuple[list[array | None], list[str], list[list[int]]]:
        """(each chunk's cached ids or None, the chunks not cached, their ids: one GIL-free batch call). A chunk not
        cached but offered by an engine's answer (`offer`) is learned first."""
        found = self._found(chunks)
        if self._pending and None in found:
            with self._lock:
                records = {id(r): r for c, ids in zip(chunks, found) if ids is None
                           and (r := self._pending.get(hash(c))) is not None}
            if records:
                for r in records.values():
                    self._learn_offered(r)
                found = self._found(chunks)
        missing = [c for c, ids in zip(chunks, found) if ids is None]
        return found, missing, (self._encode_many(missing, add_special_tokens=False) if missing else [])

    def _found(self, chunks: list[str]) -> list[array | None]:
        found: list[array | None] = []
        with self._lock:
            for c in chunks:
                ids = self._lru.get(c)
                if ids is not None:
                    self._lru.move_to_end(c)
                found.append(ids)
        return found

    def offer(self, p: PartialIds, done: int, n: int, engine_ids: bytes) -> None:
        """`learn`'s arguments, kept until one of p.chunks[done:] is looked up again (most are never: a prompt
        nobody sends again), and learned then, on the thread that needs them. Cheap enough for the event loop: a
        dict entry a chunk. At most `_pending_cap` chunks are kept, the oldest dropped first."""
        if self.learn_reason is not None or not p.chunks[done:]:
            return
        keys = [hash(c) for c in p.chunks[done:]]
        record = (p, done, n, engine_ids, keys)
        with self._lock:
            pending = self._pending
            for k in keys:
                pending[k] = record
                pending.move_to_end(k)
            while len(pending) > self._pending_cap:
                pending.popitem(last=False)

    def _learn_offered(self, record: tuple) -> None:
        p, done, n, engine_ids, keys = record
        with self._lock:
            for k in keys:
                if self._pending.get(k) is record:
                    del self._pending[k]
        self.learn(p, done, n, engine_ids)

    def _join(self, found: list[array | None], missing: list[str], lists: list[list[int]]) -> array:
        """The chunks' ids end to end, as one uint32 array; the new chunks' ids are cached.

        An array, not a list: a long prompt's ~20k ids as Python ints are ~20k objects to make, count for the garbage
        collector and free, where the array copies the cached ones; everything that reads them takes either (the
        router hashes a uint32 buffer as it is; a continuation prompt is made a list). The long multi-turn workload of
        benchmarks/frontend_cpu.py spent 0.77-0.89x the CPU a request with it (docs/benchmarks.md)."""
        new = [array("I", ids) for ids in lists]
        it = iter(new)
        parts = [ids if ids is not None else next(it) for ids in found]
        self._remember(missing, new, len(found) - len(missing))
        out = array("I")
        for p in parts:
            out.extend(p)
        return out

    def _remember(self, chunks: list[str], ids: list[array], hits: int) -> None:
        with self._lock:
            self.hits += hits
            self.misses += len(chunks)
            self._enc_chars += sum(map(len, chunks))
            self._enc_tokens += sum(map(len, ids))
            self._insert(zip(chunks, ids))

    def _insert(self, pairs) -> None:
        """(chunk, ids) pairs into the LRU, the oldest out past capacity; the lock held."""
        for c, i in pairs:
            if c not in self._lru:
                self._lru[c] = i
                self._tokens += len(i)
        while self._tokens > self.capacity_tokens and self._lru:
            _, old = self._lru.popitem(last=False)
            self._tokens -= len(old)
