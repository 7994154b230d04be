"""Multimodal chat prompts: parts, identifiers, placeholder runs; the frontend and the sim lay them out the same."""

from __future__ import annotations

import hashlib
import json

import pytest

from orchestrator.errors import BadRequestError
from orchestrator.multimodal import MultimodalConfig, chat_prompt, stamp_uuids
from orchestrator.tokenizer import load_tokenizer
from router.mm_hashing import block_mm_keys
from workers.multimodal import ContentError, MmTokenSpec, flatten_messages, item_identifier, tokenize_mm_chat
from workers.sim.backend import SIM_TOKENIZER_DIR
from workers.sim.text import SimTokenizer

IMG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}


def test_identifiers_are_content_hashes_or_the_clients_uuid():
    assert item_identifier(IMG) == ("image", hashlib.sha256(json.dumps(["image_url", "data:image/png;base64,AAAA"]).encode()).hexdigest())
    assert item_identifier({**IMG, "uuid": "cat-1"}) == ("image", "cat-1")
    assert item_identifier(AUDIO)[0] == "audio"
    assert item_identifier({"type": "audio_url", "audio_url": {"url": "https://x/a.wav"}})[0] == "audio"
    assert item_identifier(IMG) != item_identifier({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAB"}})


@pytest.mark.parametrize("part,param", [
    ({"type": "video_url", "video_url": {"url": "x"}}, "messages.0.content.1.type"),
    ({"type": "image_url"}, "messages.0.content.1.image_url.url"),
    ({"type": "input_audio", "input_audio": {"format": "wav"}}, "messages.0.content.1.input_audio.data"),
    ({"type": "text", "text": 3}, "messages.0.content.1.text"),
    ({"type": "image_url", "image_url": {"url": "u"}, "uuid": ""}, "messages.0.content.1.uuid"),
    ("not a dict", "messages.0.content.1.type"),
])
def test_unsupported_or_malformed_parts_name_the_place(part, param):
    with pytest.raises(ContentError) as e:
        flatten_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    assert e.value.param == param


def test_placeholder_runs_are_spliced_where_the_parts_are():
    spec = MmTokenSpec(tokens_per_image=5, image_token_id=9, tokens_per_audio=3, audio_token_id=8)
    msgs, items = flatten_messages([{"role": "user", "content": [{"type": "text", "text": "ab"}, IMG, AUDIO, {"type": "text", "text": "c"}]}])
    rendered = "<u>" + msgs[0]["content"] + "</u>"
    ids, mm = tokenize_mm_chat(rendered, items, lambda s: [ord(ch) for ch in s], spec)
    # "<u>ab\n" = 6 chars, then the image run, "\n", the audio run, "\nc</u>"
    assert ids[:6] == [ord(c) for c in "<u>ab\n"] and ids[6:11] == [9] * 5 and ids[11] == ord("\n") and ids[12:15] == [8] * 3
    assert mm == [(items[0][1], 6, 5), (items[1][1], 12, 3)]


def test_block_keys_cover_every_block_an_item_touches():
    assert block_mm_keys(64, 16, [("a", 10, 30)]) == [(("a", 10),), (("a", -6),), (("a", -22),), None]
    assert block_mm_keys(40, 16, [("a", 30, 30)]) == [None, (("a", 14),)]  # the partial last block is not hashed


def test_the_frontend_and_the_sim_tokenize_a_multimodal_chat_identically():
    """The frontend hashes what the sim engine caches: same ids, same items, for text parts and images."""
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "look:"}, IMG, {"type": "text", "text": "and this"}, {**IMG, "uuid": "u2"}]}]
    spec = MultimodalConfig().spec()
    ids, items = chat_prompt(load_tokenizer(str(SIM_TOKENIZER_DIR)), msgs, spec)
    sim = SimTokenizer()
    flat, parts = flatten_messages(msgs)
    sim_ids, sim_items = tokenize_mm_chat(sim.apply_chat_template(flat), parts, lambda s: sim.encode(s, add_special_tokens=False), spec)
    assert ids == sim_ids and items == sim_items and len(items) == 2 and items[1][0] == "u2"
    assert ids.count(spec.image_token_id) >= 2 * spec.tokens_per_image


def test_text_only_list_content_joins_parts_with_newlines_as_vllm():
    tok = load_tokenizer(str(SIM_TOKENIZER_DIR))
    a, _ = chat_prompt(tok, [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}], MmTokenSpec())
    b, _ = chat_prompt(tok, [{"role": "user", "content": "one\ntwo"}], MmTokenSpec())
    assert a == b


def test_bad_part_is_a_400_from_the_frontend_helper():
    with pytest.raises(BadRequestError) as e:
        chat_prompt(load_tokenizer(str(SIM_TOKENIZER_DIR)), [{"role": "user", "content": [{"type": "file", "file": {}}]}], MmTokenSpec())
    assert e.value.status == 400 and e.value.param == "messages.0.content.0.type"


def test_stamp_uuids_fills_missing_ones_only():
    body = {"model": "m", "messages": [{"role": "user", "content": [IMG, {**IMG, "uuid": "mine"}, {"type": "text", "text": "x"}]}]}
    out = stamp_uuids(body)
    parts = out["messages"][0]["content"]
    assert parts[0]["uuid"] == item_identifier(IMG)[1] and parts[1]["uuid"] == "mine" and "uuid" not in parts[2]
    assert "uuid" not in body["messages"][0]["content"][0]  # the client's body is not changed in place
    plain = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert stamp_uuids(plain) is plain
