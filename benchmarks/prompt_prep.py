"""Prompt preparation: the frontend CPU spent turning a long chat into the token ids routing needs, eager against
lazy, and with each encoder (Hugging Face `tokenizers`, or tiktoken's core where orchestrator/fast_bpe.py proves it exact).

    PYTHONPATH=. .venv/bin/python benchmarks/prompt_prep.py [--rounds 5]

In one process, no HTTP and no engine, so the figure is the prepare step alone (orchestrator/prepare.py):
`PromptPreparer.prompt_ids` per request, CPU time of the process (all its threads: the thread pool tokenizes) from
time.process_time. Five modes, alternated within each round (their order rotated) on the same prompts:
  eager   every prompt token, as before lazy tokenizing (and as the frontend still does for workers without KV events)
  lazy    the kv policy's probe (Router.prefix_cached) against a KV index that holds every prompt sent before, whole,
          as the engines' KV events would (each prompt's full blocks are stored after it is prepared)
  learn   lazy, then the prompt's whole ids are offered to the chunk cache, as from vLLM's answer, which learns what
          was left untokenized when the text comes again (ChunkedTokenizer.offer, .learn; timed with the prompts;
          the C parse of the ids on the relay is not)
each with the encoder `hf` (frontend.fast_bpe: false) and `fast` (the default; the same ids); learn with fast only.
Workloads (text: words drawn from the sim tokenizer's vocabulary, seeded; the sim's cl100k tokenizer):
  multi-turn  8 conversations x 5 turns: a ~4k-token system prompt shared by all, a ~14k-token document of its own,
              then every turn re-sends the history plus one more assistant/user exchange (as chat clients do)
  one-shot    40 prompts, each a ~18k-token document nobody sent before, after the same system prompt
Reported per workload and mode: median CPU-ms per prompt over the rounds, lazy / eager and fast / hf. Then the encoders
alone (`encode`): CPU-us per call of PromptTokenizer.count_or_ids on a one-shot document and on a 64-token prompt.
Writes benchmarks/results/prompt_prep.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
from array import array
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import result_header  # noqa: E402
from orchestrator.prepare import EAGER, PromptPreparer  # noqa: E402
from orchestrator.protocol import ChatCompletionRequest  # noqa: E402
from orchestrator.tokenizer import load_tokenizer  # noqa: E402
from router import KvIndex, Router, build_policy  # noqa: E402
from workers.sim.backend import SIM_TOKENIZER_DIR  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BLOCK = 16


class _Pool:
    def tokenizer_dir(self, model: str) -> str:
        return str(SIM_TOKENIZER_DIR)


def _words(tok) -> list[str]:
    vocab = tok.raw.get_vocab()
    return sorted(w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and len(w) > 3)


def _text(rng: random.Random, words: list[str], n_words: int) -> str:
    lines = [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(max(1, n_words // 12))]
    return "\n".join(lines)


def conversations(rng: random.Random, words: list[str], oneshot: bool) -> list[list[list[dict]]]:
    """Per conversation, the message list of each request."""
    system = {"role": "system", "content": _text(rng, words, 3000)}
    if oneshot:
        return [[[system, {"role": "user", "content": _text(rng, words, 13000)}]] for _ in range(40)]
    out = []
    for _ in range(8):
        msgs = [system, {"role": "user", "content": _text(rng, words, 10000)}]
        turns = []
        for _ in range(5):
            turns.append(list(msgs))
            msgs = msgs + [{"role": "assistant", "content": _text(rng, words, 100)},
                           {"role": "user", "content": _text(rng, words, 150)}]
        out.append(turns)
    return out


MODES = ("lazy-fast", "eager-fast", "lazy-hf", "eager-hf", "learn-fast")


async def run(mode: str, convs: list[list[list[dict]]], tok) -> float:
    """CPU-ms per prompt for one pass over the workload with a fresh preparer and index."""
    prep = PromptPreparer(_Pool(), cache_tokens=2_000_000, fast_bpe=mode.endswith("-fast"))
    index = KvIndex()
    index.add_worker("w", block_size=BLOCK)
    router = Router(build_policy("kv", index=index))
    how_far = (lambda: EAGER) if mode.startswith("eager") else (lambda: (lambda ids: router.prefix_cached(ids, BLOCK)))
    cpu, n, stored = 0.0, 0, 0
    try:
        for turn in range(max(len(c) for c in convs)):  # turn by turn across conversations, as they interleave
            for conv in convs:
                if turn >= len(conv):
                    continue
                req = ChatCompletionRequest.model_validate({"model": "m", "messages": conv[turn]})
                full = tok.encode_chat(conv[turn])  # what the engine caches and reports (untimed)
                engine_ids = array("I", full).tobytes()
                t0 = time.process_time()
                got = await prep.prompt_ids(req, "m", 1 << 20, how_far=how_far)
                if mode.startswith("learn") and (learn := prep.learner(got)) is not None:
                    learn(engine_ids)  # as the relay does with the answer's ids: offered, learned on the next sight
                cpu += time.process_time() - t0
                n += 1
                blocks = len(full) // BLOCK
                index.store("w", list(range(stored, stored + blocks)), None, full[: blocks * BLOCK], BLOCK)
                stored += blocks
    finally:
        prep.close()
    return cpu * 1e3 / n


def encode_cpu_us(tok, text: str, calls: int) -> float:
    """CPU-us per count_or_ids call (the whole text, no chunk cache)."""
    t0 = time.process_time()
    for _ in range(calls):
        tok.count_or_ids(text, 1 << 30, add_special_tokens=False)
    return (time.process_time() - t0) * 1e6 / calls


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="prompt_prep")
    a = ap.parse_args()
    tok = load_tokenizer(str(SIM_TOKENIZER_DIR))
    hf = load_tokenizer(str(SIM_TOKENIZER_DIR), fast_bpe=False)
    assert tok.wait_fast(120) is not None, tok.fast_reason
    words = _words(tok)
    warm = PromptPreparer(_Pool(), cache_tokens=2_000_000)
    warm.chunked(tok)._table()  # the token bytes table, made once per tokenizer in a frontend's life: not timed
    warm.close()
    result = result_header("prompt_prep") | {"command": "benchmarks/prompt_prep.py " + " ".join(sys.argv[1:]), "workloads": {}}
    for name, oneshot in (("multi-turn", False), ("one-shot", True)):
        per: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(a.rounds):
            convs = conversations(random.Random(1000 + r), words, oneshot)
            for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
                per[mode].append(await run(mode, convs, tok))
        tokens = statistics.mean(len(tok.encode_chat(c[-1])) for c in conversations(random.Random(1000), words, oneshot))
        med = {m: statistics.median(v) for m, v in per.items()}
        result["workloads"][name] = {"prompt_tokens_mean": round(tokens), "cpu_ms_per_prompt": {m: round(v, 2) for m, v in med.items()},
                                     "rounds": {m: [round(x, 2) for x in v] for m, v in per.items()},
                                     "lazy_over_eager": {e: round(med[f"lazy-{e}"] / med[f"eager-{e}"], 3) for e in ("fast", "hf")},
                                     "learn_over_lazy": round(med["learn-fast"] / med["lazy-fast"], 3),
                                     "fast_over_hf": {w: round(med[f"{w}-fast"] / med[f"{w}-hf"], 3) for w in ("lazy", "eager")}}
        print(name, result["workloads"][name], flush=True)
    doc = conversations(random.Random(7), words, True)[0][0][-1]["content"]
    short = " ".join(random.Random(8).choice(words) for _ in range(64))
    enc = {}
    for label, text, calls in (("document", doc, 20), ("64 words", short, 5000)):
        runs = {"fast": [], "hf": []}
        for r in range(a.rounds):
            for e, t in ((("fast", tok), ("hf", hf)) if r % 2 == 0 else (("hf", hf), ("fast", tok))):
                runs[e].append(encode_cpu_us(t, text, calls))
        med = {e: statistics.median(v) for e, v in runs.items()}
        enc[label] = {"tokens": len(tok.encode(text, add_special_tokens=False)), "cpu_us_per_call": {e: round(v, 1) for e, v in med.items()},
                      "rounds": {e: [round(x, 1) for x in v] for e, v in runs.items()}, "fast_over_hf": round(med["fast"] / med["hf"], 3)}
        print("encode", label, enc[label], flush=True)
    result["encode"] = enc
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    md = [f"# Prompt preparation: eager vs lazy, Hugging Face vs fast encoder ({result['when']})", "", f"    {result['command']}", "",
          "CPU time of the process (all threads) in PromptPreparer.prompt_ids per prompt; median over rounds. Lazy: the kv "
          "policy's probe against an index holding every earlier prompt whole (as the engines' KV events would). hf: "
          "frontend.fast_bpe off; fast: tiktoken's core (orchestrator/fast_bpe.py), the same ids. learn: lazy, with each "
          "prompt's whole ids offered to the chunk cache, which learns its untokenized chunks when they come again "
          "(ChunkedTokenizer.offer, .learn), timed with the prompts.", "",
          "| workload | prompt tokens (mean, last turn) | " + " | ".join(f"{m}: CPU-ms / prompt" for m in MODES)
          + " | lazy / eager (fast, hf) | fast / hf (lazy, eager) | learn / lazy (fast) |",
          "|---|---|" + "---|" * (len(MODES) + 3)]
    for name, w in result["workloads"].items():
        c, le, fh = w["cpu_ms_per_prompt"], w["lazy_over_eager"], w["fast_over_hf"]
        md.append(f"| {name} | {w['prompt_tokens_mean']:,} | " + " | ".join(str(c[m]) for m in MODES)
                  + f" | {le['fast']}, {le['hf']} | {fh['lazy']}, {fh['eager']} | {w['learn_over_lazy']} |")
    md += ["", "The encoders alone (PromptTokenizer.count_or_ids on the whole text, no chunk cache), CPU-us per call:", "",
           "| text | tokens | hf | fast | fast / hf |", "|---|---|---|---|---|"]
    for label, e in enc.items():
        md.append(f"| {label} | {e['tokens']:,} | {e['cpu_us_per_call']['hf']} | {e['cpu_us_per_call']['fast']} | {e['fast_over_hf']} |")
    (RESULTS / f"{a.out}.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
