"""workers.chat_template: Hugging Face's precedence, list-form templates, special tokens in scope."""

from __future__ import annotations

import json

import pytest

from orchestrator.tokenizer import PromptTokenizer
from workers.chat_template import ChatTemplate
from workers.sim.backend import SIM_TOKENIZER_DIR
from workers.sim.text import SimTokenizer

MSGS = [{"role": "user", "content": "hi"}]


def folder(tmp_path, config: dict, jinja: str | None = None):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


@pytest.mark.parametrize(
    "config, jinja, expected",
    [
        ({"chat_template": "C{{ messages[0].content }}"}, None, "Chi"),  # config string
        ({"chat_template": "C"}, "F{{ messages[0].content }}", "Fhi"),  # the .jinja file wins, as in Hugging Face
        ({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}, None, "D"),
        ({"bos_token": "<s>", "chat_template": "{{ bos_token }}{{ messages[0].content }}"}, None, "<s>hi"),  # specials in scope
    ],
)
def test_template_sources(tmp_path, config, jinja, expected):
    assert ChatTemplate(folder(tmp_path, config, jinja)).render(MSGS, add_generation_prompt=False) == expected


def test_no_template_uses_fallback_or_refuses(tmp_path):
    f = folder(tmp_path, {})
    assert ChatTemplate(f, fallback="X").render(MSGS) == "X"
    with pytest.raises(ValueError):
        ChatTemplate(f).render(MSGS)


def test_frontend_and_sim_tokenize_chat_identically():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a KV cache?"}]
    sim = SimTokenizer(SIM_TOKENIZER_DIR)
    assert PromptTokenizer(SIM_TOKENIZER_DIR).encode_chat(msgs) == sim.encode(sim.apply_chat_template(msgs), add_special_tokens=False)
