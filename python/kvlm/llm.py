"""kvlm.llm: kvlm.LLM, vLLM's offline-inference shape over libkvlm: every
prompt of a generate() call is submitted to the scheduler at once and run
batched (continuous batching, prefix sharing between prompts)."""
from __future__ import annotations

import ctypes
import json
from ctypes import byref, c_size_t, c_void_p
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

from . import _lib as L
from ._engine import Engine, Request, Sampling
from .errors import raise_err


@dataclass
class SamplingParams:
    """How to sample, as vLLM's SamplingParams: ``n`` completions per prompt,
    ``temperature`` (0: greedy), ``top_p``, ``top_k`` (-1: off), ``min_p``,
    ``max_tokens``, ``stop`` strings, ``stop_token_ids``, ``seed`` (completion
    i draws with seed + i), ``logprobs`` (the chosen token's and that many
    alternatives'), ``prompt_logprobs`` (each prompt token's given the ones
    before it, and that many alternatives), penalties, ``ignore_eos``,
    ``min_tokens``."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: Optional[int] = 16
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    seed: Optional[int] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass
class CompletionOutput:
    """One completion of a prompt: its text, token ids, log-probabilities
    (a dict per token: token id -> logprob, the chosen one included) and why
    it ended ("stop", "length")."""
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, float]]]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The outputs of one prompt, in vLLM's shape."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[List[Optional[Dict[int, float]]]] = None


@dataclass
class EmbeddingOutput:
    embedding: List[float]


@dataclass
class EmbeddingRequestOutput:
    """An embedding of one prompt, as vLLM's LLM.embed gives it."""
    request_id: str
    prompt_token_ids: List[int]
    outputs: EmbeddingOutput
    finished: bool = True


class LLM:
    """A model for offline batched inference, as vllm.LLM is.

    ``max_model_len`` is the context (0/None: the model's), ``max_num_seqs``
    how many sequences run at once (the KV pool is sized for them),
    ``kv_cache_dtype`` the KV cache's element type ("auto": f16),
    ``kv_cache_memory_bytes`` the KV pool's size (None: room for every
    sequence's full context),
    ``device`` "cpu" or "cuda"."""

    def __init__(self, model: str, *, tokenizer: Optional[str] = None, max_model_len: Optional[int] = None,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 0, kv_cache_dtype: str = "auto",
                 kv_cache_memory_bytes: Optional[int] = None,
                 device: str = "cpu", seed: Optional[int] = None, n_threads: Optional[int] = None,
                 verbose: bool = False, **kwargs: Any) -> None:
        self.model = str(model)
        self._seed = seed
        dt = None if kv_cache_dtype in (None, "auto") else kv_cache_dtype
        self._engine = Engine(self.model, n_ctx=int(max_model_len or 0), n_threads=n_threads,
                              n_seq_max=max(1, int(max_num_seqs)), kv_mem=int(kv_cache_memory_bytes or 0), cache_type_k=dt, cache_type_v=dt,
                              device=L.DEVICE_CUDA if device == "cuda" else L.DEVICE_CPU, verbose=verbose,
                              batch_tokens=max_num_batched_tokens)
        self._next_id = 0

    def close(self) -> None:
        """Frees the model and its KV cache now."""
        self._engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return _Tokenizer(self._engine)

    def _sampling(self, p: SamplingParams) -> Sampling:
        stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
        max_tokens = p.max_tokens if p.max_tokens is not None else self._engine.n_ctx
        return Sampling(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                        repeat_penalty=1.0, frequency_penalty=p.frequency_penalty,
                        presence_penalty=p.presence_penalty, repetition_penalty=p.repetition_penalty,
                        seed=p.seed if p.seed is not None else self._seed, max_tokens=max_tokens, n=p.n,
                        logprobs=p.logprobs, stop=stop, stop_token_ids=p.stop_token_ids or [],
                        ignore_eos=p.ignore_eos, min_tokens=p.min_tokens, prompt_logprobs=p.prompt_logprobs)

    def _tokens(self, prompt: Any) -> tuple:
        eng = self._engine
        m = eng.model
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        return prompt, m.tokenize(prompt.encode("utf-8"), bool(eng._lib.kvlm_add_bos(m.handle)), False)

    def generate(self, prompts: Union[str, Sequence[Any]],
                 sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
                 use_tqdm: bool = False, **kwargs: Any) -> List[RequestOutput]:
        """Completes every prompt (text, {"prompt": text} or
        {"prompt_token_ids": [...]}), all at once through the scheduler;
        returns a RequestOutput per prompt, in order."""
        eng = self._engine
        eng.check_open()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompts)
        items = []
        reqs: List[Request] = []
        try:
            for prompt, sp in zip(prompts, params):
                text, toks = self._tokens(prompt)
                req = eng.submit(toks, self._sampling(sp))
                items.append((text, toks, sp))
                reqs.append(req)
        except BaseException:
            for r in reqs:
                eng.cancel(r)
            raise
        eng.run(reqs)
        out = []
        for (text, toks, sp), req in zip(items, reqs):
            comps = []
            for c in req.completions:
                lps = None
                cum = None
                if c.logprobs is not None:
                    lps = []
                    cum = 0.0
                    for e in c.logprobs:
                        d = {t: lp for t, lp in e["top"]}
                        d[e["token"]] = e["logprob"]
                        lps.append(d)
                        cum += e["logprob"]
                comps.append(CompletionOutput(index=c.index, text=c.text, token_ids=list(c.token_ids),
                                              cumulative_logprob=cum, logprobs=lps, finish_reason=c.finish))
            plp = None
            if sp.prompt_logprobs is not None:
                plp = [None] + [req.prompt_logprobs.get(i) for i in range(1, len(toks))]
            out.append(RequestOutput(request_id=str(self._next_id), prompt=text, prompt_token_ids=list(toks),
                                     outputs=comps, num_cached_tokens=req.cached_tokens, prompt_logprobs=plp))
            self._next_id += 1
        return out

    def chat(self, messages: Union[List[Dict[str, Any]], List[List[Dict[str, Any]]]],
             sampling_params: Optional[SamplingParams] = None, use_tqdm: bool = False,
             chat_template_kwargs: Optional[Dict[str, Any]] = None, **kwargs: Any) -> List[RequestOutput]:
        """Renders each conversation through the model's chat template and
        generates them together; returns a RequestOutput per conversation."""
        eng = self._engine
        eng.check_open()
        lib = eng._lib
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore
        chat = eng.chat_handle()
        prompts = []
        for conv in convs:
            request: Dict[str, Any] = {"messages": conv, "add_generation_prompt": True}
            if chat_template_kwargs:
                request["chat_template_kwargs"] = chat_template_kwargs
            out = c_void_p()
            n = c_size_t()
            err = L.kvlm_error()
            if lib.kvlm_chat_render(chat, json.dumps(request).encode(), byref(out), byref(n), byref(err)):
                raise_err(err)
            text = ctypes.string_at(out.value, n.value)
            lib.kvlm_free_c(out.value)
            toks = eng.model.tokenize(text, bool(lib.kvlm_add_bos(eng.model.handle)), True)
            prompts.append({"prompt_token_ids": toks})
        outs = self.generate(prompts, sampling_params)
        return outs

    def embed(self, prompts: Union[str, Sequence[str]], **kwargs: Any) -> List[EmbeddingRequestOutput]:
        """Embeddings of the prompts (unit length, the model's pooling), all
        submitted as one embedding request."""
        from .llama import Llama
        eng = self._engine
        eng.check_open()
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        toks = [Llama._embed_tokens(self, t) for t in texts]  # type: ignore[arg-type]
        req = eng.submit_embed(toks)
        eng.run([req])
        out = []
        for i, t in enumerate(toks):
            out.append(EmbeddingRequestOutput(request_id=str(self._next_id), prompt_token_ids=t,
                                              outputs=EmbeddingOutput(req.embeddings[i])))
            self._next_id += 1
        return out


class _Tokenizer:
    """What LLM.get_tokenizer() gives: encode and decode."""

    def __init__(self, engine: Engine) -> None:
        self._e = engine

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        m = self._e.model
        return m.tokenize(text.encode(), add_special_tokens and bool(m._lib.kvlm_add_bos(m.handle)), False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        from ._engine import Detok
        d = Detok(self._e.model, not skip_special_tokens)
        return (b"".join(d.push(int(t)) for t in ids) + d.flush()).decode("utf-8", "replace")
