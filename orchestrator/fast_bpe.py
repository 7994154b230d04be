"""Exact byte-level BPE on tiktoken's core, for the tokenizers where it gives the same ids as Hugging Face's.

Tokenizing prompts was the largest part of the frontend's CPU on long prompts (perf on the frontend during
benchmarks/routers_compare.py's trace: the tokenizer threads took ~38% of the process's CPU).
Hugging Face `tokenizers` tracks alignments (a NormalizedString per piece, offsets) even in `encode_batch_fast`;
`tiktoken`'s Rust core does only the regex split and the merges: about a fifth of the CPU
(benchmarks/results/prompt_prep.md: 8.8 against 41.8 ms for a 17.7k-token document, 16 against 87 us for 64
words). Both release the GIL.

They agree only for one family: byte-level BPE whose merges are ranked by the merged token's id and complete
(every split of a token into two tokens is a merge), so "merge the best-ranked pair" is the same rule either way,
and whose `ignore_merges` is set (a piece that is a whole token is that token: tiktoken's shortcut). That is how
tiktoken vocabularies look when converted to `tokenizer.json` (`ignore_merges` came to `tokenizers` with Llama 3's
conversion; the sim's cl100k is one); each file is checked, not assumed.
`fast_encoder(tok)` builds one only when all of this holds:
  - model BPE: `ignore_merges`, no byte fallback, dropout, subword prefix or suffix; every vocabulary entry is
    spelled in the ByteLevel alphabet; merges ranked and complete as above;
  - no normalizer; pre-tokenizer ByteLevel(use_regex) or Sequence[Split(regex, Isolated), ByteLevel(no regex)],
    without a prefix space; the split pattern translates from Oniguruma (which `tokenizers` runs) to fancy-regex
    (which tiktoken runs), see `onig_to_fancy`;
  - added tokens that strip nothing and match as written: they are cut out of the text first, as `tokenizers`
    does (leftmost, longest first), and the text between them is BPE-encoded;
  - the post-processor adds the same ids before and after any text (probed with two texts);
  - a self-test at load: texts dense in what could differ (digit runs, Unicode spaces and letters of every
    kind, case-folded apostrophes, CRs, the added tokens) encode to the same ids both ways.
Any other tokenizer keeps Hugging Face's encoder (`FastBpe` is None, with the reason), and so does a frontend
configured with `fast_bpe: false`. The check takes ~1 s of CPU; orchestrator/tokenizer.py runs it on its own thread
and encodes with Hugging Face's encoder until it is done.
"""

from __future__ import annotations

import json
import random
import re

__all__ = ["FastBpe", "fast_encoder", "onig_to_fancy"]

# HF's ByteLevel pre-tokenizer pattern (use_regex=True), in Oniguruma syntax
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# escapes that mean the same in both engines (outside or inside a class); anything else is refused
_SAME_ESCAPES = set("srntfvdwSDW") | set(r"\.^$|?*+()[]{}-/'\"#&~ ")
_PROPERTY = re.compile(r"\\[pP]\{\^?[A-Za-z_ =]+\}")
_COUNT = re.compile(r"\{(\d+)(,\d*)?\}")
_GROUP = re.compile(r"\((?!\?)|\(\?(?::|=|!|>|i:|-i:)")  # capturing, non-capturing, look-ahead, atomic, case-insensitive


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's ByteLevel alphabet: each byte as one printable character."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def onig_to_fancy(pattern: str) -> str | None:
    """The split pattern as fancy-regex reads it to mean what Oniguruma (Ruby syntax) means, or None when it uses
    anything whose meaning could differ. Two rewrites: `X{n,m}+` is a greedy repeat of `X{n,m}` in Oniguruma but
    possessive in fancy-regex, so it becomes `(?:X{n,m})+`; `^` and `$` are line anchors in Ruby syntax, so they
    become `(?m:^)` and `(?m:$)`. Possessive `?+ *+ ++`, look-ahead, atomic groups, `(?i:...)` and Unicode
    properties mean the same in both; the self-test (fast_encoder) checks the result on real text."""
    out: list[str] = []
    atom = -1  # index in `out` where the last complete atom starts
    groups: list[int] = []  # index in `out` of each open group's "("
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            m = _PROPERTY.match(pattern, i)
            if m:
                atom = len(out)
                out.append(m.group())
                i = m.end()
                continue
            nxt = pattern[i + 1:i + 2]
            if nxt not in _SAME_ESCAPES:  # \h \R \X \K \A \z \b, back-references, \x.. \u..: not translated
                return None
            atom = len(out)
            out.append(pattern[i:i + 2])
            i += 2
        elif ch == "[":
            j = i + 1
            if pattern[j:j + 1] == "^":
                j += 1
            if pattern[j:j + 1] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                if pattern[j] == "\\":
                    m = _PROPERTY.match(pattern, j)
                    if m:
                        j = m.end()
                        continue
                    if pattern[j + 1:j + 2] not in _SAME_ESCAPES:
                        return None
                    j += 2
                    continue
                if pattern[j] == "[" or pattern.startswith("&&", j):  # nested classes, set operations, [:alpha:]
                    return None
                j += 1
            if j >= n:
                return None
            atom = len(out)
            out.append(pattern[i:j + 1])
            i = j + 1
        elif ch == "(":
            m = _GROUP.match(pattern, i)
            if not m:
                return None  # named groups, look-behind, absent operator, inline flag changes, comments
            groups.append(len(out))
            out.append(m.group())
            i = m.end()
        elif ch == ")":
            if not groups:
                return None
            atom = groups.pop()
            out.append(")")
            i += 1
        elif ch == "{":
            m = _COUNT.match(pattern, i)
            if not m or atom < 0:
                return None
            i = m.end()
            if pattern[i:i + 1] == "+":  # Oniguruma: a greedy repeat of the counted repeat
                body = "".join(out[atom:])
                del out[atom:]
                out.append(f"(?:{body}{m.group()})+")
                i += 1
            else:
                out.append(m.group())
            atom = -1
        elif ch in "^$":
            out.append(f"(?m:{ch})")
            atom = -1
            i += 1
        elif ch in "?*+":
            out.append(ch)
            if pattern[i + 1:i + 2] in ("+", "?"):  # possessive or lazy: the same in both
                out.append(pattern[i + 1])
                i += 1
            atom = -1
            i += 1
        elif ch == "|":
            out.append(ch)
            atom = -1
            i += 1
        else:
            atom = len(out)
            out.append(ch)
            i += 1
    return "".join(out) if not groups else None


def _pattern_of(pre: dict | None) -> tuple[str | None, str | None]:
    """(Oniguruma split pattern, None) for the pre-tokenizers handled here, else (None, why not)."""
    if pre is None:
        return None, "no pre-tokenizer"
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space"):
            return None, "ByteLevel adds a prefix space"
        return (_GPT2_PATTERN, None) if pre.get("use_regex", True) else (None, "ByteLevel without a split")
    if pre.get("type") != "Sequence":
        return None, f"pre-tokenizer {pre.get('type')}"
    parts = pre.get("pretokenizers", [])
    if len(parts) != 2 or parts[0].get("type") != "Split" or parts[1].get("type") != "ByteLevel":
        return None, "pre-tokenizer sequence other than Split then ByteLevel"
    split, level = parts
    if level.get("add_prefix_space") or level.get("use_regex", True):
        return None, "ByteLevel after the split adds a prefix space or splits again"
    if split.get("behavior") != "Isolated" or split.get("invert"):
        return None, f"Split behaviour {split.get('behavior')}"
    regex = split.get("pattern", {}).get("Regex")
    return (regex, None) if regex else (None, "Split on a literal string")


def _ranks(model: dict) -> tuple[dict[bytes, int] | None, str | None]:
    """The vocabulary as tiktoken's mergeable ranks (bytes -> id), once the merges are checked to be ranked and
    complete; else (None, why not)."""
    if model.get("type") != "BPE":
        return None, f"model {model.get('type')}"
    if not model.get("ignore_merges"):
        return None, "BPE without ignore_merges"
    if model.get("byte_fallback") or model.get("dropout") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None, "BPE with byte fallback, dropout or subword affixes"
    vocab: dict[str, int] = model["vocab"]
    table = {ord(c): b for b, c in _bytes_to_unicode().items()}  # ByteLevel character -> the byte it spells
    try:
        ranks = {token.translate(table).encode("latin-1"): rank for token, rank in vocab.items()}
    except UnicodeEncodeError:
        return None, "a vocabulary entry outside the ByteLevel alphabet"
    if len(ranks) != len(vocab) or len(set(ranks.values())) != len(ranks) or any(bytes([b]) not in ranks for b in range(256)):
        return None, "the vocabulary is not one id per byte string with every byte"
    # ranked and complete, checked on the ByteLevel strings (one character per byte, so the same cuts)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    merged = set(merges)
    last = -1
    for a, b in merges:
        rank = vocab.get(a + b)
        if rank is None or rank < last or a not in vocab or b not in vocab:
            return None, "merges not ranked by the merged token's id"
        last = rank
    splits = sum(1 for t in vocab for cut in range(1, len(t)) if t[:cut] in vocab and t[cut:] in vocab)
    if splits != len(merged):  # every merge is one such split, so equal counts mean every split is a merge
        return None, "merges not complete (a pair of tokens that makes a token is not a merge)"
    return ranks, None


def _self_test_texts(rng: random.Random, added: list[str], count: int = 64, atoms_per_text: int = 300) -> list[str]:
    atoms = ["a", "Z", "é", "中", "ß", "ǅ", "ſ", "K", "İ", "ﬁ", "Ⅻ", "²", "١٢٣", "٣", "7", "12", "123", "1234567", "0.5",
             " ", "  ", "   ", "\t", "\r", "\n", "\n\n", "\r\n", " \n", "\n ", "\x0b", "\x0c", "\x85", "\xa0", "\u1680",
             "\u180e", "\u2000", "\u2028", "\u2029", "\u202f", "\u3000", "\u200b", "\ufeff", "\u0301", "\u0915\u094d",
             ".", "!", "?", "'", "'s", "'S", "'ſ", "'ll", "'LL", "'ve", "'re", "'d", "'m", "'t", "’s", "don't", "I'M",
             "-", "--", "...", "<|", "|>", "<", ">", "{", "}", "#", "$", "^", "\\", "_", "😀", "👩‍👩‍👧", "\U0001f1fa\U0001f1f8",
             "word", " word", "Word", "WORD", "x", "hello", " the", "The", ":", ";", "\"", "=", "==", "*", "**", "/", "//"]
    atoms += added
    return ["".join(rng.choice(atoms) for _ in range(atoms_per_text)) for _ in range(count)]


# texts this long are counted from a numpy buffer before any Python list is made: an over-limit prompt (hostile sizes)
# builds no list of ids, whose making would hold the GIL for every id, as Hugging Face's path does
_ARRAY_CHARS = 1 << 16


class FastBpe:
    """`encode(text, add_special_tokens)`: the ids `tokenizers` gives (see the module header for when that holds)."""

    def __init__(self, core, added: dict[str, int], prefix: list[int], suffix: list[int]) -> None:
        self._core = core
        self._encode_ordinary = core.encode_ordinary
        self._added = added
        # leftmost, then longest first: what tokenizers' added-vocabulary matcher picks
        self._added_re = re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True)))) if added else None
        self.prefix, self.suffix = prefix, suffix

    def _pieces(self, text: str) -> list[str | int]:
        """The text as ordinary pieces (str) and added tokens (their id), in order."""
        if self._added_re is None:
            return [text]
        out: list[str | int] = []
        at = 0
        for m in self._added_re.finditer(text):
            if m.start() > at:
                out.append(text[at:m.start()])
            out.append(self._added[m.group()])
            at = m.end()
        if at < len(text) or not out:
            out.append(text[at:])
        return out

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        pieces = self._pieces(text)
        if len(pieces) == 1 and type(pieces[0]) is str:
            ids = self._encode_ordinary(pieces[0])
        else:
            ids = []
            for p in pieces:
                if type(p) is str:
                    ids += self._encode_ordinary(p)
                else:
                    ids.append(p)
        if add_special_tokens and (self.prefix or self.suffix):
            return [*self.prefix, *ids, *self.suffix]
        return ids

    def count_or_ids(self, text: str, limit: int, add_special_tokens: bool = False) -> tuple[int, list[int] | None]:
        """(token count, ids), the ids only when the count is at most `limit`."""
        if len(text) < _ARRAY_CHARS:
            ids = self.encode(text, add_special_tokens)
            return len(ids), (ids if len(ids) <= limit else None)
        parts = [self._core.encode_to_numpy(p, disallowed_special=()) if type(p) is str else p for p in self._pieces(text)]
        extra = len(self.prefix) + len(self.suffix) if add_special_tokens else 0
        n = extra + sum(1 if type(p) is int else len(p) for p in parts)
        if n > limit:
            return n, None
        ids = list(self.prefix) if add_special_tokens else []
        for p in parts:
            if type(p) is int:
                ids.append(p)
            else:
                ids += p.tolist()
        if add_special_tokens:
            ids += self.suffix
        return n, ids


def _affixes(tok) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after any text (add_special_tokens), or None if that differs."""
    found = set()
    for probe in ("a", "hello world 123"):
        plain = tok.encode(probe, add_special_tokens=False).ids
        full = tok.encode(probe, add_special_tokens=True).ids
        at = next((k for k in range(len(full) - len(plain) + 1) if full[k:k + len(plain)] == plain), None)
        if at is None:
            return None
        found.add((tuple(full[:at]), tuple(full[at + len(plain):])))
    if len(found) != 1:
        return None
    prefix, suffix = found.pop()
    return list(prefix), list(suffix)


def fast_encoder(tok) -> tuple[FastBpe | None, str | None]:
    """(FastBpe, None) for a `tokenizers.Tokenizer` it encodes exactly, else (None, why not). Never raises: a
    tokenizer file this module does not expect keeps Hugging Face's encoder."""
    try:
        return _fast_encoder(tok)
    except Exception as exc:  # a shape of tokenizer.json not foreseen here
        return None, f"not checked ({type(exc).__name__}: {exc})"


def _fast_encoder(tok) -> tuple[FastBpe | None, str | None]:
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    state = json.loads(tok.to_str())
    if state.get("normalizer") is not None:
        return None, f"normalizer {state['normalizer'].get('type')}"
    pattern, why = _pattern_of(state.get("pre_tokenizer"))
    if why:
        return None, why
    fancy = onig_to_fancy(pattern)
    if fancy is None:
        return None, "the split pattern uses syntax not translated to fancy-regex"
    ranks, why = _ranks(state.get("model") or {})
    if why:
        return None, why
    added: dict[str, int] = {}
    for entry in state.get("added_tokens", []):
        if entry.get("lstrip") or entry.get("rstrip") or entry.get("single_word") or not entry.get("content"):
            return None, f"added token {entry.get('content')!r} strips whitespace or matches whole words only"
        added[entry["content"]] = entry["id"]
    affixes = _affixes(tok)
    if affixes is None:
        return None, "the post-processor's special tokens depend on the text"
    try:
        core = tiktoken.Encoding("kvyard-fast-bpe", pat_str=fancy, mergeable_ranks=ranks, special_tokens={})
    except Exception as exc:  # fancy-regex refused the pattern, or tiktoken the ranks
        return None, f"tiktoken refused the tokenizer: {exc}"
    fast = FastBpe(core, added, *affixes)
    texts = _self_test_texts(random.Random(22), list(added))
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    for special in (False, True):
        for text, want in zip(texts, encode(texts, add_special_tokens=special)):
            if fast.encode(text, special) != want.ids:
                return None, "the self-test found a text encoded differently"
    return fast, None
