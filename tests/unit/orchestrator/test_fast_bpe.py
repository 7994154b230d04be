"""orchestrator/fast_bpe.py: tiktoken's BPE core gives Hugging Face's ids exactly, or is not used."""

import copy
import json
import random

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer

from orchestrator import fast_bpe
from orchestrator.fast_bpe import fast_encoder, onig_to_fancy
from orchestrator.tokenizer import PromptTokenizer
from workers.sim.text import TOKENIZER_DIR as SIM_TOKENIZER_DIR

LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


@pytest.fixture(scope="module")
def sim_json() -> dict:
    return json.loads((SIM_TOKENIZER_DIR / "tokenizer.json").read_text())


@pytest.fixture(scope="module")
def sim():
    tok = Tokenizer.from_file(str(SIM_TOKENIZER_DIR / "tokenizer.json"))
    fast, why = fast_encoder(tok)
    assert why is None and fast is not None
    return tok, fast


def _tokenizer(state: dict, tmp_path) -> Tokenizer:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(state))
    return Tokenizer.from_file(str(path))


def _llama3_like(base: dict) -> dict:
    """The sim's vocabulary with Llama 3's split pattern, a BOS post-processor and Llama-style special tokens."""
    state = copy.deepcopy(base)
    state["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = LLAMA3_PATTERN
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_01|>", "<|python_tag|>"]
    first = max(t["id"] for t in state["added_tokens"]) + 1
    for k, content in enumerate(specials):
        state["added_tokens"].append({"id": first + k, "content": content, "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    bos = {"id": "<|begin_of_text|>", "ids": [first], "tokens": ["<|begin_of_text|>"]}
    state["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|begin_of_text|>": bos}}
    return state


def test_onig_patterns_translate_where_the_engines_read_them_differently():
    # Oniguruma reads {1,3}+ as a greedy repeat of the counted group (a whole digit run is one piece); fancy-regex
    # would read it as possessive (pieces of three digits)
    assert onig_to_fancy(r"\p{N}{1,3}+") == r"(?:\p{N}{1,3})+"
    assert onig_to_fancy(r"(?:ab){2}+|x") == r"(?:(?:ab){2})+|x"
    assert onig_to_fancy(r"\s++$|a?+b*+") == r"\s++(?m:$)|a?+b*+"  # line anchors in Ruby syntax; possessives alike
    assert onig_to_fancy(LLAMA3_PATTERN) == LLAMA3_PATTERN.replace("$", "(?m:$)")
    for unknown in (r"\h+", r"(?<=a)b", r"[[:alpha:]]", r"[a-z&&[^b]]", r"(?<name>x)", r"(a", r"a)", r"\1", r"\x41", r"(?x)a"):
        assert onig_to_fancy(unknown) is None, unknown


def test_the_sim_tokenizer_encodes_alike(sim):
    tok, fast = sim
    for text in ("", "hello world", " 32581598 x", "a\n\nb\r\n c", "don't I'M 'ſ", "<|endoftext|>x<|endoftext|>",
                 "x" * 5000, "1" * 5000, " " * 300 + "\n", "中文 and émoji 😀\u3000\u2028", "<|endoftext|"):
        for special in (False, True):
            assert fast.encode(text, special) == tok.encode(text, add_special_tokens=special).ids, repr(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)
       | st.lists(st.sampled_from(["a", "Z", "7", "12345", " ", "  ", "\n", "\r\n", "\t", "'s", "'LL", ".", "<|endoftext|>",
                                   "é", "中", "\xa0", "\x85", "😀", "-", "?!", "word"]), max_size=80).map("".join))
def test_any_text_encodes_alike(sim, text):
    tok, fast = sim
    assert fast.encode(text) == tok.encode(text, add_special_tokens=False).ids


def test_a_llama3_like_tokenizer_with_bos_and_special_tokens(sim_json, tmp_path):
    tok = _tokenizer(_llama3_like(sim_json), tmp_path)
    fast, why = fast_encoder(tok)
    assert why is None
    bos = tok.token_to_id("<|begin_of_text|>")
    assert fast.prefix == [bos] and fast.suffix == []
    rng = random.Random(3)
    for _ in range(50):
        text = "".join(rng.choice(["<|start_header_id|>", "user", "<|end_header_id|>", "\n\n", "Hi 123456 there", "<|eot_id|>",
                                   "<|reserved_special_token_01|>", "<|reserved_special_token_0|>", "<|", "'s", " "]) for _ in range(40))
        for special in (False, True):
            assert fast.encode(text, special) == tok.encode(text, add_special_tokens=special).ids, repr(text)
    # the longer of two added tokens that start alike wins, as in tokenizers
    assert fast.encode("<|reserved_special_token_01|>") == [tok.token_to_id("<|reserved_special_token_01|>")]


def test_a_gpt2_style_byte_level_pre_tokenizer(sim_json, tmp_path):
    state = copy.deepcopy(sim_json)
    state["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tok = _tokenizer(state, tmp_path)
    fast, why = fast_encoder(tok)
    assert why is None
    text = "Hello  world's 2024 numbers\n\n  and   spaces\t!"
    assert fast.encode(text) == tok.encode(text, add_special_tokens=False).ids


def _tiny() -> dict:
    """A small tiktoken-style tokenizer.json: the 256 bytes, then a few merged tokens by rank, every split of a token
    into two tokens a merge (what converters from tiktoken write), the sim's split pattern and one added token."""
    alphabet = fast_bpe._bytes_to_unicode()
    spell = lambda b: "".join(alphabet[x] for x in b)  # noqa: E731
    vocab = {spell(bytes([b])): i for i, b in enumerate(sorted(alphabet))}
    for word in (b"th", b"he", b"in", b" t", b"the", b" the", b"ng", b"ing", b"12", b"123", b"\n\n"):
        vocab[spell(word)] = len(vocab)
    merges = sorted(((a, t[len(a):]) for t in vocab for a in (t[:k] for k in range(1, len(t)))
                     if a in vocab and t[len(a):] in vocab), key=lambda m: vocab[m[0] + m[1]])
    sim = json.loads((SIM_TOKENIZER_DIR / "tokenizer.json").read_text())
    return {"version": "1.0", "truncation": None, "padding": None, "normalizer": None,
            "added_tokens": [{"id": len(vocab), "content": "<|end|>", "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True}],
            "pre_tokenizer": sim["pre_tokenizer"], "post_processor": sim["post_processor"], "decoder": sim["decoder"],
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                      "vocab": vocab, "merges": [[a, b] for a, b in merges]}}


def _refused(state: dict, tmp_path) -> str:
    tok = _tokenizer(state, tmp_path)
    fast, why = fast_encoder(tok)
    assert fast is None and why
    return why


def test_tokenizers_it_cannot_match_are_refused(tmp_path):
    def variant(edit):
        state = _tiny()
        edit(state)
        return state

    tiny = _tokenizer(_tiny(), tmp_path)
    fast, why = fast_encoder(tiny)
    assert why is None and fast.encode("the thing 123<|end|>\n\n") == tiny.encode("the thing 123<|end|>\n\n").ids

    assert "ignore_merges" in _refused(variant(lambda s: s["model"].update(ignore_merges=False)), tmp_path)
    assert "normalizer" in _refused(variant(lambda s: s.update(normalizer={"type": "NFC"})), tmp_path)
    assert "not complete" in _refused(variant(lambda s: s["model"]["merges"].pop(2)), tmp_path)

    def swap(s):
        m = s["model"]["merges"]
        m[0], m[-1] = m[-1], m[0]
    assert "ranked" in _refused(variant(swap), tmp_path)

    def strip(s):
        s["added_tokens"][0]["lstrip"] = True
    assert "strips" in _refused(variant(strip), tmp_path)
    assert "pre-tokenizer" in _refused(variant(lambda s: s.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁",
                                                                                  "prepend_scheme": "always", "split": True})), tmp_path)

    def look_behind(s):
        s["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"(?<=a)b|\s+|\S+"
    assert "syntax" in _refused(variant(look_behind), tmp_path)


def test_the_self_test_catches_a_wrong_translation(monkeypatch, tmp_path):
    # without the {1,3}+ rewrite tiktoken splits digit runs in threes where tokenizers does not
    monkeypatch.setattr(fast_bpe, "onig_to_fancy", lambda pattern: pattern)
    assert "self-test" in _refused(_tiny(), tmp_path)


def test_the_prompt_tokenizer_uses_it_and_can_be_told_not_to(sim):
    tok, _ = sim
    on, off = PromptTokenizer(SIM_TOKENIZER_DIR), PromptTokenizer(SIM_TOKENIZER_DIR, fast_bpe=False)
    text = "Some text 123456, with\nlines <|endoftext|> and more" * 40
    want = tok.encode(text).ids
    assert on.encode(text) == want  # usable at once: Hugging Face's encoder while the fast one is checked
    assert on.wait_fast(60) is not None and on.fast_reason is None
    assert off.wait_fast(0) is None and off.fast_reason == "fast_bpe is off"
    for t in (on, off):
        assert t.encode(text) == want
        assert t.encode_many([text, "x"], add_special_tokens=False) == [tok.encode(text, add_special_tokens=False).ids, [87]]
        assert t.count_or_ids(text, 1 << 20) == (len(want), want)
        assert t.count_or_ids(text, 10) == (len(want), None)


def test_long_texts_are_counted_before_any_list_is_made(sim_json, tmp_path):
    tok = _tokenizer(_llama3_like(sim_json), tmp_path)
    fast, _ = fast_encoder(tok)
    assert fast is not None
    text = ("Some words 1234567 and <|eot_id|> a special token, \n" * 3000)[:fast_bpe._ARRAY_CHARS + 999]
    for special in (False, True):
        want = tok.encode(text, add_special_tokens=special).ids
        assert fast.count_or_ids(text, 1 << 30, special) == (len(want), want)
        assert fast.count_or_ids(text, len(want) - 1, special) == (len(want), None)
        assert fast.count_or_ids("<|eot_id|>", 5, special)[1] == tok.encode("<|eot_id|>", add_special_tokens=special).ids


def test_an_unforeseen_tokenizer_shape_keeps_the_hugging_face_encoder(monkeypatch, tmp_path):
    def unforeseen(model):
        raise KeyError("vocab")
    monkeypatch.setattr(fast_bpe, "_ranks", unforeseen)
    fast, why = fast_encoder(_tokenizer(_tiny(), tmp_path))
    assert fast is None and why.startswith("not checked (KeyError")
