"""kvlm: Python bindings of the kvlm inference engine (ctypes over libkvlm.so).

Two shapes: ``kvlm.Llama`` (llama-cpp-python's) and ``kvlm.LLM`` with
``kvlm.SamplingParams`` (vLLM's offline inference); ``python -m
kvlm.server`` runs the OpenAI-compatible server. docs/python.md."""
from __future__ import annotations

from .errors import (CancelledError, InvalidArgumentError, KvlmError, KvlmIOError, KvlmMemoryError, KvMemoryError,
                     ModelFormatError, ModelNotFoundError, UnsupportedError)
from .llama import Llama, LlamaGrammar, LlamaState
from .llm import LLM, CompletionOutput, RequestOutput, SamplingParams, EmbeddingRequestOutput

__all__ = ["Llama", "LlamaGrammar", "LlamaState", "LLM", "SamplingParams", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "KvlmError", "KvlmIOError", "ModelNotFoundError", "ModelFormatError",
           "InvalidArgumentError", "KvlmMemoryError", "KvMemoryError", "UnsupportedError", "CancelledError",
           "version", "library_path"]


def version() -> str:
    """The library's version (kvlm_version)."""
    from . import _lib
    return _lib.lib().kvlm_version().decode()


def library_path() -> str:
    """The libkvlm.so this package loaded."""
    from . import _lib
    return _lib.library_path()
