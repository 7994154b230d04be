"""The sim engine's LoRA adapters (vLLM's runtime API and cache keys) and multimodal chat parts, in process.

Its KV events are checked too: a LoRA request's BlockStored names the adapter and carries vLLM's extra keys, and
the published block hashes are what vLLM 0.32 computes for the same keys (workers/vllm/hashing.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from router.kv_events import BlockStored
from workers.sim.config import parse_args
from workers.sim.server import build_app
from workers.vllm.hashing import vllm_block_hashes, vllm_extra_keys

PROMPT = list(range(1000, 1070))  # 70 tokens: 4 full blocks of 16
IMG1 = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
IMG2 = {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}}


@pytest.fixture(scope="module")
def sim(tmp_path_factory) -> Iterator[tuple[TestClient, object, str]]:
    folder = tmp_path_factory.mktemp("adapters")
    for name in ("a", "b"):
        (folder / name).mkdir()
        (folder / name / "adapter_config.json").write_text("{}")
    cfg = parse_args(["--model", "h200-llama3.1-8b", "--served-model-name", "m", "--speedup", "50", "--port", "0", "--enable-lora",
                      "--enable-prompt-tokens-details", "--mm-image-tokens", "40"], env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    app = build_app(cfg)
    with TestClient(app) as c:
        yield c, app.state.sim, str(folder)


def cached(client: TestClient, model: str, prompt=PROMPT) -> int:
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_runtime_adapters_follow_vllms_api(sim):
    client, st, folder = sim
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "ad-a", "lora_path": f"{folder}/a"}).status_code == 200
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "ad-a", "lora_path": f"{folder}/a"})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    missing = client.post("/v1/load_lora_adapter", json={"lora_name": "ad-x", "lora_path": f"{folder}/none"})
    assert missing.status_code == 404 and "No adapter found" in missing.json()["error"]["message"]
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": f"{folder}/a"}).status_code == 400
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "ad-b"}).status_code == 400
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["ad-a"]["parent"] == "m" and models["ad-a"]["root"] == f"{folder}/a"
    r = client.post("/v1/completions", json={"model": "ad-x", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}).status_code == 404


def test_adapters_never_share_blocks_with_each_other_or_the_base(sim):
    client, st, folder = sim
    for name in ("ad-a", "ad-b"):
        client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"{folder}/{name[-1]}"})
    events: list = []
    st.engine.kv.enable_events = True
    st.engine.publisher = type("Capture", (), {"publish": lambda self, evs: events.extend(evs)})()
    assert cached(client, "ad-a") == 0
    assert cached(client, "ad-a") == 64  # the adapter's own prefix hits
    assert cached(client, "ad-b") == 0  # same prompt, other adapter: no shared block
    assert cached(client, "m") == 0  # nor the base model
    st.engine.publisher, st.engine.kv.enable_events = None, False
    stored = [e for e in events if isinstance(e, BlockStored)]
    by_lora = {e.lora_name: e for e in stored if e.parent_block_hash is None}
    assert set(by_lora) == {"ad-a", "ad-b", None}
    for name in ("ad-a", "ad-b"):  # the published hashes are vLLM's for ("lora", name, path)
        keys = vllm_extra_keys(len(PROMPT), 16, lora=(name, f"{folder}/{name[-1]}"))
        assert by_lora[name].block_hashes == vllm_block_hashes(PROMPT, 16, extra_keys=keys)
    assert by_lora[None].block_hashes == vllm_block_hashes(PROMPT, 16)


def chat(client: TestClient, content) -> dict:
    r = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": content}]})
    return r.json() | {"status": r.status_code}


def test_image_parts_are_charged_and_keyed_by_image(sim):
    client, st, folder = sim
    text = {"type": "text", "text": "Please describe what you see in this picture, in as much detail as you can manage today."}
    first = chat(client, [text, IMG1, {"type": "text", "text": "one"}])
    plain = chat(client, [text, {"type": "text", "text": "one"}])
    assert first["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + 40 + 1  # the run + the "\n" around it
    same = chat(client, [text, IMG1, {"type": "text", "text": "two"}])
    other = chat(client, [text, IMG2, {"type": "text", "text": "two"}])
    n = first["usage"]["prompt_tokens"]
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] >= (n - 4) // 16 * 16 - 16  # all but the tail block
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < same["usage"]["prompt_tokens_details"]["cached_tokens"] - 32


def test_unsupported_parts_are_a_400(sim):
    client, st, folder = sim
    r = chat(client, [{"type": "video_url", "video_url": {"url": "v"}}])
    assert r["status"] == 400 and "video_url" in r["error"]["message"]
