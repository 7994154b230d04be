"""A validated request's prompt tokens and limits, without stalling the event loop.

    prompt = await prep.prompt_ids(req, model, ctx, spec, how_far)  # 400 context_length_exceeded when it cannot fit
    prep.check_lengths(req, prompt.count, ctx)                    # max_tokens against the context and the cap
    body, max_tokens = prep.fill_max_tokens(req, body, prompt.count, ctx)
    ids = await prep.complete(prompt)                             # all the ids (a migration needs them)

`ctx` is the model's context length: the smallest max_model_len its workers registered
(WorkerPool.context_len), so a prompt accepted here fits whichever worker the router picks.

Bounded work on the loop (issue: a ~8 MB prompt tokenized on the loop froze every other request
for 12.6 s):
  1. cheap bound first: a prompt of more characters than ctx x the tokenizer's max_chars_per_token
     (orchestrator/tokenizer.py) cannot fit, and is refused without tokenizing it;
  2. a prompt (all its texts, or its chat messages) over INLINE_CHARS is templated and tokenized on
     a small thread pool, with the tokenizer's GIL-free encode_batch; the list of ids is built only
     for a prompt that fits. Short prompts (the common case) stay on the loop: a thread hop would
     cost more than they do.
  3. long prompts are tokenized by chunks whose ids are cached (orchestrator/token_cache.py): a
     conversation's history, re-sent with every turn, is tokenized once.
  4. lazily, only as far as routing can use (`probe`): the router matches a prompt's blocks from its start, and
     no worker can hold a block past the first one no worker holds. So a long prompt is tokenized from its start,
     chunk by chunk, while `probe(ids so far)` says every full block so far is cached (or pending) on some worker,
     and not past the first chunk no earlier prompt held (those are tokenized the second time they are seen: a
     copy sent while the first is still in prefill shares its prefix). The rest is never tokenized unless a
     limit needs its exact length (UTF-8 bytes bound its tokens from above: `PartialIds.upper`) or the stream
     migrates (`complete`); the bound counts the cached chunks of the rest exactly (ChunkedTokenizer.upper),
     so a conversation's history counted once is not counted again. A prompt the bound cannot clear but that
     would fit at ESTIMATE_MARGIN times its estimate (from its own tokenized part's tokens per character) is not
     counted: vLLM refuses a prompt past its context with a 400, and on that 400 `recheck` counts it
     exactly and gives this frontend's own error (the engine's stands if no limit is broken). The UTF-8 bound
     is ~4x loose on prose, so without this a one-shot prompt past a quarter of the context was tokenized whole.
     Not with max_tokens_cap filling in max_tokens (that needs the count), with nothing tokenized yet, or for
     engines whose answer to a prompt past the context is not known to be that 400 (SGLang, TensorRT-LLM).
     The token count routing and load use is then an estimate; the engine's usage replaces it when the request
     ends (orchestrator/service.py). The kv policy's probe asks its index; a policy
     without one (round-robin, least-loaded) needs no ids (probe None), and EAGER tokenizes it all
     (disaggregated models, workers without KV events whose predicted contents are the routed prompts).
  5. what was left untokenized is learned from the engine, where it sends the prompt's ids back (vLLM with
     `return_token_ids`): `learner` (orchestrator/token_cache.py, `ChunkedTokenizer.learn`).
Measured (benchmarks/results/hostile_prompt.json): the longest loop stall an 8 MB prompt causes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily

from orchestrator.errors import BadRequestError, ContextLengthError
from orchestrator.multimodal import chat_prompt
from orchestrator.pool import WorkerPool
from orchestrator.protocol import ChatCompletionRequest
from orchestrator.token_cache import ChunkedTokenizer, PartialIds
from orchestrator.tokenizer import PromptTokenizer, load_tokenizer
from workers.multimodal import ContentError, MmTokenSpec, flatten_messages

__all__ = ["PromptPreparer", "PromptTokens", "INLINE_CHARS", "EAGER"]

INLINE_CHARS = 4096  # up to here a prompt is tokenized on the loop (a thread hop would cost more than the encode)
ESTIMATE_MARGIN = 2  # a prompt that fits at this many times its estimate is not counted exactly for its limits (header, 4)
EAGER = object()  # how_far() -> EAGER: every token, as routing with predicted cache contents needs

Probe = Callable[[list[int]], bool]  # "every full block of these leading ids is cached on some worker"


@dataclass(eq=False)
class PromptTokens:
    """A prompt's token ids as far as they were needed (prepare.py header, 4)."""

    ids: list[int] = field(default_factory=list)  # all of them, or (not complete) the first ones
    mm_items: list = field(default_factory=list)
    count: int = 0  # the token count: exact when complete, else an estimate (<= upper)
    partial: PartialIds | None = None  # set while the rest is untokenized
    chunked: ChunkedTokenizer | None = None
    recheck: tuple | None = None  # (request, ctx, param): its limits were judged on the estimate (`recheck`)

    @property
    def complete(self) -> bool:
        return self.partial is None or self.partial.complete

    @property
    def obtainable(self) -> bool:
        """The ids are known or can be had (a tokenizer was there)."""
        return bool(self.ids) or not self.complete


def _too_long(ctx: int, n: int | None, chars: int | None, param: str) -> ContextLengthError:
    size = f"your prompt has {n} tokens" if n is not None else f"your prompt of {chars} characters cannot fit in it"
    return ContextLengthError(f"This model's maximum context length is {ctx} tokens. However, {size}. "
                              "Please reduce the length of the prompt.", param=param)


class _NoTokenizer:
    """Stands in for a tokenizer not loaded yet: chat parts are validated, nothing is tokenized."""

    def render_chat(self, messages: list[dict]) -> str:
        return ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return []


class _GilFree:
    """The tokenizer as chat_prompt uses it, encoding with the GIL released (orchestrator/tokenizer.py)."""

    def __init__(self, tok: PromptTokenizer) -> None:
        self._tok = tok

    def render_chat(self, messages: list[dict]) -> str:
        return self._tok.render_chat(messages)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.count_or_ids(text, 1 << 62, add_special_tokens=add_special_tokens)[1]


class PromptPreparer:
    def __init__(self, pool: WorkerPool, max_tokens_cap: int = 0, workers: int = 2, cache_tokens: int = 0,
                 fast_bpe: bool = True, learn: bool = True) -> None:
        self.pool = pool
        self.learn = learn  # take the engine's ids of what was left untokenized (`learner`)
        self.fast_bpe = fast_bpe  # the pool preloads with the same flag (one load_tokenizer cache entry)
        self.max_tokens_cap = max_tokens_cap
        self.cache_tokens = cache_tokens
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvyard-prep")
        self._chunked: dict[int, ChunkedTokenizer] = {}  # id(PromptTokenizer) -> its chunk cache
        self._chunked_lock = threading.Lock()

    def chunk_caches(self) -> list[ChunkedTokenizer]:
        return list(self._chunked.values())

    def chunked(self, tok: PromptTokenizer) -> ChunkedTokenizer:
        """The tokenizer's chunk cache, made (and self-tested, orchestrator/token_cache.py) on first use."""
        got = self._chunked.get(id(tok))
        if got is None:
            with self._chunked_lock:  # called on the thread pool
                got = self._chunked.get(id(tok))
                if got is None:
                    got = self._chunked[id(tok)] = ChunkedTokenizer(tok, self.cache_tokens)
        return got

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def tokenizer(self, model: str) -> PromptTokenizer | None:
        folder = self.pool.tokenizer_dir(model)
        return load_tokenizer(folder, self.fast_bpe) if folder is not None else None

    async def prompt_ids(self, req, model: str, ctx: int, mm_spec: MmTokenSpec | None = None,
                         how_far: Callable[[], Probe | None | object] = lambda: EAGER,
                         engine_refuses: bool = True) -> PromptTokens:
        """The prompt's tokens: the longest prompt's ids for a batch; a chat's image/audio parts become placeholder
        runs (orchestrator/multimodal.py); no ids without a tokenizer (the engine checks lengths). For a long prompt
        `how_far()` is asked for the probe (header, 4): with one other than EAGER it may come back incomplete.
        `engine_refuses`: the engines answer a prompt past their context with a 400 (vLLM's, checked by
        tests/integration/test_engine_contract.py), so a prompt far from its limits by its estimate may be sent
        uncounted (header, 4)."""
        chat = isinstance(req, ChatCompletionRequest)
        param = "messages" if chat else "prompt"
        spec = mm_spec or MmTokenSpec()
        prompt = None if chat else req.prompt
        if not chat and isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
            ids = list(prompt) if isinstance(prompt[0], int) else max(prompt, key=len)
            if len(ids) > ctx:
                raise _too_long(ctx, len(ids), None, param)
            return PromptTokens(ids, [], len(ids))
        tok = self.tokenizer(model)
        msgs = [m.model_dump() for m in req.messages] if chat else None
        if tok is None:  # no tokenizer reachable yet: route without token ids; the engine checks lengths
            if chat:  # the parts are still checked (400 for an unsupported one)
                chat_prompt(_NoTokenizer(), msgs, spec)
            return PromptTokens()
        if chat:
            chars = sum(len(m.text()) for m in req.messages)
            texts = None
        else:
            texts = [prompt] if isinstance(prompt, str) else prompt
            chars = max(len(t) for t in texts)
        if chars > ctx * tok.max_chars_per_token:
            raise _too_long(ctx, None, chars, param)

        probe = how_far() if chars > INLINE_CHARS and (chat or len(texts) == 1) else EAGER  # asked only for long ones
        lazy = probe is not EAGER

        def tokenize() -> tuple[int, list[int] | None, list] | PromptTokens:
            # long prompts (tokenized off the loop): the same ids as tok's, from cached chunks where it can
            cached = self.chunked(tok) if chars > INLINE_CHARS else tok
            if texts is not None:
                if lazy and cached.chunkable(texts[0], True):
                    return self._begin(cached, texts[0], True, probe)
                return (*max((cached.count_or_ids(t, ctx) for t in texts), key=lambda r: r[0]), [])
            try:
                flat, items = flatten_messages(msgs)
            except ContentError as exc:
                raise BadRequestError(str(exc), param=exc.param) from exc
            if not items:  # the template carries any special tokens, as vLLM does for chat
                text = tok.render_chat(flat)
                if lazy and cached.chunkable(text, False):
                    return self._begin(cached, text, False, probe)
                return (*cached.count_or_ids(text, ctx, add_special_tokens=False), [])
            ids, items = chat_prompt(_GilFree(tok), msgs, spec)
            return len(ids), (ids if len(ids) <= ctx else None), items

        loop = asyncio.get_running_loop()
        if chars > INLINE_CHARS:
            got = await loop.run_in_executor(self._executor, tokenize)
        else:
            got = tokenize()
        if isinstance(got, PromptTokens):
            p = got.partial
            while not p.complete and probe is not None and probe(p.ids):  # the index matches it all so far: go on
                await loop.run_in_executor(self._executor, got.chunked.extend, p, max(1, p.done))  # doubling
                got.ids = p.ids
            want = req.requested_max_tokens() or 0

            def may_break_a_limit(upper: int) -> bool:  # the prompt, at its bound, with max_tokens past ctx or the cap
                return upper + want > ctx or bool(want == 0 and self.max_tokens_cap and ctx - upper < self.max_tokens_cap)

            if not p.complete and may_break_a_limit(p.upper) and may_break_a_limit(got.chunked.upper(p)):
                if (engine_refuses and p.done and (want or not self.max_tokens_cap)
                        and not may_break_a_limit(ESTIMATE_MARGIN * p.estimate())):
                    got.recheck = (req, ctx, param)  # far from the limit by its own density: the engine's 400 rechecks
                else:
                    await self.complete(got)  # a limit needs the exact count
            got.count = p.estimate()
            if p.complete and got.count > ctx:
                raise _too_long(ctx, got.count, None, param)
            return got
        n, ids, items = got
        if ids is None:
            raise _too_long(ctx, n, None, param)
        return PromptTokens(ids, items, n)

    def _begin(self, cached: ChunkedTokenizer, text: str, add_special_tokens: bool, probe) -> PromptTokens:
        """On the thread pool: the first chunks of a lazily tokenized prompt (none with no probe)."""
        p = cached.begin(text, add_special_tokens, first=0 if probe is None else None)
        return PromptTokens(p.ids, [], 0, p, cached)

    def learner(self, prompt: PromptTokens) -> Callable[[bytes], None] | None:
        """For a prompt left partly untokenized, where the chunk cache can learn: a callback that takes the engine's
        ids of the whole prompt (native uint32s, from the stream's first chunk: resilience/migration.py's
        `on_prompt_ids`) and offers them to the chunk cache, which learns the untokenized chunks' ids from them when
        one is looked up again (ChunkedTokenizer.offer, .learn), so the text's next sight costs no tokenizing. None otherwise, and for a prompt routed without ids (a policy with no
        index tokenizes nothing: header, 4)."""
        p, chunked = prompt.partial, prompt.chunked
        if not self.learn or p is None or p.complete or not p.done or chunked is None or not chunked.learns:
            return None
        done, n = p.done, len(p.ids)  # as routed; a migration's `complete` only appends to p.ids after this

        def learn(engine_ids: bytes) -> None:  # on the loop: a dict entry a chunk; learned when one is seen again
            chunked.offer(p, done, n, engine_ids)

        return learn

    async def recheck(self, prompt: PromptTokens) -> None:
        """The engine refused (400) a prompt admitted on its estimate (header, 4): count it exactly, and raise the
        400 this frontend gives when a limit is broken; otherwise the engine's own refusal stands."""
        if prompt.recheck is None:
            return
        req, ctx, param = prompt.recheck
        prompt.recheck = None
        await self.complete(prompt)
        if prompt.count > ctx:
            raise _too_long(ctx, prompt.count, None, param)
        self.check_lengths(req, prompt.count, ctx)

    async def complete(self, prompt: PromptTokens) -> list[int]:
        """All of the prompt's ids (tokenizing the rest of a lazy one, on the thread pool; its cached chunks are free)."""
        p = prompt.partial
        if p is not None and not p.complete:
            await asyncio.get_running_loop().run_in_executor(self._executor, prompt.chunked.extend, p, len(p.chunks))
            prompt.ids, prompt.count = p.ids, len(p.ids)
        return prompt.ids

    def check_lengths(self, req, n_prompt: int, ctx: int) -> None:
        want = req.requested_max_tokens()
        cap = self.max_tokens_cap
        if want is not None and cap and want > cap:
            field_name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
            raise BadRequestError(f"{field_name}={want} is over this server's limit of {cap} tokens", param=field_name)
        if want is not None and want + n_prompt > ctx:
            raise ContextLengthError(
                f"max_tokens={want} is too large: with {n_prompt} prompt tokens the total exceeds the model's "
                f"maximum context length of {ctx} tokens.",
                param="max_tokens",
            )

    def fill_max_tokens(self, req, body: dict, n_prompt: int, ctx: int) -> tuple[dict, int | None]:
        """(body, max_tokens): with max_tokens_cap set and no max_tokens asked, the cap (within the context) is filled in."""
        want = req.requested_max_tokens()
        if want is not None or not self.max_tokens_cap:
            return body, want
        fill = min(self.max_tokens_cap, ctx - n_prompt) if n_prompt else self.max_tokens_cap
        return ({**body, "max_tokens": fill}, fill) if fill > 0 else (body, None)


class PromptCacheCollector:
    """The chunk caches' counters on /metrics (summed over tokenizers): where long prompts' chunks came from, and how
    many engine answers did not fit their prompt's text."""

    def __init__(self, prep: PromptPreparer) -> None:
        self._prep = prep

    def describe(self):
        return []  # no fixed families at registration (the caches are made on first use)

    def collect(self):
        caches = self._prep.chunk_caches()
        chunks = CounterMetricFamily("kvyard_prompt_chunks", "Chunks of long prompts by where their token ids came from: "
                                     "the cache, the tokenizer, or learned from the engine's ids", labels=["source"])
        for source, attr in (("cached", "hits"), ("tokenized", "misses"), ("learned", "learned")):
            chunks.add_metric([source], sum(getattr(c, attr) for c in caches))
        yield chunks
        yield CounterMetricFamily("kvyard_prompt_learn_refused", "Engine answers whose prompt ids did not spell their "
                                  "prompt's text (nothing learned)", value=sum(c.learn_refused for c in caches))
