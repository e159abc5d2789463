"""kvlm._lib: finding libkvlm.so and declaring, through ctypes, the part of
include/kvlm.h the Python package uses (structures mirrored field by field;
tests/test_layout.py checks their sizes against the C compiler's)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import threading
from ctypes import (CFUNCTYPE, POINTER, Structure, c_bool, c_char, c_char_p, c_double, c_float, c_int,
                    c_int8, c_int32, c_int64, c_size_t, c_uint64, c_void_p)
from pathlib import Path
from typing import List, Optional

# ---- status codes (kvlm.h's KVLM_E*) -------------------------------------
OK, EIO, EFORMAT, EINVAL, ENOMEM, ERANGE, EUNSUPPORTED, EFULL, ECANCELED = range(9)

FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR, FINISH_KV_FULL = range(6)
MAX_LOGPROBS = 20
MAX_STAGES = 16
MAX_KV_TIERS = 4
OUTPUT_LOGITS, OUTPUT_EMBD = 1, 2
DEVICE_CPU, DEVICE_CUDA = 0, 1
GRAMMAR_GBNF, GRAMMAR_JSON_SCHEMA, GRAMMAR_JSON_OBJECT = 0, 1, 2
LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR, LOG_OFF = range(5)


class kvlm_error(Structure):
    _fields_ = [("code", c_int), ("msg", c_char * 512)]


progress_cb = CFUNCTYPE(c_bool, c_float, c_void_p)
log_fn = CFUNCTYPE(None, c_void_p, c_int, c_char_p)


class kvlm_model_params(Structure):
    _fields_ = [("tokenizer_path", c_char_p), ("vocab_only", c_bool), ("metadata_only", c_bool),
                ("progress_callback", progress_cb), ("progress_callback_user_data", c_void_p),
                ("no_mmap", c_bool), ("mlock", c_bool)]


class kvlm_ctx_params(Structure):
    _fields_ = [("n_ctx", c_int), ("n_threads", c_int), ("no_kv_cache", c_bool), ("n_batch", c_int),
                ("n_seq_max", c_int), ("block_size", c_int), ("kv_mem", c_size_t), ("kv_blocks", c_int),
                ("no_prefix_cache", c_bool), ("cache_type_k", c_int), ("cache_type_v", c_int),
                ("kv_budget", c_int), ("kv_evict", c_int), ("kv_sinks", c_int), ("h2o_recent", c_int),
                ("h2o_heavy", c_float), ("device", c_int), ("kv_host_size", c_uint64), ("kv_disk", c_char_p),
                ("kv_disk_size", c_uint64), ("kv_redis", c_char_p), ("kv_redis_password", c_char_p),
                ("kv_redis_tls_ca", c_char_p), ("kv_redis_tls_cert", c_char_p), ("kv_redis_tls_key", c_char_p),
                ("kv_mac_key", c_void_p), ("kv_mac_key_len", c_size_t), ("kv_swap_size", c_uint64),
                ("no_kv_swap", c_bool), ("n_seq_draft", c_int), ("draft_model", c_void_p)]


class kvlm_batch(Structure):
    _fields_ = [("n_tokens", c_int), ("tokens", POINTER(c_int32)), ("pos", POINTER(c_int32)),
                ("logits", POINTER(c_int8)), ("seq", POINTER(c_int32))]


class kvlm_kv_stats(Structure):
    _fields_ = [("block_size", c_int), ("n_blocks", c_int), ("used", c_int), ("cached", c_int), ("free", c_int),
                ("shared", c_int), ("prefix_hits", c_uint64), ("prefix_misses", c_uint64),
                ("evictions", c_uint64), ("block_bytes", c_size_t), ("bytes_per_token", c_size_t),
                ("tokens_computed", c_uint64), ("type_k", c_int), ("type_v", c_int), ("stage_bytes", c_size_t),
                ("swap_slots", c_uint64), ("swap_used", c_uint64), ("swap_tier_used", c_uint64),
                ("swap_tier_out", c_uint64), ("swap_tier_lost", c_uint64)]


class kvlm_kv_tier_stats(Structure):
    _fields_ = [("name", c_char * 16), ("blocks", c_uint64), ("bytes", c_uint64), ("hits", c_uint64),
                ("misses", c_uint64), ("writes", c_uint64), ("write_bytes", c_uint64),
                ("dropped_writes", c_uint64), ("corrupt", c_uint64), ("forged", c_uint64), ("errors", c_uint64),
                ("evicted", c_uint64), ("reads", c_uint64), ("read_seconds", c_double), ("promoted", c_uint64),
                ("demoted", c_uint64), ("written_through", c_uint64), ("persisted", c_uint64), ("up", c_bool)]


class kvlm_sampler_params(Structure):
    _fields_ = [("temperature", c_float), ("top_k", c_int), ("top_p", c_float), ("min_p", c_float),
                ("repeat_penalty", c_float), ("repeat_last_n", c_int), ("seed", c_uint64),
                ("frequency_penalty", c_float), ("presence_penalty", c_float),
                ("bias_ids", POINTER(c_int32)), ("bias", POINTER(c_float)), ("n_bias", c_int),
                ("grammar", c_void_p), ("repetition_penalty", c_float), ("typical_p", c_float),
                ("dry_multiplier", c_float), ("dry_base", c_float), ("dry_allowed_length", c_int),
                ("dry_penalty_last_n", c_int), ("dry_sequence_breakers", POINTER(c_char_p)),
                ("n_dry_sequence_breakers", c_int), ("xtc_probability", c_float), ("xtc_threshold", c_float),
                ("stages", c_int * MAX_STAGES), ("n_stages", c_int), ("min_tokens", c_int),
                ("ignore_eos", c_bool), ("stop_ids", POINTER(c_int32)), ("n_stop_ids", c_int),
                ("model", c_void_p)]


class kvlm_sched_params(Structure):
    _fields_ = [("batch_tokens", c_int), ("max_seqs", c_int), ("spec_mode", c_int), ("spec_n_draft", c_int),
                ("draft_ctx", c_void_p), ("spec_p_min", c_float), ("spec_n_min", c_int)]


class kvlm_request_params(Structure):
    _fields_ = [("sampling", kvlm_sampler_params), ("max_tokens", c_int), ("n", c_int), ("logprobs", c_int),
                ("prompt_logprobs", c_bool), ("prompt_top_logprobs", c_int), ("no_prefix_reuse", c_bool)]


class kvlm_sched_event(Structure):
    _fields_ = [("id", c_uint64), ("index", c_int), ("token", c_int32), ("finish", c_int), ("logprob", c_float),
                ("rank", c_int), ("n_top", c_int), ("top_tokens", c_int32 * MAX_LOGPROBS),
                ("top_logprobs", c_float * MAX_LOGPROBS), ("prompt_tokens", c_int), ("cached_tokens", c_int),
                ("error", c_char_p), ("prompt_token", c_bool), ("pos", c_int), ("queue_time", c_double),
                ("embedding", POINTER(c_float)), ("n_embd", c_int)]


sched_cb = CFUNCTYPE(c_bool, c_void_p, POINTER(kvlm_sched_event))


class kvlm_embed_params(Structure):
    _fields_ = [("pooling", c_int), ("no_normalize", c_bool), ("dims", c_int)]


class kvlm_chat_params(Structure):
    _fields_ = [("template_name", c_char_p), ("template_text", c_char_p), ("template_origin", c_char_p),
                ("tool_parser", c_char_p), ("reasoning_format", c_int)]


class kvlm_detok(Structure):
    _fields_ = [("model", c_void_p), ("pending", c_char * 8), ("n_pending", c_int), ("prev", c_int32),
                ("special", c_bool)]


class kvlm_server_params(Structure):
    _fields_ = [("host", c_char_p), ("port", c_int), ("model_id", c_char_p), ("chat", c_void_p),
                ("chat_template", c_char_p), ("tool_parser", c_char_p), ("reasoning_format", c_int),
                ("batch_tokens", c_int), ("max_seqs", c_int), ("max_body", c_size_t), ("timeout_s", c_int),
                ("header_timeout_s", c_int), ("body_timeout_s", c_int), ("send_timeout_s", c_int),
                ("max_conns", c_int), ("max_conns_per_ip", c_int), ("api_key", c_char_p),
                ("metrics_auth", c_bool), ("cors_origins", POINTER(c_char_p)), ("n_cors_origins", c_int),
                ("ssl_key_file", c_char_p), ("ssl_cert_file", c_char_p), ("ssl_min_version", c_char_p),
                ("keepalive_s", c_double), ("kv_events", c_char_p), ("kv_events_topic", c_char_p),
                ("kv_events_replay", c_char_p), ("kv_events_buffer", c_int), ("spec_mode", c_int),
                ("spec_n_draft", c_int), ("draft_ctx", c_void_p), ("spec_p_min", c_float), ("embeddings", c_bool),
                ("max_body_total", c_size_t), ("max_unsent", c_size_t), ("strict_params", c_bool),
                ("log_json", c_bool), ("log_interval_s", c_double), ("answer_ids_mem", c_int64),
                ("spec_n_min", c_int)]


# (name, restype, argtypes) of every function used
_PROTOS = [
    ("kvlm_status_name", c_char_p, [c_int]),
    ("kvlm_version", c_char_p, []),
    ("kvlm_log_set", None, [log_fn, c_void_p]),
    ("kvlm_log_set_level", None, [c_int]),
    ("kvlm_log_get_level", c_int, []),
    ("kvlm_log", None, None),  # variadic: (int level, const char *fmt, ...)
    ("kvlm_model_load", c_void_p, [c_char_p, POINTER(kvlm_model_params), POINTER(kvlm_error)]),
    ("kvlm_model_free", None, [c_void_p]),
    ("kvlm_model_describe", None, [c_void_p, c_char_p, c_size_t]),
    ("kvlm_vocab_size", c_int, [c_void_p]),
    ("kvlm_token_bos", c_int32, [c_void_p]),
    ("kvlm_token_eos", c_int32, [c_void_p]),
    ("kvlm_token_is_eog", c_bool, [c_void_p, c_int32]),
    ("kvlm_add_bos", c_bool, [c_void_p]),
    ("kvlm_tokenize", c_int, [c_void_p, c_char_p, c_size_t, c_bool, c_bool, POINTER(c_int32), c_int,
                              POINTER(kvlm_error)]),
    ("kvlm_token_to_piece", c_int, [c_void_p, c_int32, c_bool, c_char_p, c_size_t]),
    ("kvlm_detok_init", None, [POINTER(kvlm_detok), c_void_p]),
    ("kvlm_detok_push", c_int, [POINTER(kvlm_detok), c_int32, c_char_p, c_size_t]),
    ("kvlm_detok_flush", c_int, [POINTER(kvlm_detok), c_char_p, c_size_t]),
    ("kvlm_cache_type_from_name", c_int, [c_char_p]),
    ("kvlm_ctx_default_params", kvlm_ctx_params, []),
    ("kvlm_ctx_create", c_void_p, [c_void_p, POINTER(kvlm_ctx_params), POINTER(kvlm_error)]),
    ("kvlm_ctx_free", None, [c_void_p]),
    ("kvlm_ctx_n_ctx", c_int, [c_void_p]),
    ("kvlm_ctx_n_seq_max", c_int, [c_void_p]),
    ("kvlm_decode", c_int, [c_void_p, POINTER(kvlm_batch), POINTER(kvlm_error)]),
    ("kvlm_get_logits", POINTER(c_float), [c_void_p, c_int]),
    ("kvlm_ctx_reset", None, [c_void_p]),
    ("kvlm_seq_free", None, [c_void_p, c_int]),
    ("kvlm_session_save", c_int, [c_void_p, c_int, c_char_p, POINTER(kvlm_error)]),
    ("kvlm_session_load", c_int, [c_void_p, c_int, POINTER(c_int32), c_int, c_char_p, POINTER(kvlm_error)]),
    ("kvlm_seq_n_past", c_int, [c_void_p, c_int]),
    ("kvlm_kv_stats_get", None, [c_void_p, POINTER(kvlm_kv_stats)]),
    ("kvlm_kv_tier_stats_get", c_int, [c_void_p, POINTER(kvlm_kv_tier_stats), c_int]),
    ("kvlm_grammar_build", c_void_p, [c_void_p, c_int, c_char_p, POINTER(kvlm_error)]),
    ("kvlm_grammar_free", None, [c_void_p]),
    ("kvlm_sampler_default_params", kvlm_sampler_params, []),
    ("kvlm_sampler_params_check", c_int, [POINTER(kvlm_sampler_params), c_int, POINTER(c_int),
                                          POINTER(kvlm_error)]),
    ("kvlm_embed_default_params", kvlm_embed_params, []),
    ("kvlm_embed_dims", c_int, [c_void_p, POINTER(kvlm_embed_params), POINTER(kvlm_error)]),
    ("kvlm_embed_tokenize", c_int, [c_void_p, c_char_p, c_size_t, POINTER(c_int32), c_int, POINTER(kvlm_error)]),
    ("kvlm_chat_create", c_void_p, [c_void_p, POINTER(kvlm_chat_params), POINTER(kvlm_error)]),
    ("kvlm_chat_free", None, [c_void_p]),
    ("kvlm_chat_render", c_int, [c_void_p, c_char_p, POINTER(c_void_p), POINTER(c_size_t), POINTER(kvlm_error)]),
    ("kvlm_chat_tools_check", c_int, [c_char_p, c_char_p, POINTER(c_char_p), POINTER(kvlm_error)]),
    ("kvlm_chat_tool_grammar", c_int, [c_void_p, c_char_p, c_size_t, c_char_p, c_char_p, c_bool,
                                       POINTER(c_void_p), POINTER(kvlm_error)]),
    ("kvlm_chat_reader_new", c_void_p, [c_void_p, c_char_p, c_size_t, c_char_p, c_uint64, POINTER(kvlm_error)]),
    ("kvlm_chat_reader_push", c_int, [c_void_p, c_char_p, c_size_t, POINTER(c_void_p), POINTER(kvlm_error)]),
    ("kvlm_chat_reader_end", c_int, [c_void_p, c_char_p, c_size_t, POINTER(c_void_p), POINTER(c_void_p),
                                     POINTER(kvlm_error)]),
    ("kvlm_chat_reader_free", None, [c_void_p]),
    ("kvlm_sched_create", c_void_p, [c_void_p, POINTER(kvlm_sched_params), POINTER(kvlm_error)]),
    ("kvlm_sched_free", None, [c_void_p]),
    ("kvlm_sched_submit", c_uint64, [c_void_p, POINTER(c_int32), c_int, POINTER(kvlm_request_params), sched_cb,
                                     c_void_p, POINTER(kvlm_error)]),
    ("kvlm_sched_submit_embed", c_uint64, [c_void_p, POINTER(POINTER(c_int32)), POINTER(c_int), c_int,
                                           POINTER(kvlm_embed_params), sched_cb, c_void_p, POINTER(kvlm_error)]),
    ("kvlm_sched_cancel", None, [c_void_p, c_uint64]),
    ("kvlm_sched_step", c_int, [c_void_p]),
    ("kvlm_server_start", c_void_p, [c_void_p, POINTER(kvlm_server_params), POINTER(kvlm_error)]),
    ("kvlm_server_port", c_int, [c_void_p]),
    ("kvlm_server_stop", None, [c_void_p]),
]


def _candidates() -> List[str]:
    """Where libkvlm.so is looked for, in order (docs/python.md)."""
    out: List[str] = []
    env = os.environ.get("KVLM_LIBRARY")
    if env:
        return [env]
    # a clone: python/kvlm/_lib.py -> ../../build/libkvlm.so
    here = Path(__file__).resolve().parent
    for up in (here.parent.parent, Path.cwd()):
        p = up / "build" / "libkvlm.so"
        if p.exists():
            out.append(str(p))
    try:
        libdir = subprocess.run(["pkg-config", "--variable=libdir", "kvlm"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        if libdir and os.path.exists(os.path.join(libdir, "libkvlm.so")):
            out.append(os.path.join(libdir, "libkvlm.so"))
    except (OSError, subprocess.SubprocessError):
        pass
    found = ctypes.util.find_library("kvlm")
    out.append(found or "libkvlm.so")
    return out


_lib: Optional[ctypes.CDLL] = None
_lib_lock = threading.Lock()


def lib() -> ctypes.CDLL:
    """The loaded library, its functions declared (loaded at the first call)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        errors = []
        for path in _candidates():
            try:
                handle = ctypes.CDLL(path)
                break
            except OSError as e:
                errors.append(f"{path}: {e}")
        else:
            raise OSError("libkvlm.so not found (build it, set KVLM_LIBRARY, or install kvlm): "
                          + "; ".join(errors))
        for name, res, args in _PROTOS:
            fn = getattr(handle, name)
            fn.restype = res
            if args is not None:
                fn.argtypes = args
        handle.kvlm_free_c = ctypes.CDLL(None).free  # for what the library malloc'd
        handle.kvlm_free_c.argtypes = [c_void_p]
        handle.kvlm_free_c.restype = None
        _install_log(handle)
        _lib = handle
        return handle


def library_path() -> str:
    """The file the library was loaded from."""
    return lib()._name


# ---- logging: silent unless some object asked for verbose output ----------
_verbose = 0
_verbose_lock = threading.Lock()


def _log(user, level, msg):  # type: ignore[no-untyped-def]
    try:
        if _verbose > 0:
            import sys
            sys.stderr.write("kvlm %s: %s\n" % (("debug", "info", "warn", "error")[min(level, 3)],
                                                 msg.decode("utf-8", "replace")))
    except Exception:  # a callback must not raise into C
        pass


_log_cb = log_fn(_log)  # held for the life of the process: the library keeps the pointer


def _install_log(handle: ctypes.CDLL) -> None:
    handle.kvlm_log_set(_log_cb, None)


def verbose_acquire(on: bool) -> None:
    global _verbose
    if on:
        with _verbose_lock:
            _verbose += 1


def verbose_release(on: bool) -> None:
    global _verbose
    if on:
        with _verbose_lock:
            _verbose -= 1


def take_string(ptr: Optional[int]) -> Optional[str]:
    """A malloc'd C string's text; the string is freed."""
    if not ptr:
        return None
    try:
        return ctypes.string_at(ptr).decode("utf-8", "replace")
    finally:
        lib().kvlm_free_c(ptr)
