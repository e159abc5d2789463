"""kvlm.llama: kvlm.Llama, llama-cpp-python's shape over libkvlm:
completions and chat completions as OpenAI-shaped dicts (or streams of
chunks), tokenize / detokenize, embeddings and the KV cache's figures."""
from __future__ import annotations

import ctypes
import json
import random
import time
import uuid
from ctypes import byref, c_size_t, c_void_p
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from . import _lib as L
from ._engine import Engine, Request, Sampling
from .errors import InvalidArgumentError, raise_err

Message = Dict[str, Any]


class LlamaGrammar:
    """A grammar for create_completion(grammar=...): GBNF text (rule root)."""

    def __init__(self, gbnf: str) -> None:
        self.gbnf = gbnf

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = False) -> "LlamaGrammar":
        return cls(grammar)


class LlamaState:
    """What save_state() gives: the tokens eval() fed and the session file's
    bytes (their full KV blocks, in kvlm's checked session format)."""

    def __init__(self, input_ids: List[int], data: bytes) -> None:
        self.input_ids = input_ids
        self.data = data
        self.n_tokens = len(input_ids)


class Llama:
    """A model ready to complete text, as llama_cpp.Llama is.

    ``n_ctx`` is the most tokens one text may hold (0: the model's trained
    context), ``n_threads`` the CPU threads (None: one per core),
    ``n_gpu_layers`` > 0 (or -1) puts the model on the CUDA device (kvlm
    offloads all layers or none), ``cache_type_k``/``cache_type_v`` the KV
    cache's element types ("f16", "q8_0", ...), ``kv_disk``/``kv_redis`` KV
    tiers (docs/kv-tiers.md), ``kv_mem`` the KV pool's bytes (0: room for
    one full context), ``seed`` the default sampling seed, ``verbose``
    whether the library may write its log to stderr; ``chat_format`` a
    built-in chat family ("chatml", "llama3", ...) or one of the model's
    named templates, ``chat_template`` a Jinja template's text used instead
    of the model's own. Close it with
    ``close()`` or ``with``; the garbage collector frees it otherwise.
    """

    def __init__(self, model_path: str, *, n_ctx: int = 512, n_threads: Optional[int] = None, n_batch: int = 512,
                 n_gpu_layers: int = 0, seed: int = -1, cache_type_k: Optional[str] = None,
                 cache_type_v: Optional[str] = None, kv_disk: Optional[str] = None, kv_redis: Optional[str] = None,
                 kv_mem: int = 0, use_mmap: bool = True, use_mlock: bool = False, chat_format: Optional[str] = None,
                 chat_template: Optional[str] = None, verbose: bool = False, **kwargs: Any) -> None:
        self.model_path = str(model_path)
        self.verbose = verbose
        self._seed = None if seed is None or seed < 0 else int(seed)
        self._engine = Engine(self.model_path, n_ctx=n_ctx, n_threads=n_threads, n_seq_max=1, n_batch=n_batch,
                              cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                              device=L.DEVICE_CUDA if n_gpu_layers else L.DEVICE_CPU, kv_disk=kv_disk,
                              kv_redis=kv_redis, kv_mem=kv_mem, use_mmap=use_mmap, use_mlock=use_mlock, verbose=verbose,
                              chat_format=chat_format, chat_template=chat_template)

    # ---- life -----------------------------------------------------------------
    def close(self) -> None:
        """Frees the model and its KV cache now."""
        self._engine.close()

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- figures ---------------------------------------------------------------
    def n_ctx(self) -> int:
        """Most tokens one text may hold."""
        return self._engine.n_ctx

    def n_vocab(self) -> int:
        return self._engine.model.n_vocab

    def token_bos(self) -> int:
        return int(self._engine._lib.kvlm_token_bos(self._engine.model.handle))

    def token_eos(self) -> int:
        return int(self._engine._lib.kvlm_token_eos(self._engine.model.handle))

    def kv_stats(self) -> Dict[str, Any]:
        """The KV cache: blocks (n_blocks, used, cached, free, shared), prefix
        hits and misses, evictions, bytes, and each KV tier's figures."""
        return self._engine.kv_stats()

    # ---- tokens --------------------------------------------------------------
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> List[int]:
        """Token ids of ``text`` (bytes, or str); BOS first when the model adds it and add_bos."""
        self._engine.check_open()
        if isinstance(text, str):
            text = text.encode("utf-8")
        m = self._engine.model
        return m.tokenize(bytes(text), bool(add_bos) and bool(m._lib.kvlm_add_bos(m.handle)), special)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Optional[Sequence[int]] = None,
                   special: bool = False) -> bytes:
        """The text of ``tokens`` as bytes (the tokenizer's leading space kept out, as kvlm_detok does)."""
        from ._engine import Detok
        self._engine.check_open()
        d = Detok(self._engine.model, special)
        if prev_tokens:
            d.d.prev = int(prev_tokens[-1])
        out = b"".join(d.push(int(t)) for t in tokens)
        return out + d.flush()

    # ---- the low-level loop ------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        """Tokens fed by eval() since the last reset() (or completion)."""
        return self._engine.n_eval

    def eval(self, tokens: Sequence[int]) -> None:
        """Runs ``tokens`` through the model after those eval() fed before
        (kvlm_decode on the context's sequence 0, outside the scheduler); the
        logits after the last one are then ``logits()``. A completion, chat or
        embedding call starts afresh (reset() first)."""
        self._last_logits = self._engine.eval([int(t) for t in tokens])

    def logits(self) -> Any:
        """The logits after the last token eval() fed: a NumPy float32 array
        over the library's own buffer, no copy, valid until the next call on
        this object (a list of floats without NumPy)."""
        ptr = getattr(self, "_last_logits", None)
        if not ptr or not self._engine.n_eval:
            raise InvalidArgumentError("no logits: eval() some tokens first", L.EINVAL)
        n = self._engine.model.n_vocab
        try:
            import numpy
        except ImportError:
            return ptr[:n]
        return numpy.ctypeslib.as_array(ptr, shape=(n,))

    def save_state(self) -> LlamaState:
        """The state eval() built (kvlm_session_save through a temporary
        file): load_state() brings it back, in this object or another one of
        the same model and cache type."""
        import os
        import tempfile
        eng = self._engine
        eng.check_open()
        with tempfile.TemporaryDirectory(prefix="kvlm-state-") as d:
            path = os.path.join(d, "state")
            err = L.kvlm_error()
            with eng._lock:
                if eng._lib.kvlm_session_save(eng.ctx, 0, path.encode(), byref(err)):
                    raise_err(err)
            with open(path, "rb") as f:
                return LlamaState(list(eng.eval_tokens), f.read())

    def load_state(self, state: LlamaState) -> None:
        """Restores a save_state(): the saved full KV blocks are attached
        (kvlm_session_load) and the tokens after them computed, so logits()
        is again the logits after the last token."""
        import os
        import tempfile
        eng = self._engine
        eng.check_open()
        self.reset()
        toks = list(state.input_ids)
        if not toks:
            return
        with tempfile.TemporaryDirectory(prefix="kvlm-state-") as d:
            path = os.path.join(d, "state")
            with open(path, "wb") as f:
                f.write(state.data)
            arr = (ctypes.c_int32 * len(toks))(*toks)
            err = L.kvlm_error()
            with eng._lock:
                n = eng._lib.kvlm_session_load(eng.ctx, 0, arr, len(toks), path.encode(), byref(err))
                if n < 0:
                    raise_err(err)
                eng.n_eval = n
                eng.eval_tokens = toks[:n]
        self.eval(toks[n:])

    def reset(self) -> None:
        """Forgets what eval() fed (its KV blocks stay cached for prefix reuse)."""
        self._engine.eval_reset()
        self._last_logits = None

    # ---- completions -----------------------------------------------------------
    def _sampling(self, max_tokens: Optional[int], temperature: float, top_p: float, top_k: int, min_p: float,
                  repeat_penalty: float, frequency_penalty: float, presence_penalty: float, stop: Any,
                  seed: Optional[int], logprobs: Optional[int], n_prompt: int) -> Sampling:
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if max_tokens is None or max_tokens <= 0:
            max_tokens = max(1, self._engine.n_ctx - n_prompt)
        if seed is None:
            seed = self._seed
        return Sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                        repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                        presence_penalty=presence_penalty, seed=seed, max_tokens=max_tokens, stop=list(stop),
                        logprobs=logprobs)

    def _grammar(self, grammar: Any) -> int:
        if grammar is None:
            return 0
        text = grammar.gbnf if isinstance(grammar, LlamaGrammar) else str(grammar)
        return self._engine.grammar(L.GRAMMAR_GBNF, text)

    def _logprobs(self, req: Request, c: Any, offset: int = 0) -> Optional[Dict[str, Any]]:
        if c.logprobs is None:
            return None
        m = self._engine.model
        kept = [e for e in c.logprobs if e["offset"] < len(c.text) or not c.stopped]
        return {"tokens": [e["text"] for e in kept],
                "text_offset": [offset + e["offset"] for e in kept],
                "token_logprobs": [e["logprob"] for e in kept],
                "top_logprobs": [{m.piece(t): lp for t, lp in e["top"]} for e in kept]}

    def create_completion(self, prompt: Union[str, List[int]], suffix: Optional[str] = None,
                          max_tokens: Optional[int] = 16, temperature: float = 0.8, top_p: float = 0.95,
                          min_p: float = 0.05, typical_p: float = 1.0, logprobs: Optional[int] = None,
                          echo: bool = False, stop: Optional[Union[str, List[str]]] = None,
                          frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repeat_penalty: float = 1.0,
                          top_k: int = 40, stream: bool = False, seed: Optional[int] = None,
                          model: Optional[str] = None, grammar: Optional[Union[str, LlamaGrammar]] = None,
                          **kwargs: Any) -> Any:
        """Completes ``prompt`` (text, or token ids). Returns an OpenAI
        ``text_completion`` dict (id, object, created, model, choices [text,
        index, logprobs, finish_reason], usage), or with ``stream=True`` an
        iterator of such chunks, one per piece of text. ``logprobs``: the
        chosen tokens' log-probabilities and that many alternatives;
        ``grammar``: GBNF text (or a LlamaGrammar) the text is held to. The
        parameters come in llama-cpp-python's order; those kvlm has no use
        for (mirostat, tfs_z, logits_processor, ...) are accepted and ignored."""
        if suffix is not None:
            raise InvalidArgumentError("suffix is not supported (kvlm has no fill-in-the-middle here)", L.EINVAL)
        eng = self._engine
        eng.check_open()
        if isinstance(prompt, str):
            tokens = self.tokenize(prompt.encode("utf-8"))
            prompt_text = prompt
        else:
            tokens = [int(t) for t in prompt]
            prompt_text = self.detokenize(tokens).decode("utf-8", "replace")
        s = self._sampling(max_tokens, temperature, top_p, top_k, min_p, repeat_penalty, frequency_penalty,
                           presence_penalty, stop, seed, logprobs, len(tokens))
        s.typical_p = typical_p
        cid = "cmpl-" + uuid.uuid4().hex
        created = int(time.time())
        name = model or self.model_path
        if stream:  # submitted when first iterated (as llama-cpp-python's streams), so never left running
            def stream_completion() -> Iterator[Dict[str, Any]]:
                req = eng.submit(tokens, s, grammar_handle=self._grammar(grammar))
                yield from self._stream_completion(req, cid, created, name, prompt_text if echo else "", logprobs)
            return stream_completion()
        req = eng.submit(tokens, s, grammar_handle=self._grammar(grammar))
        eng.run([req])
        c = req.completions[0]
        off = len(prompt_text) if echo else 0
        return {"id": cid, "object": "text_completion", "created": created, "model": name,
                "choices": [{"text": (prompt_text if echo else "") + c.text, "index": 0,
                             "logprobs": self._logprobs(req, c, off), "finish_reason": c.finish}],
                "usage": {"prompt_tokens": len(tokens), "completion_tokens": len(c.token_ids),
                          "total_tokens": len(tokens) + len(c.token_ids)}}

    def _stream_completion(self, req: Request, cid: str, created: int, name: str, echo: str,
                           logprobs: Optional[int]) -> Iterator[Dict[str, Any]]:
        eng = self._engine
        c = req.completions[0]
        try:
            if echo:
                yield {"id": cid, "object": "text_completion", "created": created, "model": name,
                       "choices": [{"text": echo, "index": 0, "logprobs": None, "finish_reason": None}]}
            while True:
                if not req.done:
                    eng.step()
                # the state as of now: another stream's steps may end this request while this one is suspended
                done = req.done
                piece = c.new_text()
                if piece or done:
                    yield {"id": cid, "object": "text_completion", "created": created, "model": name,
                           "choices": [{"text": piece, "index": 0, "logprobs": None,
                                        "finish_reason": c.finish if done else None}]}
                if done:
                    break
        finally:
            if not req.done:
                eng.cancel(req)
            else:
                eng.finish(req)

    def __call__(self, prompt: Union[str, List[int]], *args: Any, **kwargs: Any) -> Any:
        """create_completion(prompt, ...)."""
        return self.create_completion(prompt, *args, **kwargs)

    # ---- chat ----------------------------------------------------------------
    def create_chat_completion(self, messages: List[Message], functions: Any = None, function_call: Any = None,
                               tools: Optional[List[Dict[str, Any]]] = None, tool_choice: Any = None,
                               temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                               stream: bool = False, stop: Optional[Union[str, List[str]]] = None,
                               seed: Optional[int] = None, response_format: Optional[Dict[str, Any]] = None,
                               max_tokens: Optional[int] = None, presence_penalty: float = 0.0,
                               frequency_penalty: float = 0.0, repeat_penalty: float = 1.0,
                               model: Optional[str] = None, logprobs: Optional[bool] = None,
                               top_logprobs: Optional[int] = None, **kwargs: Any) -> Any:
        """A chat completion through the model's own chat template (or
        ``chat_format``): an OpenAI ``chat.completion`` dict (its message with
        content, reasoning_content and tool_calls read by kvlm's parser for
        the template), or with ``stream=True`` ``chat.completion.chunk``
        dicts. ``tools``/``tool_choice`` hold calls to the tools' schemas;
        ``response_format`` {"type": "json_object"} (optionally "schema") or
        {"type": "json_schema", "json_schema": {"schema": ...}}."""
        eng = self._engine
        eng.check_open()
        lib = eng._lib
        chat = eng.chat_handle()
        if tools is None and functions:
            tools = [{"type": "function", "function": f} for f in functions]
        request: Dict[str, Any] = {"messages": messages, "add_generation_prompt": True}
        if tools:
            request["tools"] = tools
        err = L.kvlm_error()
        tools_json = json.dumps(tools).encode() if tools else None
        choice_json = json.dumps(tool_choice).encode() if tool_choice is not None else None
        if tools_json or choice_json:
            if lib.kvlm_chat_tools_check(tools_json, choice_json, None, byref(err)):
                raise_err(err)
        out = c_void_p()
        n = c_size_t()
        if lib.kvlm_chat_render(chat, json.dumps(request).encode(), byref(out), byref(n), byref(err)):
            raise_err(err)
        prompt = ctypes.string_at(out.value, n.value)
        lib.kvlm_free_c(out.value)
        tokens = eng.model.tokenize(prompt, bool(lib.kvlm_add_bos(eng.model.handle)), True)
        s = self._sampling(max_tokens, temperature, top_p, top_k, min_p, repeat_penalty, frequency_penalty,
                           presence_penalty, stop, seed, (top_logprobs or 0) if logprobs else None, len(tokens))

        def start() -> Any:
            # the C objects of the request (its grammar, the answer's reader, the request itself): made when
            # the answer is wanted, so that a stream never iterated holds none
            # the grammar: tool calls, or the response format
            g = c_void_p()
            if tools_json and tool_choice != "none":
                if lib.kvlm_chat_tool_grammar(chat, prompt, len(prompt), tools_json, choice_json, True, byref(g),
                                              byref(err)):
                    raise_err(err)
            gh = int(g.value or 0)
            if not gh and response_format and response_format.get("type") in ("json_object", "json_schema"):
                schema = response_format.get("schema")
                if response_format.get("type") == "json_schema":
                    schema = (response_format.get("json_schema") or {}).get("schema")
                gh = eng.grammar(L.GRAMMAR_JSON_SCHEMA, json.dumps(schema)) if schema is not None else \
                    eng.grammar(L.GRAMMAR_JSON_OBJECT, "")
            reader = lib.kvlm_chat_reader_new(chat, prompt, len(prompt), tools_json if tool_choice != "none" else None,
                                              random.getrandbits(63), byref(err))
            if not reader:
                if gh:
                    lib.kvlm_grammar_free(gh)
                raise_err(err)
            try:
                req = eng.submit(tokens, s, special=True, grammar_handle=gh)
            except BaseException:
                lib.kvlm_chat_reader_free(reader)
                raise
            return req, reader

        cid = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        name = model or self.model_path
        if stream:
            def stream_chat() -> Iterator[Dict[str, Any]]:
                req, reader = start()
                yield from self._stream_chat(req, reader, cid, created, name)
            return stream_chat()
        req, reader = start()
        try:
            eng.run([req])
            c = req.completions[0]
            msg = c_void_p()
            text = c.text.encode("utf-8")
            n_calls = lib.kvlm_chat_reader_end(reader, text, len(text), None, byref(msg), byref(err))
            if n_calls < 0:
                raise_err(err)
            message = json.loads(L.take_string(msg.value) or "{}")
        finally:
            lib.kvlm_chat_reader_free(reader)
        finish = "tool_calls" if n_calls > 0 else c.finish
        choice: Dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        if c.logprobs is not None:
            m = eng.model
            choice["logprobs"] = {"content": [
                {"token": e["text"], "logprob": e["logprob"], "bytes": list(e["text"].encode()),
                 "top_logprobs": [{"token": m.piece(t), "logprob": lp, "bytes": list(m.piece(t).encode())}
                                  for t, lp in e["top"]]} for e in c.logprobs]}
        return {"id": cid, "object": "chat.completion", "created": created, "model": name, "choices": [choice],
                "usage": {"prompt_tokens": len(tokens), "completion_tokens": len(c.token_ids),
                          "total_tokens": len(tokens) + len(c.token_ids)}}

    def _stream_chat(self, req: Request, reader: int, cid: str, created: int,
                     name: str) -> Iterator[Dict[str, Any]]:
        eng = self._engine
        lib = eng._lib
        c = req.completions[0]
        err = L.kvlm_error()

        def chunk(delta: Dict[str, Any], finish: Optional[str]) -> Dict[str, Any]:
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        try:
            yield chunk({"role": "assistant"}, None)
            pushed = 0
            n_calls = 0
            while True:
                if not req.done:
                    eng.step()
                done = req.done  # (as in _stream_completion)
                # the reader sees everything (it holds back markers itself); stop strings were cut already
                text = c.text[pushed:] if done else c.new_text()
                pushed += len(text)
                raw = text.encode("utf-8")
                delta = c_void_p()
                if done:
                    n_calls = lib.kvlm_chat_reader_end(reader, raw, len(raw), byref(delta), None, byref(err))
                    if n_calls < 0:
                        raise_err(err)
                elif raw and lib.kvlm_chat_reader_push(reader, raw, len(raw), byref(delta), byref(err)):
                    raise_err(err)
                d = L.take_string(delta.value)
                if d:
                    yield chunk(json.loads(d), None)
                if done:
                    yield chunk({}, "tool_calls" if n_calls > 0 else c.finish)
                    break
        finally:
            lib.kvlm_chat_reader_free(reader)
            if not req.done:
                eng.cancel(req)
            else:
                eng.finish(req)

    # ---- embeddings ------------------------------------------------------------
    def embed(self, input: Union[str, List[str]], normalize: bool = True,
              truncate: bool = True) -> Union[List[float], List[List[float]]]:
        """The embedding of a text (a list of floats, unit length unless
        normalize is False), or of each of a list of texts; pooled by the
        model's rule (kvlm_model_pooling: a decoder's last token)."""
        eng = self._engine
        eng.check_open()
        texts = [input] if isinstance(input, str) else list(input)
        if not texts:
            return []
        inputs = []
        for t in texts:
            toks = self._embed_tokens(t)
            if truncate and len(toks) > eng.n_ctx:
                toks = toks[:eng.n_ctx]
            inputs.append(toks)
        req = eng.submit_embed(inputs, normalize=normalize)
        eng.run([req])
        vecs = [req.embeddings[i] for i in range(len(texts))]
        return vecs[0] if isinstance(input, str) else vecs

    def _embed_tokens(self, text: str) -> List[int]:
        eng = self._engine
        raw = text.encode("utf-8")
        err = L.kvlm_error()
        cap = len(raw) + 8
        while True:
            buf = (ctypes.c_int32 * cap)()
            n = eng._lib.kvlm_embed_tokenize(eng.model.handle, raw, len(raw), buf, cap, byref(err))
            if n < 0:
                raise_err(err)
            if n <= cap:
                return list(buf[:n])
            cap = n

    def create_embedding(self, input: Union[str, List[str]], model: Optional[str] = None) -> Dict[str, Any]:
        """OpenAI's embeddings response: {"object": "list", "data": [...], "model", "usage"}."""
        texts = [input] if isinstance(input, str) else list(input)
        vecs = self.embed(texts)
        n = sum(len(self._embed_tokens(t)) for t in texts)
        return {"object": "list", "model": model or self.model_path,
                "data": [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vecs)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}
