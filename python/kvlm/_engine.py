"""kvlm._engine: one model, its context and a scheduler over it, driven from
Python: requests are submitted to kvlm_sched and the caller steps the
scheduler (the GIL released during each step) until its request is done.
Both Python shapes (kvlm.Llama, kvlm.LLM) and the server sit on it."""
from __future__ import annotations

import ctypes
import itertools
import os
import random
import signal
import threading
import weakref
from ctypes import POINTER, byref, c_int, c_int32, c_void_p
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _lib as L
from .errors import InvalidArgumentError, KvMemoryError, KvlmError, ModelNotFoundError, from_code, raise_err

_SAMPLER_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed",
                   "frequency_penalty", "presence_penalty")


def _free_native(lib: Any, sched: Optional[int], ctx: Optional[int], model: Optional[int],
                 chat: Optional[int], verbose: bool) -> None:
    """Frees an engine's C objects (close(), or the garbage collector through weakref.finalize)."""
    if sched:
        lib.kvlm_sched_free(sched)
    if ctx:
        lib.kvlm_ctx_free(ctx)
    if chat:
        lib.kvlm_chat_free(chat)
    if model:
        lib.kvlm_model_free(model)
    L.verbose_release(verbose)


# Live requests of every engine by key (the scheduler's user pointer); one
# callback for all, so that no engine is kept alive by a cycle through it.
_REQS: Dict[int, "Request"] = {}
_KEYS = itertools.count(1)


def _on_event(user: Optional[int], evp: Any) -> bool:
    req = _REQS.get(user or 0)
    if req is None:
        return False
    try:
        ev = evp.contents
        if ev.prompt_token:
            d = {int(ev.top_tokens[i]): float(ev.top_logprobs[i]) for i in range(ev.n_top)}
            d[int(ev.token)] = float(ev.logprob)
            req.prompt_logprobs[int(ev.pos)] = d
            return True
        req.prompt_tokens = int(ev.prompt_tokens)
        req.cached_tokens = int(ev.cached_tokens)
        c = req.completions[ev.index]
        if ev.finish != L.FINISH_NONE:
            if ev.embedding:
                req.embeddings[int(ev.index)] = ev.embedding[:ev.n_embd]
            c.on_finish(ev)
            req.n_done += 1
            if req.done and req.orphan:  # cancelled from inside a step: nobody waits for it
                _REQS.pop(user or 0, None)
                if req.grammar:
                    L.lib().kvlm_grammar_free(req.grammar)
                    req.grammar = 0
            return True
        return c.on_token(ev)
    except BaseException as e:  # raised again by the caller: never into C
        req.exc = e
        return False


_CB = L.sched_cb(_on_event)


class Model:
    """A loaded model file (GGUF, llama2.c, or a Hugging Face directory)."""

    def __init__(self, path: str, *, use_mmap: bool = True, use_mlock: bool = False) -> None:
        lib = L.lib()
        self._lib = lib
        self.path = str(path)
        p = L.kvlm_model_params()
        p.no_mmap = not use_mmap
        p.mlock = use_mlock
        err = L.kvlm_error()
        h = lib.kvlm_model_load(self.path.encode(), byref(p), byref(err))
        if not h:
            if err.code == L.EIO and not os.path.exists(self.path):
                raise_err(err, ModelNotFoundError)
            raise_err(err)
        self.handle: int = h
        self.n_vocab: int = lib.kvlm_vocab_size(h)
        self._pieces: Dict[int, str] = {}

    def free(self) -> None:
        if self.handle:
            self._lib.kvlm_model_free(self.handle)
            self.handle = 0

    def tokenize(self, text: bytes, add_bos: bool, special: bool) -> List[int]:
        lib = self._lib
        err = L.kvlm_error()
        cap = len(text) + 8
        while True:
            buf = (c_int32 * cap)()
            n = lib.kvlm_tokenize(self.handle, text, len(text), add_bos, special, buf, cap, byref(err))
            if n < 0:
                raise_err(err)
            if n <= cap:
                return list(buf[:n])
            cap = n

    def piece(self, token: int) -> str:
        """A token's own text (control tokens give theirs), cached."""
        s = self._pieces.get(token)
        if s is None:
            buf = ctypes.create_string_buffer(256)
            n = self._lib.kvlm_token_to_piece(self.handle, token, True, buf, 256)
            s = buf.raw[:max(n, 0)].decode("utf-8", "replace")
            self._pieces[token] = s
        return s

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.kvlm_token_is_eog(self.handle, token))


class Detok:
    """Incremental detokenizer (kvlm_detok): pieces of whole UTF-8 characters."""

    def __init__(self, model: Model, special: bool = False) -> None:
        self._lib = model._lib
        self.d = L.kvlm_detok()
        self._lib.kvlm_detok_init(byref(self.d), model.handle)
        self.d.special = special
        self.buf = ctypes.create_string_buffer(1024)

    def push(self, token: int) -> bytes:
        n = self._lib.kvlm_detok_push(byref(self.d), token, self.buf, 1024)
        return self.buf.raw[:max(n, 0)]

    def flush(self) -> bytes:
        n = self._lib.kvlm_detok_flush(byref(self.d), self.buf, 1024)
        return self.buf.raw[:max(n, 0)]


class Sampling:
    """What one request samples with (plain Python values; made into
    kvlm_request_params at submission)."""

    def __init__(self, *, temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                 repeat_penalty: float = 1.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, seed: Optional[int] = None, max_tokens: int = 16, n: int = 1, logprobs: Optional[int] = None,
                 grammar: Optional[Tuple[int, str]] = None, stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, min_tokens: int = 0,
                 prompt_logprobs: Optional[int] = None) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = min_p
        self.repeat_penalty = repeat_penalty
        self.frequency_penalty = frequency_penalty
        self.presence_penalty = presence_penalty
        self.repetition_penalty = repetition_penalty
        self.typical_p = 1.0
        self.seed = seed
        self.max_tokens = max_tokens
        self.n = n
        self.logprobs = logprobs
        self.grammar = grammar
        self.stop = [s for s in stop if s]
        self.stop_token_ids = list(stop_token_ids)
        self.ignore_eos = ignore_eos
        self.min_tokens = min_tokens
        self.prompt_logprobs = prompt_logprobs


class Completion:
    """The state of one completion (one index of a request) as its tokens come."""

    def __init__(self, engine: "Engine", index: int, stop: List[str], logprobs: bool, special: bool) -> None:
        self.model = engine.model
        self.index = index
        self.detok = Detok(engine.model, special)
        self.raw = bytearray()
        self.text = ""
        self.token_ids: List[int] = []
        self.logprobs: Optional[List[Dict[str, Any]]] = [] if logprobs else None
        self.finish: Optional[str] = None
        self.stop = stop
        self.stopped = False
        self.emitted = 0
        self.error: Optional[str] = None
        self.kv_full = False

    def on_token(self, ev: Any) -> bool:
        tok = int(ev.token)
        if self.stopped:
            return False
        if self.model.is_eog(tok):
            return True
        self.token_ids.append(tok)
        before = len(self.text)
        piece = self.detok.push(tok)
        self.text += piece.decode("utf-8", "replace")
        if self.logprobs is not None:
            self.logprobs.append({
                "token": tok, "text": self.text[before:], "offset": before, "logprob": float(ev.logprob),
                "top": [(int(ev.top_tokens[i]), float(ev.top_logprobs[i])) for i in range(ev.n_top)]})
        if self.stop:
            start = max(0, before - max(len(s) for s in self.stop))
            cut = -1
            for s in self.stop:
                i = self.text.find(s, start)
                if i >= 0 and (cut < 0 or i < cut):
                    cut = i
            if cut >= 0:
                self.text = self.text[:cut]
                self.stopped = True
                return False
        return True

    def on_finish(self, ev: Any) -> None:
        if not self.stopped:
            self.text += self.detok.flush().decode("utf-8", "replace")
        f = int(ev.finish)
        if f == L.FINISH_ERROR:
            self.error = ev.error.decode("utf-8", "replace") if ev.error else "generation failed"
            self.finish = "error"
        elif f == L.FINISH_KV_FULL:
            self.kv_full = True
            self.finish = "length"
        elif f == L.FINISH_LENGTH:
            self.finish = "length"
        elif f == L.FINISH_CANCELLED and not self.stopped:
            self.finish = "abort"
        else:
            self.finish = "stop"

    def new_text(self) -> str:
        """Text not handed out yet, holding back an end that may begin a stop string."""
        end = len(self.text)
        if self.finish is None and self.stop:
            for s in self.stop:
                for k in range(min(len(s) - 1, end - self.emitted), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out


class Request:
    """One submitted request: its completions, and whether it ended."""

    def __init__(self, engine: "Engine", n: int, stop: List[str], logprobs: bool, special: bool) -> None:
        self.id = 0
        self.completions = [Completion(engine, i, stop, logprobs, special) for i in range(n)]
        self.n_done = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.embeddings: Dict[int, List[float]] = {}
        self.exc: Optional[BaseException] = None
        self.grammar = 0
        self.engine_id = 0
        self.orphan = False
        self.prompt_logprobs: Dict[int, Dict[int, float]] = {}

    @property
    def done(self) -> bool:
        return self.n_done >= len(self.completions)


class Engine:
    """A model, its context and a scheduler. Calls from several threads on one
    engine are safe (each step is taken under a lock); separate engines run
    in parallel (the GIL is released in each step)."""

    def __init__(self, model_path: str, *, n_ctx: int = 512, n_threads: Optional[int] = None, n_seq_max: int = 1,
                 n_batch: int = 0, cache_type_k: Optional[str] = None, cache_type_v: Optional[str] = None,
                 device: int = L.DEVICE_CPU, kv_disk: Optional[str] = None, kv_redis: Optional[str] = None,
                 kv_mem: int = 0, kv_blocks: int = 0, use_mmap: bool = True, use_mlock: bool = False, verbose: bool = False,
                 batch_tokens: int = 0, chat_format: Optional[str] = None,
                 chat_template: Optional[str] = None) -> None:
        self._verbose = verbose
        L.verbose_acquire(verbose)
        self._closed = False
        self.ctx = 0
        self.sched = 0
        self.chat = 0
        self.model: Model
        try:
            self.model = Model(model_path, use_mmap=use_mmap, use_mlock=use_mlock)
            lib = self.model._lib
            self._lib = lib
            p = lib.kvlm_ctx_default_params()
            p.n_ctx = int(n_ctx)
            p.n_threads = int(n_threads or 0)
            p.n_seq_max = int(n_seq_max)
            p.n_batch = int(n_batch)
            p.kv_mem = int(kv_mem)
            p.kv_blocks = int(kv_blocks)
            p.device = int(device)
            for field, name in (("cache_type_k", cache_type_k), ("cache_type_v", cache_type_v)):
                if name is not None:
                    t = lib.kvlm_cache_type_from_name(str(name).encode())
                    if t < 0:
                        raise InvalidArgumentError(f"{field} {name!r}: not a cache type (f32, f16, bf16, q8_0, "
                                                   "q4_0, q4_kc)", L.EINVAL)
                    setattr(p, field, t)
            self._keep = [kv_disk.encode() if kv_disk else None, kv_redis.encode() if kv_redis else None]
            p.kv_disk, p.kv_redis = self._keep
            if n_ctx < 0 or n_seq_max < 1:
                raise InvalidArgumentError("n_ctx must be 0 or more and n_seq_max 1 or more", L.EINVAL)
            err = L.kvlm_error()
            self.ctx = lib.kvlm_ctx_create(self.model.handle, byref(p), byref(err)) or 0
            if not self.ctx:
                raise_err(err)
            sp = L.kvlm_sched_params()
            sp.batch_tokens = int(batch_tokens)
            self.sched = lib.kvlm_sched_create(self.ctx, byref(sp), byref(err)) or 0
            if not self.sched:
                raise_err(err)
            self._chat_format = chat_format
            self._chat_template = chat_template
        except BaseException:
            self._release()
            raise
        self.n_ctx: int = lib.kvlm_ctx_n_ctx(self.ctx)
        self.n_eval = 0
        self.eval_tokens: List[int] = []
        self._stepping = 0  # the thread inside kvlm_sched_step, if any
        self._lock = threading.RLock()
        self._arm()

    # -- life ---------------------------------------------------------------
    def _release(self) -> None:
        """Frees what a failed constructor made."""
        if L._lib is None:
            L.verbose_release(self._verbose)
            return
        _free_native(L._lib, self.sched, self.ctx, getattr(self, "model", None) and self.model.handle, self.chat,
                     self._verbose)
        if getattr(self, "model", None) is not None:
            self.model.handle = 0
        self.sched = self.ctx = self.chat = 0

    def _arm(self) -> None:
        self._finalizer = weakref.finalize(self, _free_native, self._lib, self.sched, self.ctx, self.model.handle,
                                           self.chat, self._verbose)

    def close(self) -> None:
        """Frees the C side now (idempotent; the garbage collector does it otherwise)."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._finalizer()
            self.model.handle = 0
            self.sched = self.ctx = self.chat = 0

    def check_open(self) -> None:
        if self._closed:
            raise KvlmError("this object is closed")

    # -- chat -----------------------------------------------------------------
    def chat_handle(self) -> int:
        if not self.chat:
            p = L.kvlm_chat_params()
            keep = [self._chat_format.encode() if self._chat_format else None,
                    self._chat_template.encode() if self._chat_template else None]
            p.template_name, p.template_text = keep
            err = L.kvlm_error()
            h = self._lib.kvlm_chat_create(self.model.handle, byref(p), byref(err))
            if not h:
                raise_err(err)
            self.chat = h
            self._finalizer.detach()
            self._arm()
        return self.chat

    # -- requests -------------------------------------------------------------
    def grammar(self, kind: int, text: str) -> int:
        err = L.kvlm_error()
        g = self._lib.kvlm_grammar_build(self.model.handle, kind, text.encode(), byref(err))
        if not g:
            raise_err(err)
        return int(g)

    def eval_reset(self) -> None:
        """Ends the sequence eval() fed, if any, before the scheduler uses the context."""
        if self.n_eval:
            with self._lock:
                self._lib.kvlm_seq_free(self.ctx, 0)
                self.n_eval = 0
                self.eval_tokens = []

    def eval(self, tokens: Sequence[int]) -> Any:
        """Feeds tokens to sequence 0 directly (kvlm_decode), outside the
        scheduler; returns the pointer to the logits after the last one."""
        self.check_open()
        with self._lock:
            if any(r for r in _REQS.values() if r.engine_id == id(self) and not r.done):
                raise KvlmError("eval() while a completion of this object is running")
            toks = (c_int32 * max(1, len(tokens)))(*tokens)
            b = L.kvlm_batch()
            b.n_tokens = len(tokens)
            b.tokens = ctypes.cast(toks, POINTER(c_int32))
            err = L.kvlm_error()
            if self._lib.kvlm_decode(self.ctx, byref(b), byref(err)):
                raise_err(err)
            self.n_eval += len(tokens)
            self.eval_tokens.extend(int(t) for t in tokens)
            return self._lib.kvlm_get_logits(self.ctx, -1)

    def submit(self, tokens: Sequence[int], s: Sampling, *, special: bool = False,
               grammar_handle: int = 0) -> Request:
        """Queues a completion request (the grammar handle, if any, is owned by the request)."""
        self.check_open()
        self.eval_reset()
        lib = self._lib
        req = Request(self, max(1, s.n), s.stop, s.logprobs is not None, special)
        req.engine_id = id(self)
        req.grammar = grammar_handle
        if tokens:  # the text continues the prompt's (no leading space dropped from the first piece)
            for c in req.completions:
                c.detok.d.prev = int(tokens[-1])
        rp = L.kvlm_request_params()
        sp = lib.kvlm_sampler_default_params()
        sp.temperature = s.temperature
        sp.top_k = s.top_k
        sp.top_p = s.top_p
        sp.min_p = s.min_p
        sp.repeat_penalty = s.repeat_penalty
        sp.frequency_penalty = s.frequency_penalty
        sp.presence_penalty = s.presence_penalty
        sp.repetition_penalty = s.repetition_penalty
        sp.typical_p = s.typical_p
        sp.seed = s.seed if s.seed is not None else random.getrandbits(63)
        sp.ignore_eos = s.ignore_eos
        sp.min_tokens = s.min_tokens
        sp.model = self.model.handle
        stop_ids = (c_int32 * max(1, len(s.stop_token_ids)))(*s.stop_token_ids)
        sp.stop_ids = ctypes.cast(stop_ids, POINTER(c_int32))
        sp.n_stop_ids = len(s.stop_token_ids)
        if grammar_handle:
            sp.grammar = grammar_handle
        err = L.kvlm_error()
        idx = c_int(0)
        code = lib.kvlm_sampler_params_check(byref(sp), self.model.n_vocab, byref(idx), byref(err))
        if code:
            bad = {1: "temperature", 2: "top_k", 3: "top_p", 4: "min_p", 5: "repeat_penalty", 7: "frequency_penalty",
                   8: "presence_penalty", 11: "repetition_penalty", 12: "typical_p", 19: "min_tokens", 21: "stop_token_ids"}
            field = bad.get(code, "a sampling value")
            self._free_grammar(req)
            raise InvalidArgumentError(f"{field} {err.msg.decode('utf-8', 'replace')}", L.EINVAL)
        if s.max_tokens is None or s.max_tokens < 1:
            self._free_grammar(req)
            raise InvalidArgumentError("max_tokens must be 1 or more", L.EINVAL)
        if s.logprobs is not None and not 0 <= s.logprobs <= L.MAX_LOGPROBS:
            self._free_grammar(req)
            raise InvalidArgumentError(f"logprobs must be between 0 and {L.MAX_LOGPROBS}", L.EINVAL)
        if s.n < 1:
            self._free_grammar(req)
            raise InvalidArgumentError("n must be 1 or more", L.EINVAL)
        rp.sampling = sp
        rp.max_tokens = int(s.max_tokens)
        rp.n = int(s.n)
        rp.logprobs = -1 if s.logprobs is None else int(s.logprobs)
        if s.prompt_logprobs is not None:
            if not 0 <= s.prompt_logprobs <= L.MAX_LOGPROBS:
                self._free_grammar(req)
                raise InvalidArgumentError(f"prompt_logprobs must be between 0 and {L.MAX_LOGPROBS}", L.EINVAL)
            rp.prompt_logprobs = True
            rp.prompt_top_logprobs = int(s.prompt_logprobs)
        toks = (c_int32 * max(1, len(tokens)))(*tokens)
        key = next(_KEYS)
        with self._lock:
            self.check_open()
            _REQS[key] = req
            rid = lib.kvlm_sched_submit(self.sched, toks, len(tokens), byref(rp), _CB, c_void_p(key),
                                        byref(err))
            if not rid:
                del _REQS[key]
                self._free_grammar(req)
                raise_err(err)
        req.id = rid
        req.key = key  # type: ignore[attr-defined]
        return req

    def submit_embed(self, inputs: List[List[int]], pooling: int = -1, normalize: bool = True) -> Request:
        self.check_open()
        lib = self._lib
        self.eval_reset()
        req = Request(self, len(inputs), [], False, False)
        req.engine_id = id(self)
        ep = lib.kvlm_embed_default_params()
        if pooling >= 0:
            ep.pooling = pooling
        ep.no_normalize = not normalize
        arrays = [(c_int32 * max(1, len(t)))(*t) for t in inputs]
        ptrs = (POINTER(c_int32) * len(inputs))(*[ctypes.cast(a, POINTER(c_int32)) for a in arrays])
        lens = (c_int * len(inputs))(*[len(t) for t in inputs])
        err = L.kvlm_error()
        key = next(_KEYS)
        with self._lock:
            self.check_open()
            _REQS[key] = req
            rid = lib.kvlm_sched_submit_embed(self.sched, ptrs, lens, len(inputs), byref(ep), _CB,
                                              c_void_p(key), byref(err))
            if not rid:
                del _REQS[key]
                raise_err(err)
        req.id = rid
        req.key = key  # type: ignore[attr-defined]
        return req

    def _free_grammar(self, req: Request) -> None:
        if req.grammar:
            self._lib.kvlm_grammar_free(req.grammar)
            req.grammar = 0

    def step(self) -> None:
        """One scheduler step (the GIL is released while it computes). A
        Ctrl-C during the step is raised after it as KeyboardInterrupt:
        Python would run its handler inside the token callback, where an
        exception cannot propagate."""
        with self._lock:
            self.check_open()
            self._stepping = threading.get_ident()
            try:
                if threading.current_thread() is not threading.main_thread() or \
                        signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                    self._lib.kvlm_sched_step(self.sched)
                    return
                hit = []
                old = signal.signal(signal.SIGINT, lambda *_: hit.append(1))
                try:
                    self._lib.kvlm_sched_step(self.sched)
                finally:
                    signal.signal(signal.SIGINT, old)
            finally:
                self._stepping = 0
            if hit:
                raise KeyboardInterrupt

    def finish(self, req: Request) -> None:
        """Forgets a request that ended; raises what its callback met."""
        with self._lock:
            _REQS.pop(getattr(req, "key", 0), None)
        self._free_grammar(req)
        if req.exc is not None:
            raise req.exc
        for c in req.completions:
            if c.error is not None:
                raise from_code(L.EINVAL, c.error, KvlmError)
            if c.kv_full and not c.token_ids:
                raise KvMemoryError("the KV cache has no room for this completion", L.EFULL)

    def cancel(self, req: Request) -> None:
        """Ends a request early (an exception or an abandoned stream) and
        steps until the scheduler has let it go, so the object stays usable."""
        if self._closed or req.done:
            return
        if self._stepping == threading.get_ident():
            # called from within a step (a stream collected by the garbage collector during a token
            # callback): no step may run here; the request ends at the next one
            req.orphan = True
            self._lib.kvlm_sched_cancel(self.sched, req.id)
            return
        with self._lock:
            self._lib.kvlm_sched_cancel(self.sched, req.id)
            guard = 0
            while not req.done and guard < 1000:
                self._lib.kvlm_sched_step(self.sched)
                guard += 1
            _REQS.pop(getattr(req, "key", 0), None)
        self._free_grammar(req)

    def run(self, reqs: Sequence[Request]) -> None:
        """Steps until every request in reqs has ended (Ctrl-C cancels them)."""
        try:
            while not all(r.done for r in reqs):
                self.step()
        except BaseException:
            for r in reqs:
                self.cancel(r)
            raise
        for r in reqs:
            self.finish(r)

    def kv_stats(self) -> Dict[str, Any]:
        """The KV cache's figures (kvlm_kv_stats) and its tiers'."""
        self.check_open()
        st = L.kvlm_kv_stats()
        with self._lock:
            self._lib.kvlm_kv_stats_get(self.ctx, byref(st))
            tiers = (L.kvlm_kv_tier_stats * L.MAX_KV_TIERS)()
            n = self._lib.kvlm_kv_tier_stats_get(self.ctx, tiers, L.MAX_KV_TIERS)
        out: Dict[str, Any] = {name: getattr(st, name) for name, _ in L.kvlm_kv_stats._fields_}
        out["tiers"] = [{name: (getattr(t, name).decode() if name == "name" else getattr(t, name))
                         for name, _ in L.kvlm_kv_tier_stats._fields_} for t in tiers[:min(n, L.MAX_KV_TIERS)]]
        return out
