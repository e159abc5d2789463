/* kvlm.h: the public C API of libkvlm, an LLM inference engine built around
 * its KV cache. Everything the `kvlm` command uses goes through this header. */
#ifndef KVLM_H
#define KVLM_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors ------------------------------------------------------------ */
enum {
    KVLM_OK = 0,
    KVLM_EIO,          /* a file could not be opened/read/written */
    KVLM_EFORMAT,      /* a file or input is malformed */
    KVLM_EINVAL,       /* a bad argument */
    KVLM_ENOMEM,       /* an allocation failed */
    KVLM_ERANGE,       /* e.g. a prompt longer than the context */
    KVLM_EUNSUPPORTED, /* an architecture, type or feature kvlm lacks */
    KVLM_EFULL,        /* the KV cache has no room */
    KVLM_ECANCELED,    /* a progress callback returned false (kvlm_progress_callback) */
};
typedef struct kvlm_error {
    int code;
    char msg[512];
} kvlm_error;
const char *kvlm_status_name(int code);

/* The library's version and the git revision it was built from, e.g.
 * "0.1.0 (git 1a2b3c4d5e)" ("-dirty" after a revision with uncommitted
 * changes; "unknown revision" outside a git checkout). The first word is
 * the version of project() in CMakeLists.txt, which kvlm.pc and the CMake
 * package carry too. `kvlm --version` prints it. */
const char *kvlm_version(void);

/* Progress of long work (loading a model, kvlm_model_save_gguf_progress,
 * kvlm_model_synth), as llama.h's progress_callback: called on the calling
 * thread with a fraction of the work done that never decreases, 0 first and
 * 1 last when the work completes; user_data is given back as it was passed.
 * Returning false stops the work cleanly: the call fails with KVLM_ECANCELED
 * (nothing half-made is kept; a file being written is removed). */
typedef bool (*kvlm_progress_callback)(float progress, void *user_data);

/* ---- logging ------------------------------------------------------------ */
/* Everything the library says (a KV tier unreachable, a completion ended for
 * lack of KV blocks, a preemption at info, ...) goes through one channel: the
 * callback set by kvlm_log_set, which then gets every message at or above the
 * level (one line, no newline; called from whichever thread logs, one call at
 * a time; it must not call kvlm_log itself), and the library never writes to
 * stderr on its own. Without a callback, messages go to stderr as
 * "kvlm LEVEL: message". The level is kvlm_log_set_level's, or the
 * environment's KVLM_LOG (debug, info, warn, error, off), or warn. */
enum { KVLM_LOG_DEBUG = 0, KVLM_LOG_INFO, KVLM_LOG_WARN, KVLM_LOG_ERROR, KVLM_LOG_OFF };
typedef void (*kvlm_log_fn)(void *user, int level, const char *msg);
/* fn NULL: back to stderr. Once it returns, the previous callback is not running. */
void kvlm_log_set(kvlm_log_fn fn, void *user);
void kvlm_log_set_level(int level);
int kvlm_log_get_level(void);
/* Logs through the same channel (the server and the command use it). */
void kvlm_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* "debug", "info", "warn" (or "warning"), "error", "off" -> KVLM_LOG_*, or -1; and back (NULL if none). */
int kvlm_log_level_from_name(const char *name);
const char *kvlm_log_level_name(int level);

/* ---- models ------------------------------------------------------------ */
/* phi3: fused attn_qkv and gate+up tensors, NeoX RoPE, no biases (LongRoPE
 * for the 128k-context variants) */
/* qwen3 (dense): qwen2's layout without biases, an RMSNorm over each head of
 * q and k before RoPE (attn_q_norm, attn_k_norm), a head dimension of its own;
 * qwen3moe: qwen3's attention with a mixture of experts in every layer.
 * llama with expert_count: Mixtral's mixture of experts;
 * qwen2moe: qwen2's attention, experts (not renormalised) plus a shared
 * expert scaled by a sigmoid gate of its own */
/* smollm3: llama's layout; every fourth layer has no RoPE (NoPE) */
/* olmo2 (AI2's OLMo 2): no norm before attention or FFN, an RMSNorm after
 * each (before it joins the residual), and q and k each normed across all
 * their heads before RoPE (NeoX) */
/* granite (IBM Granite 3): llama's layout with four multipliers: the
 * embeddings, each branch's output before it joins the residual, q.k (the
 * attention scale) and the logits (divided); granitemoe (Granite 3.0/3.1
 * MoE, and "MoE Shared"): the same with Mixtral's experts in every layer,
 * plus a shared expert added ungated when the file has one */
/* deepseek2: DeepSeek-V2/V3 multi-head latent attention (the cache holds one
 * latent row per token, docs/mla.md) and mixture-of-experts feed-forward */
/* gpt-oss (OpenAI's gpt-oss-20b and -120b, GGUF architecture "gpt-oss"):
 * biases on q, k, v and the attention output, a learned attention sink per
 * head, even layers sliding-window (128), odd ones global, NeoX RoPE with
 * YaRN, and a mixture of experts with a biased router (softmax over the top
 * experts' logits) and biased experts whose gate is clamped SwiGLU
 * (docs/weights.md) */
/* gemma2 / gemma3 (text): embeddings scaled by sqrt(dim), GeGLU, norms after
 * attention and FFN, soft-capping (gemma2), q/k norms (gemma3), layers
 * alternating sliding-window (local) and global attention (docs/sliding-window.md) */
/* bert and nomic-bert (nomic-embed-text): encoders, for embeddings only
 * (docs/embeddings.md): bidirectional attention over the whole input, no KV
 * cache kept, LayerNorm after attention and after the FFN. bert: learned
 * absolute position embeddings, biases everywhere, GELU; nomic-bert: NeoX
 * RoPE, one fused Q, K, V matrix, SwiGLU, no biases. Both add token type 0's
 * embedding and a LayerNorm to the token embeddings. */
typedef enum { KVLM_ARCH_LLAMA = 0, KVLM_ARCH_QWEN2 = 1, KVLM_ARCH_PHI3 = 2, KVLM_ARCH_DEEPSEEK2 = 3,
               KVLM_ARCH_GEMMA2 = 4, KVLM_ARCH_GEMMA3 = 5, KVLM_ARCH_QWEN3 = 6,
               KVLM_ARCH_QWEN3MOE = 7, KVLM_ARCH_SMOLLM3 = 8, KVLM_ARCH_GRANITE = 9,
               KVLM_ARCH_OLMO2 = 10, KVLM_ARCH_QWEN2MOE = 11,
               KVLM_ARCH_GRANITEMOE = 12, KVLM_ARCH_GPTOSS = 13,
               KVLM_ARCH_BERT = 14, KVLM_ARCH_NOMIC_BERT = 15 } kvlm_arch;

typedef struct kvlm_config {
    kvlm_arch arch;
    int dim;            /* embedding width */
    int hidden_dim;     /* FFN width */
    int n_layers;
    int n_heads;        /* query heads */
    int n_kv_heads;     /* key/value heads (n_heads / n_kv_heads queries share one) */
    int head_dim;
    int vocab_size;
    int n_ctx_train;    /* trained context length */
    int rope_dim;       /* dimensions of each head that RoPE rotates */
    float rope_base;
    bool rope_neox;     /* rotate (i, i + rope_dim/2) instead of (2i, 2i+1) */
    /* Llama 3.1's RoPE scaling: rope_dim/2 factors that divide each pair's
     * angle (GGUF's rope_freqs.weight, or computed from a Hugging Face
     * config's rope_scaling of type llama3; owned by the model); NULL: none */
    const float *rope_freqs;
    /* linear RoPE scaling (GGUF rope.scaling.type "linear", Hugging Face's
     * rope_type "linear"): every angle divided by it, on top of rope_freqs;
     * gemma3: its global layers only. 0: none */
    float rope_linear;
    /* LongRoPE (the 128k-context Phi-3 and Phi-3.5: GGUF's rope_factors_long
     * and rope_factors_short tensors, Hugging Face's rope_type "longrope"):
     * rope_freqs holds the long factors, rope_freqs_short the short ones, which
     * a context of at most longrope_orig_ctx tokens a sequence takes instead
     * (llama.cpp's rule, made when a context is created); NULL: none. The rotation's
     * magnitude longrope_attn_factor on q's and k's rotated dimensions goes on
     * q's alone, squared (keys keep plain rotations). */
    const float *rope_freqs_short;
    int longrope_orig_ctx;
    float longrope_attn_factor;
    /* smollm3: layer l turns q and k by no RoPE when (l + 1) % no_rope_period
     * == 0 (4: llama.cpp's fixed step, Hugging Face's no_rope_layer_interval);
     * 0: every layer does */
    int no_rope_period;
    /* olmo2: q_norm and k_norm span all of q's and k's heads (n_heads x
     * head_dim, n_kv_heads x head_dim); elsewhere (qwen3, gemma3) one head */
    bool qk_norm_full;
    float norm_eps;
    int weight_type;    /* type of most weights (GGUF type id) */
    /* deepseek2 (0 elsewhere). head_dim is the key length (nope + rope_dim);
     * a cache row is kv_lora_rank + rope_dim elements (docs/mla.md). */
    int q_lora_rank;    /* 0: queries straight from the input (attn_q) */
    int kv_lora_rank;
    int v_head_dim;     /* value length per head */
    int n_expert, n_expert_used, n_expert_shared, n_dense_lead, expert_ff;
    int expert_shared_ff; /* qwen2moe: the shared expert's width (deepseek2's: expert_ff x n_expert_shared) */
    float expert_weights_scale;
    bool expert_weights_norm;
    int expert_gating;  /* 1 softmax (V2), 2 sigmoid with exp_probs_b selection bias (V3) */
    /* YaRN RoPE scaling (rope.scaling.type "yarn"; factor 0: none):
     * frequencies interpolated by 1/factor outside the ramp between the
     * dimensions that beta_fast and beta_slow rotations name at the original
     * context. deepseek2: attention scale (1 + log_mul ln factor)^2 / sqrt(key
     * length); llama, qwen2: the factors are in rope_freqs, and attn_scale
     * holds (1 + 0.1 ln factor)^2 / sqrt(head_dim) */
    float yarn_factor, yarn_log_mul, yarn_beta_fast, yarn_beta_slow;
    int yarn_orig_ctx;
    /* Sliding-window attention (docs/sliding-window.md): a local layer's query
     * at position p sees keys p - sliding_window < k <= p (llama.cpp's and Hugging
     * Face's convention); 0: every layer global. swa_period 0: every layer is
     * local; n > 0: layer l is global when (l + 1) % n == 0 (gemma2: 2, gemma3: 6). */
    int sliding_window;
    int swa_period;
    int n_local_layers;
    float rope_base_local;  /* local layers' RoPE base (gemma3: 10000); rope_base otherwise */
    float attn_softcap;     /* scores become cap * tanh(s / cap); 0: none (gemma2: 50) */
    float final_softcap;    /* likewise the logits (gemma2: 30) */
    float attn_scale;       /* multiplies q.k: 1/sqrt(head_dim), or gemma's query_pre_attn_scalar */
    /* granite (0 elsewhere: none): the embeddings are multiplied by
     * embed_mult, each attention and FFN output by residual_mult before it
     * joins the residual, and the logits divided by logit_div */
    float embed_mult, residual_mult, logit_div;
    /* {arch}.pooling_type (KVLM_POOLING_*), -1 when the file has none
     * (kvlm_model_pooling says what is used then) */
    int pooling;
    /* an encoder (bert, nomic-bert): bidirectional attention, embeddings
     * only; norm_eps is then its LayerNorm's epsilon */
    bool encoder;
} kvlm_config;

typedef struct kvlm_model kvlm_model;

typedef struct kvlm_model_params {
    const char *tokenizer_path; /* llama2.c .bin only; NULL: tokenizer.bin beside the model */
    bool vocab_only;            /* load only the tokenizer (vocabulary-only GGUF files) */
    bool metadata_only;         /* open and validate the file, read nothing model-specific (inspect) */
    /* Called as the weights are read (kvlm_progress_callback; NULL: none):
     * most of a load's time is reading the file once into the layout the
     * matmuls use; false cancels the load (KVLM_ECANCELED, nothing kept). */
    kvlm_progress_callback progress_callback;
    void *progress_callback_user_data;
    /* llama.cpp's --no-mmap: the weights are read into memory rather than
     * mapped from the file (the file may then change or go; more memory
     * while loading). --mlock: the model's memory is locked so it is never
     * paged out (a load fails with KVLM_ENOMEM past RLIMIT_MEMLOCK). */
    bool no_mmap;
    bool mlock;
} kvlm_model_params;

/* GGUF (v2/v3) or llama2.c checkpoint, detected from the file's contents, or a
 * Hugging Face model directory (config.json, *.safetensors, tokenizer.json:
 * docs/hf-checkpoints.md). */
kvlm_model *kvlm_model_load(const char *path, const kvlm_model_params *params, kvlm_error *err);
void kvlm_model_free(kvlm_model *model);
const kvlm_config *kvlm_model_config(const kvlm_model *model);
/* Bytes of weights (as stored). */
size_t kvlm_model_weight_bytes(const kvlm_model *model);
/* The path it was loaded from (a file or a directory), as given to kvlm_model_load. */
const char *kvlm_model_path(const kvlm_model *model);
/* A one-line description ("llama, 5 layers, dim 64, ... f32"). */
void kvlm_model_describe(const kvlm_model *model, char *buf, size_t cap);

/* Writes the model (weights, hyper-parameters, tokenizer) as GGUF v3.
 * type: a GGUF type id for the 2-D weights, or -1 to keep each tensor's type.
 * Norms and biases stay F32. */
int kvlm_model_save_gguf(const kvlm_model *model, const char *path, int type, kvlm_error *err);
/* The same, reporting to progress_callback (NULL: none) as the weights are
 * converted and written (kvlm convert's progress); its false stops it with
 * KVLM_ECANCELED, leaving no file at path. */
int kvlm_model_save_gguf_progress(const kvlm_model *model, const char *path, int type,
                                  kvlm_progress_callback progress_callback, void *progress_callback_user_data,
                                  kvlm_error *err);
/* Type id for "f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k", "q2_k", "iq4_xs", ... (docs/weights.md), or -1. */
int kvlm_type_from_name(const char *name);
const char *kvlm_type_name(int type);

/* Random-weight models of any shape, written as GGUF with a small
 * SentencePiece-style vocabulary: they cost exactly what a real model of the
 * same shape costs to run, for tests and benchmarks. */
typedef struct kvlm_synth_params {
    kvlm_arch arch;
    int dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, n_ctx;
    int head_dim;       /* 0: dim / n_heads */
    float rope_base;    /* 0: 10000 */
    int type;           /* GGUF type id of the 2-D weights */
    bool tied_output;
    uint64_t seed;
    const char *chat_template; /* tokenizer.chat_template to store (NULL: none) */
    /* deepseek2: latent ranks (q_lora_rank 0: attn_q), RoPE part of a key
     * (0: 16), value length (0: head_dim - rope_dim), experts (n_expert 0:
     * 4, used 0: 2, shared 0: 1, expert_ff 0: hidden_dim / 2), leading dense
     * layers (0: 1); expert_gating 2: V3's sigmoid with a selection bias */
    int q_lora_rank, kv_lora_rank, rope_dim, v_head_dim;
    int n_expert, n_expert_used, n_expert_shared, n_dense_lead, expert_ff, expert_gating;
    float yarn_factor;  /* > 1 writes YaRN keys (original context n_ctx / factor; deepseek2: log multiplier 0.0707;
                         * llama, qwen2: betas 32 and 1) */
    float rope_llama3;  /* > 1: Llama 3.1's RoPE scaling by this factor (rope_freqs.weight; low and high frequency
                         * factors 1 and 4, original context n_ctx / factor); not for deepseek2 */
    float rope_linear;  /* > 0: linear RoPE scaling keys (rope.scaling.type linear, this factor); not for deepseek2 */
    float longrope;     /* > 1: phi3's LongRoPE (rope_factors_long/short.weight: long factors rising to FACTOR, short
                         * ones near 1; original context n_ctx / FACTOR; attention factor sqrt(1 + ln F / ln orig)) */
    int sliding_window;        /* llama: every layer local (0: none); gemma2/3: 0 means 16 */
    float attn_softcap, final_softcap; /* gemma2: 0 means 50 and 30 (negative: none) */
    /* {arch}.pooling_type to write: KVLM_POOLING_* + 1 (0: none written; bert and nomic-bert
     * write their default, mean, when 0). bert and nomic-bert get a WordPiece vocabulary
     * (tokenizer.ggml.model "bert": [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103
     * when the vocabulary has room, then letters, digits, punctuation and letter pieces,
     * each as a word's start and as a continuation) */
    int pooling_plus1;
    /* making the weights, converting them to type and writing the file
     * (kvlm_progress_callback; NULL: none; false: KVLM_ECANCELED, no file) */
    kvlm_progress_callback progress_callback;
    void *progress_callback_user_data;
} kvlm_synth_params;
int kvlm_model_synth(const kvlm_synth_params *params, const char *path, kvlm_error *err);

/* Listing a model file (for `kvlm inspect`). */
typedef struct kvlm_tensor_info {
    const char *name;
    int type;
    int n_dims;
    int64_t ne[4];
    uint64_t offset;
    size_t nbytes;
} kvlm_tensor_info;
int kvlm_model_n_meta(const kvlm_model *model);
/* Key and printable value of metadata entry i; false if out of range. */
bool kvlm_model_meta(const kvlm_model *model, int i, char *key, size_t key_cap, char *val, size_t val_cap);
int kvlm_model_n_tensors(const kvlm_model *model);
bool kvlm_model_tensor(const kvlm_model *model, int i, kvlm_tensor_info *info);

/* ---- tokens ------------------------------------------------------------ */
int kvlm_vocab_size(const kvlm_model *model);
int32_t kvlm_token_bos(const kvlm_model *model); /* -1 if none */
int32_t kvlm_token_eos(const kvlm_model *model); /* -1 if none */
bool kvlm_token_is_eog(const kvlm_model *model, int32_t token);
/* Whether the model's metadata asks for BOS at the start of a prompt. */
bool kvlm_add_bos(const kvlm_model *model);
/* ... and for EOS at its end (tokenizer.ggml.add_eos_token; e.g. Qwen3-Embedding's
 * files): what kvlm_embed_tokenize follows, not the completion endpoints. */
bool kvlm_add_eos(const kvlm_model *model);
/* Encodes text. Returns the number of tokens (which may exceed max_tokens:
 * then only the first max_tokens are written), or -1 with err filled.
 * parse_special: recognise special tokens such as "<|im_start|>" in text.
 * A WordPiece vocabulary (tokenizer.ggml.model "bert"): add_bos puts [CLS]
 * first and [SEP] last, as BERT's tokenizers do. */
int kvlm_tokenize(const kvlm_model *model, const char *text, size_t len, bool add_bos,
                  bool parse_special, int32_t *tokens, int max_tokens, kvlm_error *err);
/* Text of one token (spaces and byte tokens decoded; control tokens give "").
 * Returns the byte count (may be a partial UTF-8 sequence), or -1. */
int kvlm_token_to_text(const kvlm_model *model, int32_t token, char *buf, size_t cap);
/* The same, but a control token gives its own text ("</s>", "<|im_end|>") when
 * special is true (vLLM's skip_special_tokens false). */
int kvlm_token_to_piece(const kvlm_model *model, int32_t token, bool special, char *buf, size_t cap);
/* Fill-in-the-middle tokens (KVLM_FIM_*): GGUF's tokenizer.ggml.fim_pre_token_id,
 * fim_suf_token_id, fim_mid_token_id (or the older prefix/suffix/middle ids),
 * else the token whose text is one llama.cpp looks for (<|fim_prefix|>,
 * <fim-prefix>, <PRE>, DeepSeek's; the same for suffix and middle); -1 if none.
 * A FIM prompt is [BOS] PRE prefix SUF suffix MID, the text to fill following. */
enum { KVLM_FIM_PRE = 0, KVLM_FIM_SUF = 1, KVLM_FIM_MID = 2 };
int32_t kvlm_token_fim(const kvlm_model *model, int which);
/* The pre-tokenizer's chunks of text (what byte-level BPE merges within):
 * ends[i] is the byte offset where chunk i ends; the chunks cover the text in
 * order. pre names a tokenizer.ggml.pre pre-tokenizer ("llama-bpe",
 * "qwen2", ...; model may then be NULL); NULL uses the model's (the whole
 * text is one chunk for a SentencePiece vocabulary). Returns the number of
 * chunks (only the first max are written), or -1 with err filled (an unknown
 * name: the message lists the known ones). */
int kvlm_pretokenize(const kvlm_model *model, const char *pre, const char *text, size_t len, size_t *ends,
                     int max, kvlm_error *err);

/* Streaming detokenizer: emits only whole UTF-8 sequences, and drops the
 * leading space SentencePiece adds to the first word (after BOS, or at the
 * first token pushed when the tokenizer adds that space): decoding what
 * kvlm_tokenize made of a text gives the text back, with or without BOS.
 * Set prev to the last token already shown to continue a text. */
typedef struct kvlm_detok {
    const kvlm_model *model;
    char pending[8];
    int n_pending;
    int32_t prev;
    bool special;      /* control tokens give their text (kvlm_token_to_piece); kvlm_detok_init: false */
} kvlm_detok;
void kvlm_detok_init(kvlm_detok *d, const kvlm_model *model);
/* Appends the text of token to out (NUL-terminated); returns bytes written. */
int kvlm_detok_push(kvlm_detok *d, int32_t token, char *out, size_t cap);
/* Flushes a dangling partial sequence as U+FFFD. */
int kvlm_detok_flush(kvlm_detok *d, char *out, size_t cap);

/* A stretch of a text whose token ids are known: text[offset, offset + len)
 * as ids[0, n_ids), e.g. an answer the model generated, sent back inside a
 * conversation. at: set by kvlm_tokenize_spans. */
typedef struct kvlm_token_span {
    size_t offset, len;
    const int32_t *ids;
    int n_ids;
    int at;             /* out: where its ids begin in the tokens; -1: not taken */
} kvlm_token_span;
/* Encodes text as kvlm_tokenize does, except that each span whose ids spell
 * its bytes exactly is taken as those ids, unchanged. "Spell" is checked, not
 * assumed: the ids, run through kvlm_detok from the token before them (prev)
 * and flushed, give exactly the span's bytes (an answer's text is made so).
 * The text between taken spans is encoded piece by piece, each piece alone
 * (no token crosses a taken span's edge); a piece after a span gets no
 * SentencePiece space prefix, since it continues the text. So the tokens
 * decode to the text, and the tokens of text[0, offset) are those of that
 * prefix encoded alone with the same spans: what the prefix cache needs when
 * the prefix is the prompt the span's ids were generated after. A span not
 * taken (at = -1: its ids do not spell it, or it is empty) is encoded with
 * the text around it; with none taken the result is kvlm_tokenize's. Spans
 * must be in order, not overlapping, inside the text, with ids inside the
 * vocabulary. Returns the token count (only the first max_tokens are
 * written) or -1 with err filled. */
int kvlm_tokenize_spans(const kvlm_model *model, const char *text, size_t len, bool add_bos, bool parse_special,
                        kvlm_token_span *spans, int n_spans, int32_t *tokens, int max_tokens, kvlm_error *err);

/* ---- contexts: the KV cache and the forward pass ----------------------- */
typedef struct kvlm_ctx kvlm_ctx;

typedef struct kvlm_ctx_params {
    int n_ctx;          /* most tokens one sequence may hold; 0: the model's trained context */
    int n_threads;      /* 0: one per core */
    bool no_kv_cache;   /* recompute the whole sequence for every token (reference/baseline;
                           batches must then hold one sequence) */
    int n_batch;        /* most tokens per internal forward chunk; 0: min(n_ctx, 512) */
    int n_seq_max;      /* sequences held at once (ids 0..n_seq_max-1); 0: 1 */
    int block_size;     /* tokens per KV block; 0: 16. block_size = n_ctx is the contiguous layout */
    size_t kv_mem;      /* KV cache budget in bytes; 0: room for n_seq_max full contexts */
    int kv_blocks;      /* or an exact block count (overrides kv_mem) */
    bool no_prefix_cache; /* do not index full blocks for reuse by later sequences */
    int cache_type_k;   /* element type of cached keys (KVLM_CACHE_*; kvlm_ctx_default_params: f16) */
    int cache_type_v;   /* ... and of values (any but q4_kc) */
    /* Bounded caches (see KVLM_EVICT_*): a sequence keeps at most kv_budget
     * tokens; when the next batch would exceed it, kv_evict picks what goes. */
    int kv_budget;      /* 0: n_ctx; at most n_ctx */
    int kv_evict;       /* KVLM_EVICT_*; 0: none (a batch past the budget fails with KVLM_ERANGE) */
    int kv_sinks;       /* sinks: first tokens always kept; 0: 4 */
    int h2o_recent;     /* h2o: most recent tokens kept; 0: the budget less the heavy hitters */
    float h2o_heavy;    /* h2o: share of the kept tokens chosen by accumulated attention
                           (when h2o_recent is 0); 0: 0.5 */
    int device;         /* KVLM_DEVICE_*: where the weights, the KV cache and the forward pass live */
    /* KV tiers below the pool (docs/kv-tiers.md). Cached blocks about to be
     * dropped from the pool go to host memory and disk; full blocks go to
     * Redis as they are committed (other processes use them); a prefix that
     * misses in the pool is looked up there, in that order, checked, and
     * brought back. kvlm_ctx_free first writes to disk what it lacks. */
    uint64_t kv_host_size; /* bytes of the host-memory tier (like llama.cpp's --cache-ram); 0: none */
    const char *kv_disk;   /* directory of the disk tier; NULL: none */
    uint64_t kv_disk_size; /* its cap in bytes; 0: 20 GiB */
    const char *kv_redis;  /* "redis://[USER:PASSWORD@]HOST:PORT[/DB]" or
                              "redis-cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]"; rediss:// and
                              rediss-cluster:// over TLS; NULL: none */
    const char *kv_redis_password; /* AUTH password (NULL: the URL's, if any) */
    const char *kv_redis_tls_ca, *kv_redis_tls_cert, *kv_redis_tls_key; /* rediss://: PEM files of the CA to
                              verify the server against (NULL: the system's store), and of a client
                              certificate and its key (NULL: none; key NULL: in the certificate's file) */
    /* The deployment's block-signing key (a secret shared by every process
     * using the same tiers, at least 16 bytes): blocks written to the tiers
     * and to session files are signed with HMAC-SHA-256 under it, and blocks
     * read back are used only if their signature verifies, so whoever can
     * write to the disk folder or the Redis server cannot make this process
     * compute with bytes of their choosing (docs/kv-tiers.md, "Trust").
     * NULL: blocks carry a checksum against accidental damage only. The
     * bytes are copied at kvlm_ctx_create. */
    const void *kv_mac_key;
    size_t kv_mac_key_len; /* at least KVLM_KV_MAC_KEY_MIN */
    /* Swap space: preempted sequences' blocks moved to host memory outside
     * the pool (kvlm_seq_swap_out), allocated at the first swap. */
    uint64_t kv_swap_size; /* its bytes; 0: the pool's size */
    bool no_kv_swap;       /* none: preemption always recomputes */
    /* Sequences the pool keeps for a draft model's context (kvlm_ctx_create_draft),
     * after this context's own; without kv_mem or kv_blocks the pool is sized
     * for them too. 0: none. */
    int n_seq_draft;
    /* The draft model they are for, when known: without kv_mem or kv_blocks
     * their room is sized for its cache (fewer blocks for a smaller one, more
     * for a larger one) rather than the model's. NULL: the model's. */
    const struct kvlm_model *draft_model;
} kvlm_ctx_params;

#define KVLM_KV_MAC_KEY_MIN 16

/* Devices. CUDA (a build with -DKVLM_CUDA=ON and an NVIDIA GPU): the weights
 * are uploaded once in their GGUF types, the KV pool's blocks live in GPU
 * memory (same block tables, prefix reuse and copy-on-write), and every
 * kernel of the forward pass runs there; cache types f32, f16, bf16, q8_0,
 * q4_0; no eviction policy (compaction runs on the CPU). */
enum { KVLM_DEVICE_CPU = 0, KVLM_DEVICE_CUDA = 1 };
/* Device id for "cpu", "cuda", or -1; and back (NULL if none). */
int kvlm_device_from_name(const char *name);
const char *kvlm_device_name(int device);
/* CUDA GPUs this build can use (0 when built without CUDA or none is seen). */
int kvlm_cuda_device_count(void);
/* A line on where the context computes ("cpu: AVX-512 VNNI, 2 threads",
 * "cuda: NVIDIA H100 80GB HBM3, 132 SMs, ..."). */
void kvlm_ctx_describe_device(const kvlm_ctx *ctx, char *buf, size_t cap);

/* Eviction policies. Evicting keeps tokens in order and compacts them: a
 * token's RoPE position is its place in the cache, not in the text
 * (StreamingLLM), so a stream can run past the trained context; moved keys are
 * re-rotated. The cache is cut by at least a block (block_size tokens) at a
 * time so the cost is amortised: it then holds between budget - block_size and
 * budget tokens (or budget - n_new when a batch brings more).
 *   window: the most recent tokens;
 *   sinks:  the first kv_sinks tokens (attention sinks) and the most recent;
 *   h2o:    the most recent and the heavy hitters: tokens with the largest
 *           attention accumulated over steps, layers and query heads (the
 *           attention kernel then also computes those weights).
 * Blocks shared with other sequences are copied, never changed in place; an
 * evicted sequence's blocks are no longer offered for prefix reuse. Under a
 * policy other than none, kvlm_batch.pos must be NULL. */
enum { KVLM_EVICT_NONE = 0, KVLM_EVICT_WINDOW = 1, KVLM_EVICT_SINKS = 2, KVLM_EVICT_H2O = 3 };
/* Policy id for "none", "window", "sinks", "h2o", or -1; and back (NULL if none). */
int kvlm_evict_from_name(const char *name);
const char *kvlm_evict_name(int policy);

/* KV cache element types. The per-token ones quantize each token's row per
 * KV head: q8_0 / q4_0 in groups of 32 (GGUF's blocks) when head_dim is a
 * multiple of 32, else one group (one f16 scale) per row. q4_kc (keys only,
 * KIVI-style): 4-bit codes per channel over each block's tokens, with an f16
 * scale and min per channel and block; the block still filling stays in f16
 * (one staging block per sequence) until it is full. */
enum {
    KVLM_CACHE_F32 = 0,
    KVLM_CACHE_F16 = 1,
    KVLM_CACHE_Q4_0 = 2,
    KVLM_CACHE_Q8_0 = 8,
    KVLM_CACHE_BF16 = 30,
    KVLM_CACHE_Q4_KC = 64,
};
/* Type id for "f32", "f16", "bf16", "q8_0", "q4_0", "q4_kc", or -1. */
int kvlm_cache_type_from_name(const char *name);
/* Name of a cache type id, or NULL if it is none. */
const char *kvlm_cache_type_name(int type);
/* The cache type ids, in the table's order, into ids (up to cap of them);
 * returns how many there are. */
int kvlm_cache_types(int *ids, int cap);
/* Whether a cache type can hold values (all but q4_kc, which is for keys). */
bool kvlm_cache_type_for_values(int type);
/* The key type a draft model's cache keeps beside a model whose keys are of
 * this type (itself, but q8_0 for q4_kc: a draft's rows are taken back across
 * blocks); -1 if type is none. kvlm_ctx_create_draft applies it; give it to a
 * draft context of its own too. */
int kvlm_cache_type_draft(int type);
/* Bytes one cached element takes, exactly, for a head dimension and block
 * size (e.g. q8_0 at head_dim 64: 34/32; at head_dim 8: 10/8); 0 if the type
 * is unknown. */
double kvlm_cache_type_elem_bytes(int type, int head_dim, int block_size);

kvlm_ctx_params kvlm_ctx_default_params(void);
kvlm_ctx *kvlm_ctx_create(const kvlm_model *model, const kvlm_ctx_params *params, kvlm_error *err);
void kvlm_ctx_free(kvlm_ctx *ctx);
int kvlm_ctx_n_ctx(const kvlm_ctx *ctx);
/* The most tokens a sequence keeps (kv_budget, or n_ctx). */
int kvlm_ctx_kv_budget(const kvlm_ctx *ctx);
/* The eviction policy (KVLM_EVICT_*), and the most tokens one batch may add
 * to one sequence under it (budget - sinks under sinks, else the budget). */
int kvlm_ctx_kv_evict(const kvlm_ctx *ctx);
int kvlm_ctx_kv_max_feed(const kvlm_ctx *ctx);
int kvlm_ctx_n_seq_max(const kvlm_ctx *ctx);
/* The id of the context's first sequence: 0, but for a draft context
 * (kvlm_ctx_create_draft), whose ids follow its model's context's in their
 * shared pool. Its ids are first .. first + n_seq_max - 1. */
int kvlm_ctx_seq_first(const kvlm_ctx *ctx);
/* A context for a draft model (speculative decoding) whose KV cache is the
 * model's pool: target was created with n_seq_draft > 0, and the draft
 * context's n_seq_draft sequences are the pool's ids after target's
 * (kvlm_ctx_seq_first). Its blocks come from, and count in, the one pool;
 * its block keys chain from the draft model's fingerprint, so neither model
 * ever reuses the other's blocks (in the pool, its prefix index or the
 * tiers). It takes target's context, block size and cache types (but
 * q8_0 keys where target's are q4_kc: drafts are taken back across blocks);
 * from params only threads and batch. A draft model of another cache shape
 * (other layers, KV heads or head dimension) or other types has the pool's
 * blocks laid out for it: a smaller cache per token holds the most whole
 * multiples of the model's block size that fit, a larger one the most
 * tokens that fit (kvlm_kv_stats_get on the draft context gives it; one of
 * its tokens must fit in a block). Its blocks go to the
 * context's tiers as the model's do, in their own stored form; freeing the
 * draft context writes its cached blocks to the disk tier. The draft context
 * never evicts, whatever target does (a kvlm_spec or scheduler drafts from a
 * window of the text past its context). target must be on the CPU; a
 * sliding-window or latent (deepseek2) target takes only a draft of its
 * cache shape and windows or latent rows (kvlm_draft_shares_pool).
 * One draft context per target; free it first. */
kvlm_ctx *kvlm_ctx_create_draft(const kvlm_model *draft, kvlm_ctx *target, const kvlm_ctx_params *params,
                                kvlm_error *err);
/* Whether kvlm_ctx_create_draft would take draft for a context of target
 * made with target_params: a cache of which one token fits in one of the
 * model's blocks, and the conditions above. */
bool kvlm_draft_shares_pool(const kvlm_model *target, const kvlm_model *draft, const kvlm_ctx_params *target_params);
const kvlm_model *kvlm_ctx_model(const kvlm_ctx *ctx);

/* A batch of tokens for one forward pass, possibly of several sequences.
 * Token i belongs to sequence seq[i] (seq NULL: all sequence 0) at position
 * pos[i] (pos NULL: the positions continue each sequence; if given they must
 * equal that). logits[i] asks for the logits after token i (logits NULL: the
 * last token of the batch only): any value but 0 and KVLM_OUTPUT_EMBD.
 * KVLM_OUTPUT_EMBD asks for the hidden state after it instead, what
 * embeddings are pooled from (kvlm_get_embeddings): the final norm's output
 * of a decoder, the last layer's of an encoder; KVLM_OUTPUT_BOTH for both. A
 * batch whose tokens ask for no logits computes none (the output projection,
 * the vocabulary-wide product, is skipped). An encoder gives no logits
 * (KVLM_EINVAL; logits NULL asks for some) and takes each of its sequences whole in one
 * batch, adjacent, from position 0; nothing is kept after it (kvlm_embed).
 * Hidden states: on the CPU, not for deepseek2. */
enum { KVLM_OUTPUT_LOGITS = 1, KVLM_OUTPUT_EMBD = 2, KVLM_OUTPUT_BOTH = 3 };
typedef struct kvlm_batch {
    int n_tokens;
    const int32_t *tokens;
    const int32_t *pos;
    const int8_t *logits;
    const int32_t *seq;
} kvlm_batch;

/* Runs the tokens through the model, appending their keys and values to the
 * cache. Returns KVLM_OK, or a status with err filled (nothing is appended). */
int kvlm_decode(kvlm_ctx *ctx, const kvlm_batch *batch, kvlm_error *err);
/* Logits after the i-th token of the last batch that asked for them
 * (i counts only the tokens that asked; -1: the last one). NULL if none. */
const float *kvlm_get_logits(kvlm_ctx *ctx, int i);
/* The hidden state (dim floats) after the i-th token of the last batch that
 * asked for them (i counts only the tokens that did, KVLM_OUTPUT_EMBD or
 * BOTH; -1: the last). NULL if none. */
const float *kvlm_get_embeddings(kvlm_ctx *ctx, int i);
/* Tokens in the cache of sequence 0 (kvlm_seq_n_past for others). */
int kvlm_ctx_n_past(const kvlm_ctx *ctx);
/* Ends every sequence (start afresh); cached prefix blocks stay reusable. */
void kvlm_ctx_reset(kvlm_ctx *ctx);
/* Bytes of keys and values the sequences hold:
 * layers x KV heads x head dim x (K + V bytes per element) x tokens
 * (with one type for both: 2 x layers x KV heads x head dim x bytes x tokens). */
size_t kvlm_ctx_kv_bytes(const kvlm_ctx *ctx);
/* Bytes of the whole block pool, plus q4_kc's per-sequence f16 staging. */
size_t kvlm_ctx_kv_capacity_bytes(const kvlm_ctx *ctx);

/* ---- sequences in the paged KV cache ---------------------------------------- */
int kvlm_seq_n_past(const kvlm_ctx *ctx, int seq);
/* Tokens evicted from the sequence's cache since it started (n_past + this =
 * tokens it has been fed). */
long kvlm_seq_n_evicted(const kvlm_ctx *ctx, int seq);
/* Ends a sequence: its blocks return to the pool (full ones stay indexed,
 * reusable by a later prompt, until the pool needs them). */
void kvlm_seq_free(kvlm_ctx *ctx, int seq);
/* dst becomes a copy of src sharing all its blocks (copy-on-write). */
int kvlm_seq_fork(kvlm_ctx *ctx, int src, int dst, kvlm_error *err);
/* For an empty sequence about to be given `tokens` as its prompt: takes the
 * longest run of cached full blocks that match, so prefill starts after
 * them. Returns how many leading tokens are now in the cache (< n). */
int kvlm_seq_reuse_prefix(kvlm_ctx *ctx, int seq, const int32_t *tokens, int n);

/* Blocks in a sequence's table, and how many of them other sequences share. */
void kvlm_seq_kv_info(const kvlm_ctx *ctx, int seq, int *n_blocks, int *n_shared);

/* Admission without side effects: what kvlm_seq_reuse_prefix(tokens,
 * n_lookup) would find for an empty sequence, and whether the cache then has
 * room for it to hold n_hold tokens. Nothing is attached, counted or moved. */
typedef struct kvlm_prefix_probe {
    int cached_tokens;     /* leading tokens the cache holds (a multiple of the block size) */
    int ram_tokens;        /* of which in the pool's RAM blocks */
    int tier_tokens[4];    /* then in each tier, in kvlm_kv_tier_stats_get's order */
    int blocks_needed;     /* blocks to allocate for n_hold tokens after those */
    int blocks_available;  /* blocks reservations could take then (free + cached, less the matched ones) */
} kvlm_prefix_probe;
void kvlm_seq_probe_prefix(const kvlm_ctx *ctx, const int32_t *tokens, int n_lookup, int n_hold,
                           kvlm_prefix_probe *out);
/* Blocks sequence seq still needs to hold n_hold tokens (0 if it has them). */
int kvlm_seq_blocks_needed(const kvlm_ctx *ctx, int seq, int n_hold);

/* Swap (preemption without recompute): a sequence's cache moved out of the
 * pool to the swap space and back, bytes unchanged, so a resumed sequence
 * computes exactly what it would have. Works for any storage (GPU blocks go
 * through the host) and for sequences that evicted (whose cache a recompute
 * could not rebuild). */
typedef struct kvlm_swap kvlm_swap;
/* Bytes swapping the sequence out moves, and whether the swap space has room. */
size_t kvlm_seq_swap_bytes(const kvlm_ctx *ctx, int seq);
bool kvlm_seq_swap_fits(const kvlm_ctx *ctx, int seq);
/* Moves the sequence out (it is then empty): to the swap space, or when
 * that is full to the disk tier if there is one; KVLM_EFULL when neither
 * takes it (nothing changes). */
int kvlm_seq_swap_out(kvlm_ctx *ctx, int seq, kvlm_swap **out, kvlm_error *err);
/* Brings it back into an empty sequence and frees h; KVLM_EFULL when the
 * pool lacks the blocks (h stays valid); KVLM_EIO when the swap space was
 * full, h went to the disk tier and a block of it was lost or damaged there
 * (h is freed: recompute the sequence). */
int kvlm_seq_swap_in(kvlm_ctx *ctx, int seq, kvlm_swap *h, kvlm_error *err);
/* Frees a handle that will not be swapped in. */
void kvlm_swap_free(kvlm_ctx *ctx, kvlm_swap *h);
/* Blocks swapping h in takes. */
int kvlm_swap_blocks(const kvlm_swap *h);
/* What preemption weighs (docs/kv-tiers.md, "Preemption: swap or
 * recompute"): bytes per second of a round trip of block bytes to the host
 * (measured once, at the first call), and tokens per second the forward pass
 * has computed so far (0 before any). */
void kvlm_ctx_preempt_rates(kvlm_ctx *ctx, double *copy_bytes_per_s, double *tokens_per_s);

typedef struct kvlm_kv_stats {
    int block_size, n_blocks;
    int used, cached, free;  /* used: held by sequences; cached: kept for prefix reuse */
    int shared;              /* blocks held by more than one sequence */
    uint64_t prefix_hits, prefix_misses, evictions; /* per block */
    size_t block_bytes, bytes_per_token;
    uint64_t tokens_computed; /* tokens run through the model (prefix reuse skips some) */
    int type_k, type_v;      /* element types (KVLM_CACHE_*) */
    size_t stage_bytes;      /* q4_kc keys: f16 staging of each sequence's filling block, all sequences */
    uint64_t swap_slots, swap_used; /* the swap space and what swapped-out sequences hold, in blocks */
    uint64_t swap_tier_used;  /* blocks swapped out to the disk tier (the swap space was full) */
    uint64_t swap_tier_out, swap_tier_lost; /* sequences swapped there; swap-ins that found a block lost or damaged */
} kvlm_kv_stats;
void kvlm_kv_stats_get(const kvlm_ctx *ctx, kvlm_kv_stats *st);

/* One KV tier (host, disk, redis) as this process sees it. */
#define KVLM_MAX_KV_TIERS 4
typedef struct kvlm_kv_tier_stats {
    char name[16];
    uint64_t blocks, bytes;         /* held now */
    uint64_t hits, misses;          /* blocks asked for on prefix misses in the pool */
    uint64_t writes, write_bytes;   /* blocks written */
    uint64_t dropped_writes;        /* writes dropped: queue full, tier down or full */
    uint64_t corrupt;               /* blocks that failed their checks on reading (recomputed) */
    uint64_t forged;                /* blocks whose signature failed (kv_mac_key set; recomputed) */
    uint64_t errors;                /* I/O or connection errors */
    uint64_t evicted;               /* blocks the tier removed to stay within its size */
    uint64_t reads;                 /* batched reads */
    double read_seconds;            /* their summed latency */
    uint64_t promoted, demoted;     /* blocks this context brought back / sent down */
    uint64_t written_through, persisted; /* committed blocks written through; written at a clean stop */
    bool up;
} kvlm_kv_tier_stats;
/* The context's tiers in lookup order; returns how many (at most cap written).
 * Safe from any thread for the tiers' own figures; promoted, demoted,
 * written_through and persisted are the engine thread's (kvlm_sched_stats
 * carries a consistent snapshot). */
int kvlm_kv_tier_stats_get(const kvlm_ctx *ctx, kvlm_kv_tier_stats *out, int cap);
/* Writes every cached block that the disk tier lacks there and waits for the
 * tiers' queues (kvlm_ctx_free does it too). */
void kvlm_ctx_kv_persist(kvlm_ctx *ctx);

/* KV events (docs/kv-events.md): the prefix index's and the host tier's
 * changes as they happen, for a publisher that tells routers which blocks
 * this engine holds (the server's --kv-events). STORED: a full block entered
 * the index, or the tier (its tokens are valid during the call only);
 * REMOVED: it left it (reused for other data, changed by eviction, pushed out
 * of the tier). Every stored block is removed at most once from each medium;
 * kvlm_ctx_free drops the rest without events. Called on the thread that
 * changes the cache (the engine thread), so the sink must not block. */
enum { KVLM_KV_EVENT_STORED = 1, KVLM_KV_EVENT_REMOVED = 2 };
/* Where the block is: the pool (the prefix index), or the host-memory tier
 * below it (--kv-host-size; the one tier this process alone fills and
 * empties). Each medium's events stand alone: a block in both is stored, and
 * later removed, once in each. */
enum { KVLM_KV_MEDIUM_POOL = 0, KVLM_KV_MEDIUM_HOST = 1 };
typedef struct kvlm_kv_event {
    int kind;                /* KVLM_KV_EVENT_* */
    uint8_t hash[16];        /* the block's chained key (XXH3-128, canonical big-endian bytes) */
    uint8_t parent[16];      /* STORED: the previous block's key (all zero when has_parent is false) */
    bool has_parent;         /* false: the first block of a sequence */
    const int32_t *tokens;   /* STORED: its n_tokens (the block size) tokens */
    int n_tokens;
    int medium;              /* KVLM_KV_MEDIUM_* */
} kvlm_kv_event;
typedef struct kvlm_kv_event_sink {
    void (*event)(void *user, const kvlm_kv_event *ev);
    void (*flush)(void *user); /* may be NULL: kvlm_ctx_kv_events_flush, a batch boundary */
    void *user;
} kvlm_kv_event_sink;
/* Installs the sink (copied; NULL or no event function: none). Not while
 * another thread uses the context. */
void kvlm_ctx_set_kv_event_sink(kvlm_ctx *ctx, const kvlm_kv_event_sink *sink);
/* Calls the sink's flush: the events since the last call form one batch
 * (kvlm_sched calls it after every step). */
void kvlm_ctx_kv_events_flush(kvlm_ctx *ctx);
/* The keys of the blocks the prefix index holds now, in block order: returns
 * how many (at most cap written), -1 out of memory. The thread that uses the
 * context only (a server: kvlm_sched_kv_blocks). */
int kvlm_kv_cached_blocks(kvlm_ctx *ctx, uint8_t (*keys)[16], int cap);
/* The same for the host tier: the keys of the blocks it holds that its
 * events told (its swapped sequences' blocks are not); 0 without one. */
int kvlm_kv_host_blocks(kvlm_ctx *ctx, uint8_t (*keys)[16], int cap);
/* The device the context computes on (KVLM_DEVICE_*). */
int kvlm_ctx_device(const kvlm_ctx *ctx);

/* Sessions (like llama.cpp's --prompt-cache): a sequence's tokens and full
 * KV blocks saved to a file, each block in the tiers' checked format
 * (src/kv/session.h). kvlm_session_load, for an empty sequence about to take
 * tokens[0..n): attaches the saved blocks those tokens repeat (leaving one
 * token to compute) and returns how many tokens are now cached; a missing
 * file gives 0; a file of another model, cache type, block size or format
 * version gives a negative KVLM_E* code and a message. */
int kvlm_session_save(kvlm_ctx *ctx, int seq, const char *path, kvlm_error *err);
int kvlm_session_load(kvlm_ctx *ctx, int seq, const int32_t *tokens, int n, const char *path, kvlm_error *err);

/* Rollback, for speculative decoding (docs/speculative.md). After
 * kvlm_seq_spec_begin, the tokens a sequence is fed are unverified until
 * kvlm_seq_trim: blocks they reach are not offered for prefix reuse (no index
 * entry, no tier write-through) and, under h2o, their queries' attention is
 * kept apart. kvlm_seq_trim keeps the first n_keep tokens of the cache (at
 * least those fed before spec_begin) and takes back the rest: the block table
 * is cut, blocks return to the pool (shared ones lose a reference), the held
 * full blocks that remain are indexed, and h2o scores get the attention of
 * the kept tokens only, as if the others had never been fed (to float
 * rounding: sums regrouped). A sequence holding unverified tokens does not
 * evict (KVLM_ERANGE: trim first) and is not forked. Without spec_begin,
 * kvlm_seq_trim takes back any tail, except under h2o (KVLM_EINVAL), and
 * except, under a sliding window, to a length whose next query would see keys
 * in blocks the window already gave back (KVLM_EINVAL; 0 always works).
 * q4_kc keys: not back across a block boundary once the next block was
 * written (KVLM_EUNSUPPORTED). */
int kvlm_seq_spec_begin(kvlm_ctx *ctx, int seq, kvlm_error *err);
int kvlm_seq_trim(kvlm_ctx *ctx, int seq, int n_keep, kvlm_error *err);

/* ---- perplexity ---------------------------------------------------------------- */
/* As llama.cpp's perplexity tool computes it, so figures compare: the tokens
 * (of the whole text, BOS first where the model adds one) are cut into
 * consecutive chunks of n_ctx; each chunk's first token becomes BOS; each
 * token in the second half of a chunk is scored given everything before it
 * in the chunk. */
typedef struct kvlm_ppl_result {
    double ppl, ppl_stderr;   /* exp(mean NLL) and its standard error */
    int n_chunks, n_scored;
} kvlm_ppl_result;
/* on_chunk (may be NULL) is called after each chunk with the running PPL. */
int kvlm_perplexity(kvlm_ctx *ctx, const int32_t *tokens, int n_tokens, int n_chunks,
                    void (*on_chunk)(void *user, int chunk, double ppl), void *user, kvlm_ppl_result *out,
                    kvlm_error *err);

/* Streaming perplexity through a bounded cache: the tokens are fed one at a
 * time to sequence 0 (after a reset), each scored given what the cache holds
 * (under the context's eviction policy), and the NLL is averaged over
 * stretches of `stride` text positions: stretch_ppl[k] is the perplexity of
 * the tokens at positions [k * stride, (k + 1) * stride) (the first token is
 * not scored), (n_tokens + stride - 1) / stride entries. out->ppl covers all
 * scored tokens. With kv_evict none the context must hold the whole text. */
int kvlm_perplexity_stream(kvlm_ctx *ctx, const int32_t *tokens, int n_tokens, int stride, double *stretch_ppl,
                           kvlm_ppl_result *out, kvlm_error *err);

/* ---- memory planning ---------------------------------------------------------- */
typedef struct kvlm_plan_params {
    int n_ctx;          /* context per sequence; 0: the model's */
    int n_seq;          /* sequences at once; 0: 1 */
    size_t kv_mem;      /* budget for the KV cache; 0: n_seq full contexts */
    int block_size;     /* 0: 16 */
    int avg_tokens;     /* tokens a sequence holds on average; 0: n_ctx / 2 */
    double elem_bytes;  /* bytes per cached element, K and V averaged; 0: 4 (f32)
                           (kvlm_cache_type_elem_bytes gives it for a type) */
    uint64_t host_bytes, disk_bytes, redis_bytes; /* KV tiers' sizes (0: none) */
    int n_batch;        /* tokens one step adds at most (kvlm_ctx_params.n_batch); 0: the context's
                           default, n_ctx up to 512 (a sliding window's cap counts them) */
} kvlm_plan_params;
typedef struct kvlm_plan {
    int n_ctx, n_seq, block_size, avg_tokens, blocks_per_seq;
    size_t weight_bytes, bytes_per_token, bytes_per_seq, bytes_total, block_bytes, kv_mem;
    long fit_contiguous;      /* sequences of n_ctx that fit kv_mem, reserved contiguously */
    long fit_paged_full;      /* the same in blocks (sequences at full context) */
    long fit_contiguous_avg;  /* sequences holding avg_tokens: contiguous still reserves n_ctx */
    long fit_paged_avg;       /* ... paged takes only the blocks they fill */
    size_t stored_block_bytes; /* a block as the tiers store it (header, token ids, checksum) */
    uint64_t tokens_ram, tokens_host, tokens_disk, tokens_redis; /* cached tokens each level holds */
    /* deepseek2 (0 otherwise): the cache holds one latent row per token
     * (bytes_per_token = layers x (kv_lora_rank + rope_dim) x elem_bytes, the
     * keys' type); what full per-head keys and values of the same model
     * would take: layers x heads x (key length + value length) x elem_bytes */
    size_t mha_bytes_per_token;
    /* Sliding window (docs/sliding-window.md; 0: none): the local layers hold
     * at most local_cap_tokens tokens of a sequence (in whole blocks: its
     * window and one step of n_batch tokens, reserved before the blocks
     * before the window are released; the blocks the engine's pool keeps per
     * sequence, less its one spare for a copy-on-write), the global ones all
     * of them. */
    int window, n_local_layers, local_cap_tokens;
    size_t bytes_per_token_local, bytes_per_token_global; /* the two parts of bytes_per_token */
    size_t bytes_per_seq_window;   /* a sequence of n_ctx tokens as the windowed cache holds it */
    long fit_window_full;          /* sequences of n_ctx that fit kv_mem so */
    int n_batch;                   /* the step local_cap_tokens counts (kvlm_plan_params.n_batch) */
} kvlm_plan;
void kvlm_plan_memory(const kvlm_model *model, const kvlm_plan_params *params, kvlm_plan *out);

/* ---- structured output ------------------------------------------------- */
/* A grammar the sampler holds generated text to (docs/structured-output.md):
 * llama.cpp's GBNF (rules "name ::= alternatives"; "literals", [classes],
 * [^negated], ., groups, *, +, ?, {m,n}; # comments), over Unicode code
 * points, for one model's tokens. NULL with err filled (line and column) on
 * a malformed grammar, an undefined rule, left recursion, a rule that can
 * match no text, groups nested past KVLM_GRAMMAR_MAX_NESTING, or one past 1M
 * elements. A text that would put the matcher in more than 65,536 parse
 * stacks at once ends the grammar there (nothing more is allowed): an
 * ambiguity that would slow every step. */
typedef struct kvlm_grammar kvlm_grammar;
/* Nesting limits, each checked before the parser goes one level deeper (far
 * below what a thread's stack holds): GBNF groups within groups; a JSON
 * schema's subschemas within subschemas ($ref, properties, items, anyOf ...);
 * groups within groups of a schema's regular expression ("pattern"). */
#define KVLM_GRAMMAR_MAX_NESTING 256
#define KVLM_JSON_SCHEMA_MAX_DEPTH 64
#define KVLM_PATTERN_MAX_NESTING 64
/* What structured output is asked for with: GBNF text (rule root), a JSON
 * schema's text, or OpenAI's JSON mode (any object; the text is not read). */
enum { KVLM_GRAMMAR_GBNF, KVLM_GRAMMAR_JSON_SCHEMA, KVLM_GRAMMAR_JSON_OBJECT };
/* The one way from what a request or a command line gives to a grammar
 * (kvlm serve, run and chat all use it): a schema through
 * kvlm_json_schema_to_gbnf, then the GBNF compiled. model NULL: checked and
 * compiled, no token mask (kvlm grammar). */
kvlm_grammar *kvlm_grammar_build(const kvlm_model *model, int kind, const char *text, kvlm_error *err);
/* root: the rule to start from (NULL: "root"). */
kvlm_grammar *kvlm_grammar_from_gbnf(const kvlm_model *model, const char *gbnf, const char *root, kvlm_error *err);
/* The GBNF text g was compiled from (a schema's translation), owned by g. */
const char *kvlm_grammar_gbnf(const kvlm_grammar *g);
/* A lazy grammar's trigger (llama.cpp's grammar_lazy, docs/tool-calls.md):
 * the text is free until one of the words appears in it; from there on, the
 * word included, it follows the grammar, whose start rule must begin with
 * the word (else KVLM_EINVAL). A word split across tokens counts, and so
 * does one in the middle of a token (the token's bytes after it must then
 * suit the grammar, or the token is not drawn). at_start: the word counts
 * only at the start of the text, after blanks alone (Llama 3's "{"). */
typedef struct kvlm_grammar_trigger {
    const char *word;
    bool at_start;
} kvlm_grammar_trigger;
#define KVLM_GRAMMAR_MAX_TRIGGERS 64
#define KVLM_GRAMMAR_MAX_TRIGGER_LEN 64
typedef struct kvlm_grammar_opts {
    const char *root;                     /* the start rule (NULL: "root") */
    const kvlm_grammar_trigger *triggers; /* n_triggers > 0: a lazy grammar */
    int n_triggers;
    /* special tokens' texts (<tool_call>, [TOOL_CALLS], <|channel|>) may be
     * drawn where the grammar writes them; else those tokens are never
     * drawn under the grammar (JSON mode and schemas: off) */
    bool special;
} kvlm_grammar_opts;
/* kvlm_grammar_from_gbnf with options (opts NULL: none); KVLM_EINVAL for a
 * trigger that is empty, longer than KVLM_GRAMMAR_MAX_TRIGGER_LEN bytes or
 * not how the grammar begins, or more than KVLM_GRAMMAR_MAX_TRIGGERS. */
kvlm_grammar *kvlm_grammar_compile(const kvlm_model *model, const char *gbnf, const kvlm_grammar_opts *opts,
                                   kvlm_error *err);
/* Whether g waits for a trigger (a lazy grammar). */
bool kvlm_grammar_is_lazy(const kvlm_grammar *g);
/* A JSON schema's text as GBNF (malloc'd; free it): OpenAI's response_format
 * json_schema. Supported: type (and lists of types), properties in their
 * order with required, additionalProperties (false beside properties; a
 * schema for a map without them), items, prefixItems, minItems, maxItems,
 * minLength, maxLength, pattern (ECMA-262 without lookaround or
 * back-references), enum, const, anyOf, oneOf (as anyOf), allOf of one,
 * local $ref (recursive through an object or array; a $ref that comes back
 * to itself with neither between is refused), number and integer bounds,
 * multipleOf (docs/structured-output.md), formats date, time, date-time and
 * uuid; other constraining keywords (uniqueItems, not, ...) are refused by
 * name. {"type": "object"} is OpenAI's JSON mode (any object). */
char *kvlm_json_schema_to_gbnf(const char *schema, kvlm_error *err);
/* kvlm_grammar_build(model, KVLM_GRAMMAR_JSON_SCHEMA, schema, err) */
kvlm_grammar *kvlm_grammar_from_json_schema(const kvlm_model *model, const char *schema, kvlm_error *err);
void kvlm_grammar_free(kvlm_grammar *grammar);

/* ---- sampling ---------------------------------------------------------- */
/* The stages of a sampler, for kvlm_sampler_params.stages (llama.cpp's
 * names and letters: kvlm_sampler_stage_from_name). */
enum { KVLM_STAGE_PENALTIES = 1, KVLM_STAGE_DRY, KVLM_STAGE_TOP_K, KVLM_STAGE_TYPICAL_P, KVLM_STAGE_TOP_P,
       KVLM_STAGE_MIN_P, KVLM_STAGE_XTC, KVLM_STAGE_TEMPERATURE };
#define KVLM_MAX_STAGES 16
/* llama.cpp's names: "penalties", "dry", "top_k", "typ_p", "top_p", "min_p",
 * "xtc", "temperature", and its other spellings ("top-k", "typical_p",
 * "typical", "nucleus", "temp", ...) -> KVLM_STAGE_*, or 0; and back. */
int kvlm_sampler_stage_from_name(const char *name);
const char *kvlm_sampler_stage_name(int stage);
/* llama.cpp's letters (--sampling-seq, a server's "samplers" string): e
 * penalties, d dry, k top_k, y typ_p, p top_p, m min_p, x xtc, t temperature
 * -> KVLM_STAGE_*, or 0. */
int kvlm_sampler_stage_from_char(char c);

typedef struct kvlm_sampler_params {
    float temperature;    /* <= 0: greedy */
    int top_k;            /* <= 0: off */
    float top_p;          /* >= 1: off */
    float min_p;          /* <= 0: off */
    float repeat_penalty; /* 1: off */
    int repeat_last_n;    /* how many recent tokens the penalty looks at */
    uint64_t seed;
    /* OpenAI's penalties over the tokens this sampler picked (not the prompt):
     * logit -= frequency_penalty * count + presence_penalty * (count > 0). 0: off */
    float frequency_penalty, presence_penalty;
    /* OpenAI's logit_bias (llama.cpp's --logit-bias): bias[i] is added to the
     * logit of token bias_ids[i] before anything else (-INFINITY bans it); ids
     * outside the vocabulary are ignored. kvlm_sampler_create copies them. */
    const int32_t *bias_ids;
    const float *bias;
    int n_bias;
    /* Structured output: the tokens drawn are held to this grammar (made for
     * the model whose tokens are drawn); once it is complete, end-of-generation
     * tokens are allowed, and only they once nothing may follow. The sampler
     * holds a reference: the caller may free its own after creating it. NULL:
     * free text. */
    const struct kvlm_grammar *grammar;
    /* vLLM's repetition_penalty, over every token of the prompt (what
     * kvlm_sampler_accept was given) and of the output: a positive logit is
     * divided by it, a negative one multiplied. Unlike repeat_penalty
     * (llama.cpp's: the last repeat_last_n tokens only). 1 (or <= 0): off */
    float repetition_penalty;
    /* llama.cpp's locally typical sampling: the tokens whose surprise is
     * closest to the distribution's entropy, until their mass passes
     * typical_p. >= 1 (or <= 0): off */
    float typical_p;
    /* llama.cpp's DRY ("don't repeat yourself"): a token that would extend a
     * run of at least dry_allowed_length tokens repeating an earlier run (in
     * the last dry_penalty_last_n tokens given or picked; -1: all of them, up
     * to 65,536) loses dry_multiplier * dry_base^(run - dry_allowed_length)
     * from its logit. A run does not reach back past a sequence breaker: a
     * token whose text contains one of dry_sequence_breakers (NULL: llama.cpp's
     * "\n", ":", "\"", "*"; needs model). dry_multiplier 0 (or dry_base < 1): off */
    float dry_multiplier, dry_base;
    int dry_allowed_length, dry_penalty_last_n;
    const char *const *dry_sequence_breakers;
    int n_dry_sequence_breakers;
    /* llama.cpp's XTC ("exclude top choices"): with probability
     * xtc_probability (a draw from the sampler's stream), every token at or
     * above xtc_threshold probability but the least likely of them is
     * removed (when at least two are). 0: off; a threshold above 0.5: off */
    float xtc_probability, xtc_threshold;
    /* The order of the stages (KVLM_STAGE_*, llama.cpp's --samplers); a
     * stage not listed does not run. n_stages 0: kvlm's order, penalties ->
     * dry -> top_k -> typical_p -> temperature -> top_p -> min_p -> xtc
     * (temperature before top_p and min_p, as vLLM and OpenAI do; llama.cpp's
     * default puts it last). Logit biases, the bans below and the grammar
     * come first whatever the order; greedy (temperature <= 0) takes the
     * largest logit after the penalties and DRY. */
    int stages[KVLM_MAX_STAGES];
    int n_stages;
    /* vLLM's min_tokens: end-of-generation tokens and stop_ids are banned
     * until this many tokens have been picked (needs model). 0: none */
    int min_tokens;
    /* End-of-generation tokens banned for the whole text (vLLM's ignore_eos,
     * llama.cpp's --ignore-eos; needs model) */
    bool ignore_eos;
    /* vLLM's stop_token_ids: tokens that end a completion once picked (the
     * scheduler gives the token, then ends it with finish STOP); the sampler
     * bans them before min_tokens. Copied by kvlm_sampler_create and
     * kvlm_sched_submit. */
    const int32_t *stop_ids;
    int n_stop_ids;
    /* The model whose tokens are drawn: its end-of-generation tokens
     * (ignore_eos, min_tokens) and token texts (DRY's breakers). NULL:
     * those have no effect (the scheduler sets its model's). */
    const struct kvlm_model *model;
} kvlm_sampler_params;

typedef struct kvlm_sampler kvlm_sampler;
kvlm_sampler_params kvlm_sampler_default_params(void);
/* The fields kvlm_sampler_params_check names (0: all within their ranges). */
enum {
    KVLM_SAMPLER_OK, KVLM_SAMPLER_TEMPERATURE, KVLM_SAMPLER_TOP_K, KVLM_SAMPLER_TOP_P, KVLM_SAMPLER_MIN_P,
    KVLM_SAMPLER_REPEAT_PENALTY, KVLM_SAMPLER_REPEAT_LAST_N, KVLM_SAMPLER_FREQUENCY_PENALTY,
    KVLM_SAMPLER_PRESENCE_PENALTY, KVLM_SAMPLER_BIAS_ID, KVLM_SAMPLER_BIAS, KVLM_SAMPLER_REPETITION_PENALTY,
    KVLM_SAMPLER_TYPICAL_P, KVLM_SAMPLER_DRY_MULTIPLIER, KVLM_SAMPLER_DRY_BASE, KVLM_SAMPLER_DRY_ALLOWED_LENGTH,
    KVLM_SAMPLER_DRY_PENALTY_LAST_N, KVLM_SAMPLER_XTC_PROBABILITY, KVLM_SAMPLER_XTC_THRESHOLD,
    KVLM_SAMPLER_MIN_TOKENS, KVLM_SAMPLER_STAGES, KVLM_SAMPLER_STOP_ID
};
/* The one check of sampling values, for kvlm serve's requests and kvlm run's
 * and chat's options alike: temperature 0..2, top_k -1..1e9, top_p and min_p
 * 0..1, repeat_penalty 0..100, repeat_last_n 0..65536, the frequency and
 * presence penalties -2..2, a logit bias -100..100 or -INFINITY (a ban), a
 * bias's token id 0 or more (and below vocab_size when it is above 0),
 * repetition_penalty 0..100 (0: off), typical_p 0..1, dry_multiplier 0..100,
 * dry_base 0..100 (below 1: off), dry_allowed_length 0..65536,
 * dry_penalty_last_n -1..1e9, xtc_probability and xtc_threshold 0..1,
 * min_tokens 0 or more, stages among KVLM_STAGE_* (at most KVLM_MAX_STAGES),
 * stop ids as bias ids (*index: which). Returns
 * the first field outside its range (KVLM_SAMPLER_*), or 0. err->msg says
 * what it must be without naming it ("must be between 0 and 1"), for each
 * caller to put its user's name for it first ('top_p' in a request, --top-p on
 * a command line); *index (if given): which bias, for the last two. */
int kvlm_sampler_params_check(const kvlm_sampler_params *p, int vocab_size, int *index, kvlm_error *err);
/* A token id written as text, as OpenAI's logit_bias keys are (and -l's):
 * decimal digits only, no sign, blank or leading zero, below 2^31. The id, or
 * -1 when s[0, n) is anything else. */
int kvlm_parse_token_id(const char *s, size_t n);
kvlm_sampler *kvlm_sampler_create(const kvlm_sampler_params *params, int vocab_size);
void kvlm_sampler_free(kvlm_sampler *s);
/* Picks the next token from logits (not modified); records it for the penalty. */
int32_t kvlm_sampler_sample(kvlm_sampler *s, const float *logits);
/* Records a token (e.g. of the prompt) for the repetition penalties and DRY. */
void kvlm_sampler_accept(kvlm_sampler *s, int32_t token);
/* Whether token is one of params.stop_ids (it ends a completion). */
bool kvlm_sampler_is_stop(const kvlm_sampler *s, int32_t token);

/* ---- speculative decoding ---------------------------------------------- */
/* Several tokens per read of the weights (docs/speculative.md): drafts are
 * guessed cheaply, then the target checks them all in one batch (the token
 * it had picked plus K drafts, logits for each) and keeps the longest run it
 * agrees with, by the rule that keeps its distribution: greedy, a draft is
 * kept while it equals the target's pick; sampling, a draft d (proposed with
 * certainty: q is a point mass) is kept with probability p(d), and on the
 * first rejection the next token is drawn from p with d taken out,
 * renormalised (the standard rejection scheme, min(1, p/q) and
 * norm(max(0, p - q)), for that q). Rejected tokens are taken back from the
 * cache (kvlm_seq_trim). Under eviction, or near the context's end, a step
 * drafts only what fits without evicting, so the cache evolves exactly as
 * without speculation.
 *   lookup: the draft continues the latest earlier occurrence of the last n
 *           tokens (n from ngram_max down to ngram_min) in the prompt and
 *           the text so far; no second model.
 *   draft:  a second model with the same vocabulary proposes K tokens
 *           greedily in its own context (a kvlm_ctx of its own: the pool's
 *           blocks have one model's layout), rolled back with the target. */
enum { KVLM_SPEC_NONE = 0, KVLM_SPEC_LOOKUP = 1, KVLM_SPEC_DRAFT = 2 };
typedef struct kvlm_spec_params {
    int mode;            /* KVLM_SPEC_* */
    int n_draft;         /* K, most drafts per step; 0: 8 (lookup), 4 (draft). A step drafts
                            fewer after rejections: halved when none was kept, doubled
                            (up to K) when all were */
    int ngram_max, ngram_min; /* lookup; 0: 3 and 1 */
    kvlm_ctx *draft_ctx; /* draft: the draft model's context (same sequence id; not owned) */
    float p_min;         /* draft: a step's drafts end before a token the draft model gives less than
                            this probability (its likeliest; 0: never; llama.cpp's --draft-p-min) */
    int n_min;           /* fewer drafts than this are not checked (a plain step instead), and a step
                            drafts at least this many where it drafts; 0: any; above n_draft: n_draft
                            (llama.cpp's --draft-min) */
} kvlm_spec_params;
typedef struct kvlm_spec kvlm_spec;
typedef struct kvlm_spec_stats {
    uint64_t steps;      /* verification passes (or plain steps when nothing was drafted) */
    uint64_t drafted;    /* draft tokens checked */
    uint64_t accepted;   /* of them kept */
    uint64_t emitted;    /* tokens given out (accepted + one per step) */
    uint64_t draft_windows; /* a draft context that does not evict: times its sequence started afresh on
                               the text's last half context (the text outgrew it) */
} kvlm_spec_stats;
/* Mode id for "none", "lookup", "draft", or -1. */
int kvlm_spec_mode_from_name(const char *name);
/* Speculation for sequence seq of ctx, which has just been fed its prompt
 * prompt[0..n) (the logits of its last token are the context's last,
 * kvlm_get_logits(ctx, -1)). Draft mode: checks the draft model's vocabulary
 * (size and every token's text: KVLM_EINVAL naming the first difference) and
 * feeds it the prompt. */
kvlm_spec *kvlm_spec_create(kvlm_ctx *ctx, int seq, const int32_t *prompt, int n, const kvlm_spec_params *p,
                            kvlm_error *err);
void kvlm_spec_free(kvlm_spec *sp);
/* One step: the next tokens of the text, at least one, at most n_draft + 1
 * (out holds cap >= n_draft + 1): the first was picked by smp from the
 * target's logits, the others are drafts the target kept; they are in the
 * cache when it returns, and the token after them is already chosen (and
 * recorded by smp) for the next call to give out first. An end-of-generation
 * first token is given out alone and not fed, and so is the first token when
 * the cache is full (kv_evict none: n_past at the budget). Returns the count, or -1 with
 * err filled (the sequence keeps the tokens given out before). */
int kvlm_spec_next(kvlm_spec *sp, kvlm_sampler *smp, int32_t *out, int cap, kvlm_error *err);
void kvlm_spec_stats_get(const kvlm_spec *sp, kvlm_spec_stats *st);

/* ---- embeddings ---------------------------------------------------------- */
/* Vectors for retrieval (docs/embeddings.md): the hidden states of an input's
 * tokens (KVLM_OUTPUT_EMBD), pooled into one vector by the model's rule and
 * L2-normalised (OpenAI's and vLLM's vectors are unit length). Decoder
 * models used as embedders (Qwen3-Embedding, e5-mistral: causal attention,
 * the last token's state) and encoders (bert, nomic-bert). Pooling values
 * are llama.cpp's ({arch}.pooling_type): NONE gives one vector per token,
 * MEAN their average, CLS the first token's, LAST the last token's; RANK (a
 * reranker's classification head) is refused (KVLM_EUNSUPPORTED). */
enum { KVLM_POOLING_UNSPECIFIED = -1, KVLM_POOLING_NONE = 0, KVLM_POOLING_MEAN = 1, KVLM_POOLING_CLS = 2,
       KVLM_POOLING_LAST = 3, KVLM_POOLING_RANK = 4 };
/* Pooling id for "none", "mean", "cls", "last", "rank", or -1; and back (NULL if none). */
int kvlm_pooling_from_name(const char *name);
const char *kvlm_pooling_name(int pooling);
/* The model's pooling: {arch}.pooling_type when its file has it; else LAST
 * for a decoder (its one token that saw the whole input) and CLS for an encoder. */
int kvlm_model_pooling(const kvlm_model *model);
/* Whether the model is an encoder (bert, nomic-bert): embeddings only, no generation. */
bool kvlm_model_is_encoder(const kvlm_model *model);

typedef struct kvlm_embed_params {
    int pooling;        /* KVLM_POOLING_*; UNSPECIFIED: the model's (kvlm_embed_default_params) */
    bool no_normalize;  /* the pooled vector as it is (llama-server's embd_normalize -1); default: unit length */
    /* 0: the model's width; 1..width: the vector's first dims values, normalised
     * after (OpenAI's "dimensions": Matryoshka truncation, meaningful for models
     * trained for it, such as Qwen3-Embedding and nomic-embed-text-v1.5) */
    int dims;
} kvlm_embed_params;
kvlm_embed_params kvlm_embed_default_params(void);
/* The length of each vector p gives (dims, or the model's width); -1 with
 * err filled when p asks for what the model cannot give (RANK, dims out of
 * range, an unknown pooling). */
int kvlm_embed_dims(const kvlm_model *model, const kvlm_embed_params *p, kvlm_error *err);
/* An input as embedding models take it (llama-server's rule): special tokens
 * in the text recognised, BOS and EOS where the vocabulary adds them
 * ([CLS] ... [SEP] for WordPiece). As kvlm_tokenize returns. */
int kvlm_embed_tokenize(const kvlm_model *model, const char *text, size_t len, int32_t *tokens, int max,
                        kvlm_error *err);
/* One input's embedding through sequence seq of ctx (empty on entry, and
 * empty again on return: its blocks go back to the pool, the full ones
 * indexed for prefix reuse as any prompt's): the tokens are fed in pieces of
 * at most the context's batch (an encoder's whole). out gets
 * kvlm_embed_dims floats (pooling NONE: n of them, one per token); returns
 * how many floats (at most cap written), or -1 with err filled (KVLM_ERANGE:
 * more tokens than the context holds). */
int kvlm_embed(kvlm_ctx *ctx, int seq, const int32_t *tokens, int n, const kvlm_embed_params *p, float *out,
               size_t cap, kvlm_error *err);

/* ---- chat: a conversation rendered through the model's own template ------- */
/* A model's chat format (docs/chat-templates.md): its own Jinja template
 * (GGUF tokenizer.chat_template, a Hugging Face directory's
 * tokenizer_config.json or chat_template.jinja), a named variant of it
 * (tokenizer.chat_template.NAME: "tool_use", taken by itself when a request
 * has tools), a template's text given by the caller (--chat-template-file),
 * or one of the built-in families (kvlm_chat_family_names: "chatml",
 * "llama3", ...) for files without a template. Rendering is Hugging Face's: the template sees
 * messages, tools, documents, add_generation_prompt, bos_token, eos_token and
 * the request's chat_template_kwargs. Read-only after creation: one kvlm_chat
 * may render from many threads at once. */
typedef struct kvlm_chat kvlm_chat;

typedef struct kvlm_chat_params {
    /* A built-in family ("chatml", ...), or the name of one of the model's
     * named templates; NULL: the model's own (or "plain" without one). */
    const char *template_name;
    /* A Jinja template's text: used instead of the model's (and of name). */
    const char *template_text;
    /* Where template_text came from, for messages ("FILE"); may be NULL. */
    const char *template_origin;
    /* How answers are read (docs/tool-calls.md): a tool-call parser's name
     * (NULL: picked from the template) and KVLM_REASONING_*. */
    const char *tool_parser;
    int reasoning_format;
} kvlm_chat_params;
enum { KVLM_REASONING_AUTO = 0, KVLM_REASONING_NONE = 1 };

/* KVLM_EINVAL naming the problem: an unknown name (the message lists the
 * families and the model's named templates), a template that does not parse
 * (the message says where). A model template kvlm cannot parse falls back
 * to the built-in family its markers show, with a warning; without one it
 * is an error. */
kvlm_chat *kvlm_chat_create(const kvlm_model *model, const kvlm_chat_params *params, kvlm_error *err);
void kvlm_chat_free(kvlm_chat *chat);
/* What renders: "the model's template", "the model's tool_use template",
 * "FILE", or a built-in family's name. */
const char *kvlm_chat_describe(const kvlm_chat *chat);
/* The built-in family's name, or "jinja". */
const char *kvlm_chat_family(const kvlm_chat *chat);
/* The built-in families, the one list the help texts, messages and docs
 * name: "chatml, llama2, ..., gpt-oss or plain" (static text). */
const char *kvlm_chat_family_names(void);
/* Renders a request, a JSON object (text) with the members of an OpenAI chat
 * request that a template sees: messages (required: objects with a string
 * role; content a string, null or an array of text parts; tool_calls,
 * tool_call_id, name, reasoning_content as clients send them), tools,
 * documents, add_generation_prompt (default true), continue_final_message
 * (default false: the last message is left open for the model to go on),
 * chat_template_kwargs (an object: more variables, e.g. enable_thinking).
 * Messages are given to the template as vLLM gives them: the developer role
 * as system unless the template names it, text parts joined with newlines
 * unless the template reads parts, a tool call's arguments string as the
 * object it holds. *prompt (malloc'd; *len its length) is to be tokenized
 * with special tokens recognised and kvlm_add_bos (a leading bos_token the
 * template wrote is left out when the tokenizer adds it). KVLM_EINVAL with
 * a message for a malformed request or a template error (raise_exception's
 * message, or what failed and where). */
int kvlm_chat_render(const kvlm_chat *chat, const char *request_json, char **prompt, size_t *len, kvlm_error *err);

/* ---- tool calls and reasoning in a chat model's answers (docs/tool-calls.md) ---- */
/* The syntax kvlm_chat reads answers with: a tool-call parser's name
 * ("hermes", "qwen3-coder", "llama3", "mistral", "deepseek-r1", "gpt-oss",
 * "kimi-k2", ...), picked from the template's markers as llama.cpp and vLLM
 * pick it ("generic" for a template without any: a bare JSON call), or the
 * one kvlm_chat_params.tool_parser named (an unknown name: kvlm_chat_create
 * fails with KVLM_EINVAL listing kvlm_chat_tool_parsers()). */
const char *kvlm_chat_tool_parser(const kvlm_chat *chat);
/* The names tool_parser takes ("generic, hermes, qwen3-coder, ..."); vLLM's
 * (--tool-call-parser qwen3_coder, llama3_json, openai, ...) are taken too. */
const char *kvlm_chat_tool_parsers(void);
/* A request's tools and tool_choice as OpenAI defines them (JSON texts; NULL:
 * absent): tools an array of {"type": "function", "function": {"name" (1 to
 * 64 of a-z, A-Z, 0-9, _, - and ., each once), "description"?,
 * "parameters"?: a JSON schema object}}; tool_choice "none", "auto",
 * "required" or {"type": "function", "function": {"name": one of the
 * tools}} ("required" and a named function need tools). KVLM_EINVAL with a
 * message naming the member at fault, *which (if not NULL) "tools" or
 * "tool_choice". */
int kvlm_chat_tools_check(const char *tools_json, const char *tool_choice_json, const char **which, kvlm_error *err);
/* The grammar that holds an answer's tool calls, for the sampler, for a
 * request rendered into prompt (its end says whether the template opened
 * the reasoning): tool_choice "required" or a named function: the answer is
 * the reasoning the family writes, then calls (one unless parallel) of those
 * tools, each one's arguments valid to its parameters' schema; "auto" (or
 * NULL) with tools: a lazy grammar, the text free until a call begins, the
 * call held from its first word on; "none", or no tools: *grammar NULL.
 * KVLM_EUNSUPPORTED for required or a named function in a syntax no grammar
 * here writes (gemma4, pythonic, lfm2: their calls are read all the same;
 * auto gives NULL there); KVLM_EINVAL for tools kvlm_chat_tools_check
 * refuses or a schema kvlm cannot hold to (the schema's message, naming the
 * tool). */
int kvlm_chat_tool_grammar(const kvlm_chat *chat, const char *prompt, size_t prompt_len, const char *tools_json,
                           const char *tool_choice_json, bool parallel, kvlm_grammar **grammar, kvlm_error *err);

/* Reads an answer as it is generated: its reasoning (reasoning_content), its
 * content and its tool calls, as OpenAI's (and vLLM's) chat.completion
 * message and chat.completion.chunk deltas give them. */
typedef struct kvlm_chat_reader kvlm_chat_reader;
/* prompt: the rendered prompt (only its end is kept: whether it opened the
 * reasoning). tools_json: the request's tools (NULL, or a tool_choice of
 * "none": no calls are read, reasoning only). id_seed: the calls' ids
 * ("call_" and 24 alphanumerics; 9 alphanumerics for Mistral's) are a
 * function of it and the call's index (ids the format writes itself, as
 * Kimi's functions.name:0, are kept): make it random per request. */
kvlm_chat_reader *kvlm_chat_reader_new(const kvlm_chat *chat, const char *prompt, size_t prompt_len,
                                       const char *tools_json, uint64_t id_seed, kvlm_error *err);
/* Appends generated text (tokens' texts with special tokens' texts:
 * kvlm_detok with special true). *delta: NULL when nothing new can be shown
 * yet, else a JSON object's text (malloc'd): {"content"?,
 * "reasoning_content"?, "tool_calls"?: [{"index", "id", "type", "function":
 * {"name", "arguments"}} for a call's first piece, {"index", "function":
 * {"arguments"}} for more of its arguments]}. What was shown is never taken
 * back: a marker's beginning, and arguments that may still change, wait. */
int kvlm_chat_reader_push(kvlm_chat_reader *r, const char *text, size_t len, char **delta, kvlm_error *err);
/* The text ended, with text[0, len) (may be empty): *delta what is new
 * since the last push (or NULL); *message (if not NULL) the whole answer
 * {"role": "assistant", "content" (null when there are calls and nothing
 * else), "reasoning_content"?, "tool_calls"?} (a call malformed or cut by
 * the end stays in content, as written). Returns the number of calls, or a
 * negative KVLM_E* code (err filled). */
int kvlm_chat_reader_end(kvlm_chat_reader *r, const char *text, size_t len, char **delta, char **message,
                         kvlm_error *err);
void kvlm_chat_reader_free(kvlm_chat_reader *r);

/* ---- Jinja templates ------------------------------------------------------ */
/* A model's own chat template (Hugging Face Jinja), rendered as transformers
 * renders it: Jinja2's ImmutableSandboxedEnvironment with trim_blocks and
 * lstrip_blocks, loop controls, tojson as json.dumps(ensure_ascii=False),
 * raise_exception(message) and strftime_now(format) (docs/chat-templates.md).
 * A template is parsed once and may be rendered from many threads at once. */
typedef struct kvlm_template kvlm_template;
/* NULL with err (KVLM_EINVAL, "line N: ...") for a syntax error, a construct
 * kvlm lacks or nesting past the parser's limit (200 levels). */
kvlm_template *kvlm_template_parse(const char *src, size_t len, kvlm_error *err);
void kvlm_template_free(kvlm_template *t);
/* vars_json: a JSON object (text) whose members are the variables (messages,
 * tools, add_generation_prompt, bos_token, ...; NULL or "": none). *out
 * (malloc'd, NUL-terminated, caller frees) is the text, *out_len its length.
 * A template error is KVLM_EINVAL with a message naming what and the line;
 * raise_exception's message comes as the template gave it. */
int kvlm_template_render(const kvlm_template *t, const char *vars_json, char **out, size_t *out_len, kvlm_error *err);
/* The limits of one render (0 in a field: its default) and the time
 * strftime_now reads (0: now). Past a limit the render fails naming it. */
typedef struct kvlm_template_opts {
    size_t max_output; /* bytes any one piece of text may reach (default 32 MiB) */
    long max_steps;    /* statements, loop iterations and calls (default 5,000,000) */
    int max_depth;     /* evaluator recursion: nested expressions, statements, macro calls (default 1000) */
    long now;          /* strftime_now's time in seconds since the epoch (0: the clock's) */
} kvlm_template_opts;
int kvlm_template_render_opts(const kvlm_template *t, const char *vars_json, const kvlm_template_opts *opts,
                              char **out, size_t *out_len, kvlm_error *err);
/* The model's template: tokenizer.chat_template (name NULL) or the named one,
 * tokenizer.chat_template.NAME (GGUF); a Hugging Face directory's from
 * tokenizer_config.json or chat_template.jinja. NULL if it has none. The text
 * lives as long as the model. */
const char *kvlm_model_chat_template(const kvlm_model *model, const char *name);
/* A token's text as the vocabulary stores it ("<|im_start|>", "</s>"; control
 * tokens too, unlike kvlm_token_to_text): what a template's bos_token and
 * eos_token are. NULL for an id out of range. Lives as long as the model. */
const char *kvlm_token_piece(const kvlm_model *model, int32_t token);

/* ---- the scheduler: many requests served from one context ------------------ */
/* Continuous batching over a kvlm_ctx: every step is one kvlm_decode over a
 * batch mixing one decode token of each running sequence and chunks of
 * prompts being prefilled, under a token budget. Requests are admitted first
 * come, first served when the pool has blocks for their prompt (after prefix
 * reuse); when a running sequence needs a block and none is free, the newest
 * one is preempted and re-queued: swapped (its blocks moved to the context's
 * swap space and back, kvlm_seq_swap_out / in) or recomputed later (blocks
 * freed, mostly found again in the prefix index), whichever the measured
 * rates make cheaper (docs/kv-tiers.md). Under an eviction policy (kvlm_ctx_kv_evict) a sequence is
 * not bounded by the context: it runs to max_tokens within the KV budget, its
 * blocks counted with the budget's as their cap, prompts fed in pieces of at
 * most kvlm_ctx_kv_max_feed tokens (a prompt longer than the budget too); a
 * sequence that has evicted is preempted only by swap (a recompute would not
 * rebuild its cache); without room in the swap space the newest that has not
 * evicted is, or if none is left the newest is ended (KV_FULL). submit, cancel, stats and requests may be called from any
 * thread; step/run from one engine thread, which also runs the callbacks. */
typedef struct kvlm_sched kvlm_sched;

typedef struct kvlm_sched_params {
    int batch_tokens;   /* most tokens per step; 0: 512 */
    int max_seqs;       /* sequences running at once; 0 or more than the context holds: its n_seq_max */
    /* Speculative decoding (docs/speculative.md): KVLM_SPEC_LOOKUP drafts up
     * to spec_n_draft tokens (0: 8; at most 16) by prompt lookup after each
     * running sequence's token, checked in the same step's batch; output as
     * without speculation (greedy: the same tokens). 0: none. */
    int spec_mode, spec_n_draft;
    /* KVLM_SPEC_DRAFT: the draft model's context (same vocabulary, no
     * eviction, no q4_kc keys, at least n_seq_max sequences; not owned; used
     * by the engine thread only). Its sequence ids mirror the context's: each
     * step it catches up on every decoding sequence's new tokens in one
     * batch, then drafts spec_n_draft tokens (0: 4) for all of them in one
     * batch per round (greedy), checked as lookup drafts are. */
    kvlm_ctx *draft_ctx;
    /* KVLM_SPEC_DRAFT: a sequence's drafts end before a token the draft
     * model gives less than this probability (its likeliest; 0: never;
     * llama.cpp's --draft-p-min) */
    float spec_p_min;
    /* Fewer drafts than this are not checked (the sequence decodes its token
     * alone), and a step drafts at least this many where it drafts (0: any;
     * above spec_n_draft: spec_n_draft; llama.cpp's --draft-min) */
    int spec_n_min;
} kvlm_sched_params;

typedef struct kvlm_request_params {
    kvlm_sampler_params sampling; /* completion i draws with seed + i */
    int max_tokens;     /* tokens to generate at most (> 0) */
    int n;              /* completions of the prompt (its blocks are forked); 0: 1 */
    int logprobs;       /* report the chosen token's log-probability and this many top alternatives (0..20); -1: none */
    /* vLLM's prompt_logprobs: an event (prompt_token true) for each prompt
     * token after the first with its log-probability given the tokens before
     * it and its prompt_top_logprobs (0..20) likeliest alternatives. The
     * prompt is then computed afresh, not taken from the prefix cache (as
     * vLLM does). */
    bool prompt_logprobs;
    int prompt_top_logprobs;
    /* Compute the prompt afresh: no prefix reuse at admission (llama-server's
     * cache_prompt false). Its blocks are still indexed for later requests. */
    bool no_prefix_reuse;
} kvlm_request_params;

/* KV_FULL: the KV pool could not hold the completion any longer (one sequence
 * alone outgrew it, nothing left to preempt); LENGTH: max_tokens, the context
 * or the KV budget reached. */
enum { KVLM_FINISH_NONE = 0, KVLM_FINISH_STOP, KVLM_FINISH_LENGTH, KVLM_FINISH_CANCELLED, KVLM_FINISH_ERROR,
       KVLM_FINISH_KV_FULL };
#define KVLM_MAX_LOGPROBS 20

/* One generated token of completion `index`, or (finish != NONE, token -1)
 * the end of that completion; every completion ends with exactly one such
 * event, after which its blocks are free. */
typedef struct kvlm_sched_event {
    uint64_t id;
    int index;
    int32_t token;
    int finish;          /* KVLM_FINISH_*: STOP = end-of-generation token */
    float logprob;       /* of token (when logprobs >= 0) */
    int rank;            /* ... and its rank among the vocabulary's (1: the likeliest) */
    int n_top;
    int32_t top_tokens[KVLM_MAX_LOGPROBS];
    float top_logprobs[KVLM_MAX_LOGPROBS];
    int prompt_tokens, cached_tokens; /* cached: prompt tokens found in the prefix index at admission */
    const char *error;   /* finish == ERROR: why */
    /* prompt_logprobs: this event is not a generated token but prompt token
     * pos (>= 1) of completion 0, token, with logprob and the alternatives */
    bool prompt_token;
    int pos;
    /* seconds from the submission to the request's first admission (0 before it) */
    double queue_time;
    /* an embedding request's final event (finish STOP): its vector, n_embd
     * floats (pooling NONE: prompt_tokens x the model's width), valid during
     * the callback only; NULL otherwise */
    const float *embedding;
    int n_embd;
} kvlm_sched_event;
/* Return false to end this completion now (e.g. a stop string was seen); its
 * final event then has finish STOP. */
typedef bool (*kvlm_sched_cb)(void *user, const kvlm_sched_event *ev);

kvlm_sched *kvlm_sched_create(kvlm_ctx *ctx, const kvlm_sched_params *params, kvlm_error *err);
/* Ends every request (CANCELLED events) and frees the scheduler, not the
 * context. Call it once run() has returned (kvlm_sched_stop, then join). */
void kvlm_sched_free(kvlm_sched *s);
/* Queues a request; returns its id (> 0), or 0 with err filled (e.g. a
 * prompt beyond the context or KV budget of a context that does not evict:
 * KVLM_ERANGE). The prompt is copied. */
uint64_t kvlm_sched_submit(kvlm_sched *s, const int32_t *prompt, int n_prompt, const kvlm_request_params *p,
                           kvlm_sched_cb cb, void *user, kvlm_error *err);
/* Queues one embedding request of n inputs (prompts[i], n_prompts[i] tokens
 * each; copied; p copied, NULL: kvlm_embed_default_params): each input is
 * run through the model and pooled into its vector, which its one final
 * event carries (event index i, finish STOP, embedding set; prompt_tokens
 * its own count); nothing is sampled. They run as n sequences at once where
 * slots and blocks allow, in steps shared with every other request's; a
 * sequence's blocks return to the pool at its end (full ones indexed for
 * prefix reuse, as any prompt's; a LAST-pooled input also reuses cached
 * ones: only its last token's state is needed, where the other poolings
 * need every token's).
 * Returns the request's id, or 0 with err filled (an empty input, one beyond
 * the context: KVLM_ERANGE; RANK pooling: KVLM_EUNSUPPORTED). An encoder's
 * context serves embedding requests only. */
uint64_t kvlm_sched_submit_embed(kvlm_sched *s, const int32_t *const *prompts, const int *n_prompts, int n,
                                 const kvlm_embed_params *p, kvlm_sched_cb cb, void *user, kvlm_error *err);
/* Ends a request: its completions get CANCELLED events and their blocks are
 * freed before the next step. Unknown or finished ids are ignored. */
void kvlm_sched_cancel(kvlm_sched *s, uint64_t id);
/* One engine step. Returns the requests still queued or running (0: idle). */
int kvlm_sched_step(kvlm_sched *s);
/* Steps until kvlm_sched_stop, sleeping while idle. */
void kvlm_sched_run(kvlm_sched *s);
void kvlm_sched_stop(kvlm_sched *s);

typedef struct kvlm_sched_stats {
    int running, waiting; /* running: holding KV blocks, prefilling ones included */
    uint64_t preemptions, steps, requests_done;
    /* preemptions = swaps_out + recomputes; swaps_in: resumed from the swap
     * space; swap_bytes: bytes moved out and back in */
    uint64_t swaps_out, swaps_in, recomputes, swap_bytes;
    uint64_t swaps_evicted;   /* swaps out of sequences that had evicted (no recompute could rebuild them) */
    uint64_t prompt_tokens, cached_tokens, generated_tokens;
    double tokens_per_second; /* generated, over the last seconds */
    kvlm_kv_stats kv;         /* as of the end of the last step */
    kvlm_kv_tier_stats tiers[KVLM_MAX_KV_TIERS];
    int n_tiers;
    uint64_t spec_drafted, spec_accepted; /* speculation: draft tokens checked, and kept */
    /* draft model: steps it proposed in, and failures of its context (pool
     * full, errors) that cost drafts (the step went on without them) */
    uint64_t spec_draft_steps, spec_draft_failures;
    /* a draft model sharing the pool: its sequences dropped to give the
     * model's sequences room (before any of them was preempted) */
    uint64_t spec_draft_released;
    /* draft model: its sequences started afresh on the text's last half
     * context, the text having outgrown the draft's (which does not evict) */
    uint64_t spec_draft_windows;
    /* a draft model sharing the pool: sequence-steps without drafts because
     * what the sequence's draft would hold did not fit beside the model's
     * next step (it drafts again once it fits) */
    uint64_t spec_draft_waits;
    /* embedding requests' inputs embedded (vectors given out), and their prompt tokens */
    uint64_t embeddings, embedding_tokens;
} kvlm_sched_stats;
void kvlm_sched_stats_get(kvlm_sched *s, kvlm_sched_stats *st);

/* The keys of the blocks in the prefix index (kvlm_kv_cached_blocks) as of
 * the end of the last step: returns how many (at most cap written), or -1
 * when none has been taken yet. The first call asks the engine thread to
 * take them after every step from then on (and once now, if it is idle):
 * call again shortly. Any thread. */
int kvlm_sched_kv_blocks(kvlm_sched *s, uint8_t (*keys)[16], int cap);
/* The host tier's (kvlm_kv_host_blocks), taken with them: how many there are
 * (at most cap written), -1 before kvlm_sched_kv_blocks has any. */
int kvlm_sched_kv_host_blocks(kvlm_sched *s, uint8_t (*keys)[16], int cap);

typedef struct kvlm_sched_req_info {
    uint64_t id;
    int state;           /* 0 waiting, 1 prefill, 2 running */
    int prompt_tokens, generated, cached_tokens;
    int blocks, shared_blocks; /* summed over its completions */
    /* prefill: tokens of the text to compute (the prompt, or after a
     * recompute the prompt and what it generated) already in the cache, of
     * prefill_total; both 0 when not in prefill */
    int prefill_done, prefill_total;
} kvlm_sched_req_info;
/* Live requests as of the last step's admission (before its forward pass:
 * a request being prefilled counts as running from then on, and in
 * kvlm_sched_stats) or its end; returns how many (at most cap written). */
int kvlm_sched_requests(kvlm_sched *s, kvlm_sched_req_info *out, int cap);

/* ---- the OpenAI-compatible HTTP server ------------------------------------- */
/* POST /v1/completions and /v1/chat/completions (streamed as server-sent
 * events or not; OpenAI's fields and those vLLM's and llama-server's clients
 * send, docs/serving.md), POST /v1/embeddings (with params.embeddings),
 * GET /v1/models and /v1/models/{id}, /health, /metrics (Prometheus: kvlm's
 * series and vLLM's), /kvlm/status (JSON) and the web page at /, over
 * libmicrohttpd; one engine thread runs a kvlm_sched over the context. It
 * logs through kvlm_log: a line per request, a throughput line while busy. */
typedef struct kvlm_server kvlm_server;
typedef struct kvlm_server_params {
    const char *host;          /* address to bind; NULL: 127.0.0.1 */
    int port;                  /* 0: any free port (kvlm_server_port tells which) */
    const char *model_id;      /* the id clients name; NULL: the model file's name without extension */
    /* How chat requests are rendered and read (not owned; it must outlive the
     * server); NULL: the server makes its own from chat_template (a built-in
     * family or one of the model's named templates; NULL: the model's own). */
    const kvlm_chat *chat;
    const char *chat_template;
    /* ... and how it reads answers (kvlm_chat_params): a tool-call parser's
     * name (NULL: the template's), KVLM_REASONING_* */
    const char *tool_parser;
    int reasoning_format;
    int batch_tokens, max_seqs; /* kvlm_sched_params */
    size_t max_body;           /* largest request body; 0: 1 MiB */
    int timeout_s;             /* idle or stalled connections are closed after this; 0: 30 */
    /* Against slow and idle clients: absolute deadlines a trickle of bytes does not reset. */
    int header_timeout_s;      /* a request's headers must be in this long after its connection opened
                                  (or the previous answer ended); 0: 10 */
    int body_timeout_s;        /* its body this long after its headers; 0: 30 */
    int send_timeout_s;        /* an answer must be written this long after the engine finished it (a
                                  client that stops reading, or reads a trickle, is cut off); 0: 60 */
    int max_conns;             /* connections at once; 0: 4096 (fewer when the fd limit is lower) */
    int max_conns_per_ip;      /* connections at once from one client address; 0: 256; < 0: no cap */
    /* Against other web pages and other users. */
    const char *api_key;       /* NULL: none; else `Authorization: Bearer KEY` on every endpoint but
                                  /health, the web page, CORS preflights and (unless metrics_auth) /metrics */
    bool metrics_auth;         /* /metrics needs the key too */
    const char *const *cors_origins; /* origins allowed cross-origin requests (exact match) */
    int n_cors_origins;
    const char *ssl_key_file, *ssl_cert_file; /* PEM; both set: HTTPS only */
    const char *ssl_min_version; /* "tls1.2" (NULL: the default) or "tls1.3": older versions are refused */
    /* While a request is silent this long (queued, in prefill, between tokens, or a whole answer not
     * ready yet), bytes that change nothing are sent: an SSE comment in a stream, whitespace before a
     * whole answer's JSON (its 200 then begins), so a balancer's inactivity timeout finds only hung
     * servers (docs/serving.md). Seconds; 0: 2; < 0: never. */
    double keepalive_s;
    /* KV events for prefix-aware routers (docs/kv-events.md): the prefix
     * index's changes in vLLM's format on a ZeroMQ PUB socket at this
     * endpoint, tcp://HOST:PORT or ipc://PATH: it listens when the host is
     * the wildcard star (or "::", or ipc), else connects to a subscriber that
     * listens (vLLM's rule); NULL: none. */
    const char *kv_events;
    const char *kv_events_topic; /* first frame of each message; NULL: "" (vLLM's default) */
    /* vLLM's replay socket (needs kv_events): a ROUTER bound at this
     * endpoint resends the last kv_events_buffer batches (0: 10,000, vLLM's
     * buffer_steps) from a sequence number on; NULL: none */
    const char *kv_events_replay;
    int kv_events_buffer;
    int spec_mode, spec_n_draft; /* kvlm_sched_params: speculative decoding (prompt lookup) */
    kvlm_ctx *draft_ctx;         /* kvlm_sched_params: the draft model's context (KVLM_SPEC_DRAFT; not owned) */
    float spec_p_min;            /* kvlm_sched_params: a draft ends before a token the draft model is less sure of */
    /* POST /v1/embeddings (docs/embeddings.md; llama-server's --embeddings): without it the
     * endpoint answers 501. An encoder model (bert, nomic-bert) needs it and serves nothing else. */
    bool embeddings;
    /* Memory for clients, in total over every connection (docs/serving.md, "Memory bounds per peer"). */
    size_t max_body_total;       /* request bodies being received or held; past it 503; 0: 64 MiB */
    size_t max_unsent;           /* answers made and not yet handed to the kernel (a stream's backlog, a whole
                                    answer); past it the connection holding most is reset; 0: 64 MiB */
    /* A request field the server does not use (top-level, or in stream_options) is ignored and logged once
     * per name, as vLLM does; strict_params: refused with a 400 (unknown_parameter) instead. */
    bool strict_params;
    /* Its log (through kvlm_log: one line per request at info, /health and /metrics at debug; a throughput
     * line every log_interval_s while busy, 0: 10, < 0: never): log_json makes each line a JSON object
     * ({"event": "request", ...}) for the log callback to pass on, else key=value text. */
    bool log_json;
    double log_interval_s;
    /* The token ids of recent chat answers, kept so that a conversation sent back as text is tokenized with
     * them and its earlier turns come from the prefix cache (docs/serving.md, "Conversations and the prefix
     * cache"): bytes, an LRU; 0: 16 MiB; < 0: none kept. */
    int64_t answer_ids_mem;
    int spec_n_min;              /* kvlm_sched_params: fewer drafts than this are not checked */
} kvlm_server_params;
kvlm_server *kvlm_server_start(kvlm_ctx *ctx, const kvlm_server_params *p, kvlm_error *err);
int kvlm_server_port(const kvlm_server *s);
/* Ends every request, stops the threads, frees the server (not the context). */
void kvlm_server_stop(kvlm_server *s);

#ifdef __cplusplus
}
#endif
#endif
