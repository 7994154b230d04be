"""Build the tiny random Llama that the vLLM-CPU integration tests serve.

Standalone on purpose: it runs under the engine's own interpreter, with no kvyard imports,

    .venv-vllm/bin/python workers/vllm/testmodel.py OUTDIR

and writes a Hugging Face model folder that `vllm serve`-style servers load offline:

- a byte-level BPE tokenizer trained locally with `tokenizers` on the built-in sentences below
  (vocab ~400; specials `<s>`, `</s>`, `<pad>`; a one-line chat template), wrapped in
  `PreTrainedTokenizerFast` (tokenizer.json + tokenizer_config.json carrying `chat_template`);
- a `LlamaConfig` with hidden 256, intermediate 512, 2 layers, 4 heads, 2 KV heads (head_dim 64),
  1024 max positions and untied embeddings, with random weights from a fixed seed, saved in bfloat16.

Deterministic (same bytes every run) and idempotent: if OUTDIR already holds a complete model
(marked by the `.kvyard-testmodel` file written last) nothing is done. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

MARKER = ".kvyard-testmodel"
VERSION = "1"
SEED = 1234
VOCAB_SIZE = 400
SPECIALS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER)

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A KV-aware router sends each request to the worker that already holds its prefix.",
    "Prefill computes the cache for the prompt; decode generates one token at a time.",
    "The planner scales prefill and decode pools against latency and throughput targets.",
    "Once upon a time there was a tiny model that lived on a small CPU.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2048 appear in prompts too.",
    "Engines publish block stored and block removed events over a ZeroMQ socket.",
    "user: write a short poem about the sea. assistant: the sea is wide and blue.",
    "system: you are a helpful assistant that answers questions briefly and clearly.",
]


def is_complete(out: Path) -> bool:
    return all((out / name).is_file() for name in REQUIRED) and (out / MARKER).read_text().strip() == VERSION


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )


def build_model(tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16)


def _write_tokenizer_config(folder: Path, tokenizer) -> None:
    """Rewrite tokenizer_config.json in the classic form that every reader understands.

    transformers 5 moves the chat template into chat_template.jinja and names a v5-only class;
    plain `tokenizers` + jinja readers (and older transformers) expect both in tokenizer_config.json.
    """
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tokenizer.convert_tokens_to_ids(t)): {
                "content": t, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True,
            }
            for t in SPECIALS
        },
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build(out: Path) -> bool:
    """Write the model to `out`; returns False if it was already complete."""
    if out.is_dir() and is_complete(out):
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _write_tokenizer_config(tmp, tokenizer)
        publish_dir(tmp, out, MARKER, VERSION)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def publish_dir(tmp: Path, out: Path, marker: str, stamp: str) -> None:
    """Make a finished build in `tmp` readable by the engine's user, stamp it (`marker` file), and move it to `out`
    in one rename, so a reader never sees a half-built folder."""
    for path in [tmp, *tmp.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (tmp / marker).write_text(stamp + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUTDIR", file=sys.stderr)
        return 2
    out = Path(argv[1]).resolve()
    built = build(out)
    print(f"{'built' if built else 'already complete'}: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
