"""Build a tiny PEFT-format LoRA adapter for the tiny random Llama (workers/vllm/testmodel.py).

Standalone on purpose, like testmodel.py (whose folder publishing it shares): it runs under any interpreter with
`safetensors` and numpy (the engine's own, or kvyard's), with no kvyard imports,

    python workers/vllm/testlora.py MODEL_DIR OUTDIR [SEED]

and writes a folder that vLLM's `/v1/load_lora_adapter` (and SGLang's `/load_lora_adapter`) load offline:

- `adapter_config.json`: PEFT's LoraConfig fields (peft_type LORA, r 8, lora_alpha 16, target_modules
  q_proj and v_proj, no bias, CAUSAL_LM), `base_model_name_or_path` = MODEL_DIR;
- `adapter_model.safetensors`: for every layer `base_model.model.model.layers.{i}.self_attn.{q,v}_proj.lora_{A,B}.weight`,
  A of shape [r, hidden] and B of shape [out, r], float32, random from SEED (B not zero, so the adapter changes
  the output: an adapter that equals the base model would hide a mix-up).

The shapes are read from MODEL_DIR/config.json. Deterministic per (model config, seed) and idempotent: a
complete folder (its `.kvyard-testlora` marker names the seed) is left as it is. Nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling testmodel.py, standalone too
from testmodel import publish_dir  # noqa: E402

MARKER = ".kvyard-testlora"
RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "v_proj")

__all__ = ["build", "is_complete", "RANK", "TARGETS"]


def is_complete(out: Path, seed: int) -> bool:
    marker = out / MARKER
    return (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file() and marker.is_file() \
        and marker.read_text().strip() == str(seed)


def _weights(config: dict, seed: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    outs = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((RANK, hidden)) * 0.05).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((outs[target], RANK)) * 0.05).astype(np.float32)
    return tensors


def build(model_dir: Path, out: Path, seed: int = 1) -> bool:
    """Write the adapter to `out`; returns False if it was already complete."""
    from safetensors.numpy import save_file

    if out.is_dir() and is_complete(out, seed):
        return False
    config = json.loads((model_dir / "config.json").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        save_file(_weights(config, seed), str(tmp / "adapter_model.safetensors"))
        adapter_config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
            "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": list(TARGETS),
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
            "use_rslora": False, "use_dora": False,
        }  # fmt: skip
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
        publish_dir(tmp, out, MARKER, str(seed))
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(f"usage: {argv[0]} MODEL_DIR OUTDIR [SEED]", file=sys.stderr)
        return 2
    seed = int(argv[3]) if len(argv) == 4 else 1
    out = Path(argv[2]).resolve()
    built = build(Path(argv[1]).resolve(), out, seed)
    print(f"{'built' if built else 'already complete'}: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
