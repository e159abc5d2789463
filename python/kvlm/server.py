"""kvlm.server: `python -m kvlm.server --model M ...` runs kvlm's
OpenAI-compatible HTTP server (kvlm_server_start) inside this process until
Ctrl-C (or SIGTERM). docs/serving.md describes the endpoints."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from ctypes import byref
from typing import List, Optional

from . import _lib as L
from ._engine import Engine
from .errors import KvlmError, raise_err


class Server:
    """A running server over an engine of its own; stop() ends it."""

    def __init__(self, model: str, *, host: str = "127.0.0.1", port: int = 8080, n_ctx: int = 0,
                 n_threads: Optional[int] = None, parallel: int = 4, model_id: Optional[str] = None,
                 api_key: Optional[str] = None, chat_template: Optional[str] = None, embeddings: bool = False,
                 cache_type_k: Optional[str] = None, cache_type_v: Optional[str] = None, device: str = "cpu",
                 verbose: bool = True) -> None:
        self._engine = Engine(model, n_ctx=n_ctx, n_threads=n_threads, n_seq_max=parallel,
                              cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                              device=L.DEVICE_CUDA if device == "cuda" else L.DEVICE_CPU, verbose=verbose)
        lib = self._engine._lib
        p = L.kvlm_server_params()
        self._keep = [s.encode() if s else None for s in (host, model_id, api_key, chat_template)]
        p.host, p.model_id, p.api_key, p.chat_template = self._keep
        p.port = int(port)
        p.embeddings = embeddings
        p.max_seqs = int(parallel)
        err = L.kvlm_error()
        self._h = lib.kvlm_server_start(self._engine.ctx, byref(p), byref(err))
        if not self._h:
            self._engine.close()
            raise_err(err)
        self.port: int = lib.kvlm_server_port(self._h)
        self.host = host

    def stop(self) -> None:
        """Ends every request, stops the server and frees the model."""
        if self._h:
            self._engine._lib.kvlm_server_stop(self._h)
            self._h = None
        self._engine.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlm.server",
                                 description="kvlm's OpenAI-compatible server, in this process (Ctrl-C stops it)")
    ap.add_argument("--model", "-m", required=True, help="model file (GGUF, llama2.c) or Hugging Face directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080, help="0: any free port")
    ap.add_argument("--ctx-size", "-c", type=int, default=0, help="context per sequence (0: the model's)")
    ap.add_argument("--threads", "-t", type=int, default=None)
    ap.add_argument("--parallel", "-np", type=int, default=4, help="sequences at once")
    ap.add_argument("--alias", default=None, help="the model id clients name")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--chat-template", default=None)
    ap.add_argument("--embeddings", action="store_true")
    ap.add_argument("--cache-type-k", default=None)
    ap.add_argument("--cache-type-v", default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quiet", action="store_true", help="no log on stderr")
    a = ap.parse_args(argv)
    if not a.quiet and "KVLM_LOG" not in os.environ:
        L.lib().kvlm_log_set_level(L.LOG_INFO)  # a line per request, as kvlm serve logs
    try:
        srv = Server(a.model, host=a.host, port=a.port, n_ctx=a.ctx_size, n_threads=a.threads,
                     parallel=a.parallel, model_id=a.alias, api_key=a.api_key, chat_template=a.chat_template,
                     embeddings=a.embeddings, cache_type_k=a.cache_type_k, cache_type_v=a.cache_type_v,
                     device=a.device, verbose=not a.quiet)
    except KvlmError as e:
        print(f"kvlm.server: {e}", file=sys.stderr)
        return 1
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    print(f"kvlm.server: listening on http://{a.host}:{srv.port}", flush=True)
    try:
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    srv.stop()
    print("kvlm.server: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
