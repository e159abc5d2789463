/* engine/model_api: the public model and token API: loading (weights from
 * model/, tokenizer from tok/), listing, converting, and streaming text out. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "engine/grammar.h"
#include "kv/planner.h"
#include "dtype/dtype.h"
#include "model/model.h"
#include "model/hf.h"
#include "ops/ops.h"
#include "tok/pretok.h"
#include "tok/tok.h"
#include "util/log.h"
#include "util/error.h"
#include "util/file.h"
#include "util/mem.h"

/* The tensors only matmul reads: each layer's projections, its stacked
 * experts (engine/moe.c keeps an expert's rows packed when they are whole
 * groups) and the classifier (a tied classifier is packed apart from the
 * embedding rows it shares; a copied one is still the embedding's tensor,
 * which reads the copy). */
#define MATMUL_PER_LAYER 10
static int matmul_tensors(kvlm_model *m, model_tensor **out) {
    int n = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        model_layer *L = &m->layers[l];
        model_tensor *ts[MATMUL_PER_LAYER] = {&L->wq,     &L->wk,       &L->wv,     &L->wo,     &L->w_gate,
                                              &L->w_down, &L->w_up,     &L->gate_exps, &L->up_exps, &L->down_exps};
        for (int i = 0; i < MATMUL_PER_LAYER; i++) out[n++] = ts[i];
    }
    out[n++] = &m->output;
    return n;
}

/* Bytes of tensor t in the file, and in the buffer pack_weights copies it
 * to: its packed form (op_pack_type), or its rows as they are. */
static size_t file_bytes(const model_tensor *t) { return dt_row_size(t->type, (int)t->n_in) * (size_t)t->n_out; }
static size_t copy_bytes(const model_tensor *t) {
    return op_pack_type(t->type) >= 0 ? op_pack_size(t->type, (int)t->n_in, (int)t->n_out) : file_bytes(t);
}

/* Copies the matmul weights, once, into one buffer on transparent huge pages
 * (util_big_alloc): repacked into this CPU's fastest layout where the type
 * has one (op_pack_type), else their rows as they are (f32, f16, bf16: read
 * in place from the file's 4 KiB pages, every page is a TLB miss;
 * docs/weights.md). Every later
 * step reads the copy. The file's pages of an untied tensor are then dropped
 * from memory (they are clean pages of a read-only mapping, read back from
 * the file if anything asks), so the copy does not double the resident
 * weights (not when the file was read into memory, --no-mmap, where dropped
 * pages would read back as zeros, nor under --mlock). Out of memory, the
 * model reads the file's pages, which is only slower. This reads the whole
 * file once: most of a load's time, reported to the progress callback by
 * bytes read. KVLM_ECANCELED when it returns false (what was packed is
 * freed with the model). */
static int pack_weights(kvlm_model *m, const kvlm_model_params *p) {
    if (!m->layers) return KVLM_OK;
    model_tensor **ts = malloc(sizeof *ts * ((size_t)m->cfg.n_layers * MATMUL_PER_LAYER + 1));
    if (!ts) return KVLM_OK;
    int n = matmul_tensors(m, ts);
    size_t total = 0, in_total = 0, in_done = 0;
    for (int i = 0; i < n; i++)
        if (ts[i]->data) {
            total += (copy_bytes(ts[i]) + 63) & ~(size_t)63;
            in_total += file_bytes(ts[i]);
        }
    uint8_t *buf = total ? util_big_alloc(total, false) : NULL;
    if (!buf) { free(ts); return KVLM_OK; }
    m->packed_buf = buf;
    m->packed_bytes = total;
    if ((m->map_flags & UTIL_MAP_LOCK) && mlock(buf, total) != 0)
        LOG_WARN("%s: cannot lock the weights' %zu bytes in memory (raise ulimit -l); going on unlocked", m->path, total);
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        model_tensor *t = ts[i];
        if (!t->data) continue;
        /* (0.99 at most here: 1 is for the load's end) */
        if (p && p->progress_callback && !p->progress_callback(0.99f * (float)((double)in_done / (double)in_total),
                                                               p->progress_callback_user_data)) {
            free(ts);
            return KVLM_ECANCELED;
        }
        in_done += file_bytes(t);
        const void *file = t->data;
        bool tied = file == m->tok_embd.data, packed = op_pack_type(t->type) >= 0;
        if (packed) {
            op_pack(t->type, t->data, buf + off, (int)t->n_in, (int)t->n_out);
            t->packed = buf + off;
            t->packed_type = op_pack_type(t->type);
        } else {
            memcpy(buf + off, t->data, file_bytes(t));
            t->data = buf + off;
            if (tied) m->tok_embd.data = t->data; /* still the same tensor: the embedding rows read the copy */
        }
        if ((!tied || !packed) && !m->map_flags) { /* a packed tied classifier's embedding rows still read the file */
            uintptr_t lo = ((uintptr_t)file + page - 1) & ~(uintptr_t)(page - 1);
            uintptr_t hi = ((uintptr_t)file + file_bytes(t)) & ~(uintptr_t)(page - 1);
            if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
        }
        off += (copy_bytes(t) + 63) & ~(size_t)63;
    }
    free(ts);
    return KVLM_OK;
}

/* A pre-tokenizer given by its regexes (tokenizer.json) that kvlm knows
 * gets its name, so a converted GGUF says what llama.cpp expects. */
static void name_pre_regex(model_vocab *v) {
    char name[sizeof v->pre];
    if (!v->has_pre_regex ||
        !tok_pretok_find((const char *const *)v->pre_regex, v->n_pre_regex, name, sizeof name))
        return;
    tok_pretok *p = tok_pretok_create(name, NULL);
    bool same = p && tok_pretok_ignore_merges(p) == v->pre_ignore_merges;
    tok_pretok_free(p);
    if (!same) return; /* same regexes, other merge rule: keep the file's own */
    for (int i = 0; i < v->n_pre_regex; i++) free(v->pre_regex[i]);
    free(v->pre_regex);
    v->pre_regex = NULL;
    v->n_pre_regex = 0;
    v->has_pre_regex = false;
    snprintf(v->pre, sizeof v->pre, "%s", name);
}

kvlm_model *kvlm_model_load(const char *path, const kvlm_model_params *params, kvlm_error *err) {
    if (!path) { util_err_set(err, KVLM_EINVAL, "no model path given"); return NULL; }
    kvlm_model *m = malloc(sizeof *m);
    if (!m) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    kvlm_progress_callback progress = params ? params->progress_callback : NULL;
    void *user = params ? params->progress_callback_user_data : NULL;
    if (progress && !progress(0.0f, user)) {
        free(m);
        util_err_set(err, KVLM_ECANCELED, "%s: loading canceled by the progress callback", path);
        return NULL;
    }
    if (model_load(m, path, params, err)) { free(m); return NULL; }
    m->packed_buf = NULL;
    m->packed_bytes = 0;
    name_pre_regex(&m->vocab);
    if (pack_weights(m, params) == KVLM_ECANCELED) {
        kvlm_model_free(m);
        util_err_set(err, KVLM_ECANCELED, "%s: loading canceled by the progress callback", path);
        return NULL;
    }
    if (m->vocab.n_tokens > 0) {
        m->tok = tok_create(&m->vocab, err);
        if (!m->tok) {
            util_err_prefix(err, "%s", path);
            model_unload(m);
            free(m);
            return NULL;
        }
        /* Without tokenizer.ggml.add_bos_token, some pre-tokenizers (Llama 3,
         * Tekken, Chameleon) add BOS by default, as llama.cpp has it. */
        if (!m->vocab.add_bos_key && tok_default_add_bos(m->tok)) m->vocab.add_bos = true;
    }
    if (progress && !progress(1.0f, user)) { /* the load is done: a "no" here still cancels it, as asked */
        kvlm_model_free(m);
        util_err_set(err, KVLM_ECANCELED, "%s: loading canceled by the progress callback", path);
        return NULL;
    }
    return m;
}

void kvlm_model_free(kvlm_model *m) {
    if (!m) return;
    tok_free(m->tok);
    gm_vocab_free(m->grammar_vocab);
    util_big_free(m->packed_buf, m->packed_bytes);
    model_unload(m);
    free(m);
}

const kvlm_config *kvlm_model_config(const kvlm_model *m) { return &m->cfg; }
size_t kvlm_model_weight_bytes(const kvlm_model *m) { return m->weight_bytes; }
const char *kvlm_model_path(const kvlm_model *m) { return m->path; }

void kvlm_model_describe(const kvlm_model *m, char *buf, size_t cap) {
    const kvlm_config *c = &m->cfg;
    snprintf(buf, cap,
             "%s: %d layers, dim %d, %d heads (%d KV heads, head dim %d), FFN %d, vocab %d, context %d, "
             "weights %s, %.1f MiB",
             m->arch_name, c->n_layers, c->dim, c->n_heads, c->n_kv_heads, c->head_dim, c->hidden_dim,
             c->vocab_size, c->n_ctx_train, kvlm_type_name(c->weight_type), (double)m->weight_bytes / (1 << 20));
    size_t len = strlen(buf);
    if (c->arch == KVLM_ARCH_DEEPSEEK2 && len < cap) /* docs/mla.md */
        snprintf(buf + len, cap - len, "; MLA: latent %d + RoPE %d, value %d, q_lora %d; experts %d of %d "
                 "(+%d shared), %d dense layers", c->kv_lora_rank, c->rope_dim, c->v_head_dim, c->q_lora_rank,
                 c->n_expert_used, c->n_expert, c->n_expert_shared, c->n_dense_lead);
    len = strlen(buf);
    if ((c->embed_mult > 0 || c->residual_mult > 0 || c->logit_div > 0) && len < cap)
        snprintf(buf + len, cap - len, ", embeddings x%g, residual x%g, q.k x%g, logits / %g",
                 (double)(c->embed_mult > 0 ? c->embed_mult : 1), (double)(c->residual_mult > 0 ? c->residual_mult : 1),
                 (double)c->attn_scale, (double)(c->logit_div > 0 ? c->logit_div : 1));
    len = strlen(buf);
    if ((c->encoder || c->pooling >= 0) && len < cap)
        snprintf(buf + len, cap - len, "%s, pooling %s%s", c->encoder ? ", an encoder (bidirectional attention)" : "",
                 kvlm_pooling_name(kvlm_model_pooling(m)), c->pooling >= 0 ? "" : " (no pooling_type key)");
    len = strlen(buf);
    if (c->qk_norm_full && len < cap)
        snprintf(buf + len, cap - len, ", norms after attention and FFN, q and k normed across their heads");
    len = strlen(buf);
    if (c->no_rope_period > 0 && len < cap)
        snprintf(buf + len, cap - len, ", no RoPE in one layer of every %d", c->no_rope_period);
    len = strlen(buf);
    if (c->arch != KVLM_ARCH_DEEPSEEK2 && c->n_expert > 0 && len < cap)
        snprintf(buf + len, cap - len, ", experts %d of %d (%d wide)", c->n_expert_used, c->n_expert, c->expert_ff);
    len = strlen(buf);
    if (c->sliding_window > 0 && c->n_local_layers > 0 && len < cap)
        snprintf(buf + len, cap - len, ", sliding window %d on %d of %d layers", c->sliding_window, c->n_local_layers,
                 c->n_layers);
    len = strlen(buf);
    if (c->arch != KVLM_ARCH_DEEPSEEK2 && len < cap) { /* RoPE scaling (deepseek2's YaRN is in its MLA line) */
        if (c->yarn_factor > 0)
            snprintf(buf + len, cap - len, ", RoPE YaRN x%g from %d tokens", (double)c->yarn_factor, c->yarn_orig_ctx);
        else if (m->rope_freqs.data)
            snprintf(buf + len, cap - len, ", RoPE factors (rope_freqs: Llama 3.1's scaling)%s",
                     c->rope_linear > 0 ? " and linear" : "");
        else if (c->rope_linear > 0)
            snprintf(buf + len, cap - len, ", RoPE linear x%g", (double)c->rope_linear);
        else if (c->rope_freqs_short)
            snprintf(buf + len, cap - len, ", LongRoPE (long factors past %d tokens a sequence, attention factor %.4g)",
                     c->longrope_orig_ctx, (double)c->longrope_attn_factor);
    }
}

int kvlm_model_save_gguf(const kvlm_model *m, const char *path, int type, kvlm_error *err) {
    return kvlm_model_save_gguf_progress(m, path, type, NULL, NULL, err);
}

int kvlm_model_save_gguf_progress(const kvlm_model *m, const char *path, int type, kvlm_progress_callback cb,
                                  void *user, kvlm_error *err) {
    if (!m->layers) return util_err_set(err, KVLM_EINVAL, "the model has no weights to save");
    return model_save_gguf(m, path, type, cb, user, err);
}

int kvlm_model_synth(const kvlm_synth_params *p, const char *path, kvlm_error *err) {
    return model_synth_write(p, path, err);
}

int kvlm_type_from_name(const char *name) {
    int t = dt_from_name(name);
    return t == DT_Q8_K ? -1 : t;
}
const char *kvlm_type_name(int type) {
    const dt_traits *tr = dt_info(type);
    return tr ? tr->name : "?";
}

/* ---- listing --------------------------------------------------------------- */

int kvlm_model_n_meta(const kvlm_model *m) {
    if (m->gguf) return (int)m->gguf->n_kv;
    return m->map ? 7 : 0;
}

bool kvlm_model_meta(const kvlm_model *m, int i, char *key, size_t kcap, char *val, size_t vcap) {
    if (i < 0 || i >= kvlm_model_n_meta(m)) return false;
    if (m->gguf) {
        const gguf_kv *kv = &m->gguf->kv[i];
        snprintf(key, kcap, "%.*s", (int)(kv->key.len < 1000 ? kv->key.len : 1000), kv->key.data);
        gguf_kv_format(kv, val, vcap);
        return true;
    }
    static const char *names[7] = {"llama2c.dim", "llama2c.hidden_dim", "llama2c.n_layers", "llama2c.n_heads",
                                   "llama2c.n_kv_heads", "llama2c.vocab_size", "llama2c.seq_len"};
    int32_t h[7];
    memcpy(h, m->map, sizeof h);
    snprintf(key, kcap, "%s", names[i]);
    snprintf(val, vcap, "%d", h[i]);
    return true;
}

int kvlm_model_n_tensors(const kvlm_model *m) {
    if (m->gguf) return (int)m->gguf->n_tensors;
    if (m->hf) return model_hf_n_tensors(m);
    return m->layers ? 3 + 9 * m->cfg.n_layers - (m->output.data == m->tok_embd.data) : 0;
}

bool kvlm_model_tensor(const kvlm_model *m, int i, kvlm_tensor_info *info) {
    if (i < 0 || i >= kvlm_model_n_tensors(m)) return false;
    if (m->hf) return model_hf_tensor(m, i, info);
    memset(info, 0, sizeof *info);
    if (m->gguf) {
        const gguf_tensor *t = &m->gguf->tensors[i];
        info->name = t->cname;
        info->type = t->type;
        info->n_dims = t->n_dims;
        memcpy(info->ne, t->ne, sizeof info->ne);
        info->offset = t->offset;
        info->nbytes = t->nbytes;
        return true;
    }
    const model_tensor *t;
    if (i < 2) t = i == 0 ? &m->tok_embd : &m->output_norm;
    else if (i - 2 < 9 * m->cfg.n_layers) {
        const model_layer *L = &m->layers[(i - 2) % m->cfg.n_layers];
        const model_tensor *per[9] = {&L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo,
                                      &L->ffn_norm, &L->w_gate, &L->w_down, &L->w_up};
        t = per[(i - 2) / m->cfg.n_layers];
    } else t = &m->output;
    info->name = t->name;
    info->type = t->type;
    info->n_dims = t->n_out > 1 ? 2 : 1;
    info->ne[0] = t->n_in;
    info->ne[1] = t->n_out;
    info->ne[2] = info->ne[3] = 1;
    info->offset = (uint64_t)((const char *)t->data - (const char *)m->map);
    info->nbytes = (size_t)(t->n_in * t->n_out) * 4;
    return true;
}

/* ---- tokens ---------------------------------------------------------------- */

int kvlm_vocab_size(const kvlm_model *m) { return m->vocab.n_tokens; }
int32_t kvlm_token_bos(const kvlm_model *m) { return m->vocab.bos; }
int32_t kvlm_token_eos(const kvlm_model *m) { return m->vocab.eos; }
bool kvlm_add_bos(const kvlm_model *m) { return m->vocab.add_bos && m->vocab.bos >= 0; }
bool kvlm_add_eos(const kvlm_model *m) { return m->vocab.add_eos && m->vocab.eos >= 0; }
bool kvlm_token_is_eog(const kvlm_model *m, int32_t t) { return m->tok && tok_is_eog(m->tok, t); }

int kvlm_tokenize(const kvlm_model *m, const char *text, size_t len, bool add_bos, bool parse_special,
                  int32_t *tokens, int max_tokens, kvlm_error *err) {
    if (!m->tok) return util_err_set(err, KVLM_EINVAL, "%s has no tokenizer", m->path), -1;
    return tok_encode(m->tok, text, len, add_bos, parse_special, tokens, max_tokens, err);
}

typedef struct {
    const char *text;
    size_t *ends;
    int64_t max, n;
} pretok_ends;

static int pretok_end(void *ctx, const char *chunk, size_t n) {
    pretok_ends *c = ctx;
    if (c->n < c->max) c->ends[c->n] = (size_t)(chunk - c->text) + n;
    c->n++;
    return 0;
}

int kvlm_pretokenize(const kvlm_model *m, const char *pre, const char *text, size_t len, size_t *ends, int max,
                     kvlm_error *err) {
    if (!text && len) return util_err_set(err, KVLM_EINVAL, "kvlm_pretokenize: no text"), -1;
    if (len > (size_t)INT32_MAX) return util_err_set(err, KVLM_ERANGE, "kvlm_pretokenize: text of %zu bytes is too long", len), -1;
    if (!pre) {
        if (!m || !m->tok) return util_err_set(err, KVLM_EINVAL, "kvlm_pretokenize: no model tokenizer or pre-tokenizer name"), -1;
        /* Through the model's tokenizer: one call for the count, one to fill. */
        int n = tok_pretokenize(m->tok, text, len, NULL, 0, err);
        if (n <= 0 || !ends || max <= 0) return n;
        tok_span *sp = malloc((size_t)(n < max ? n : max) * sizeof *sp);
        if (!sp) return util_err_set(err, KVLM_ENOMEM, "out of memory"), -1;
        int k = tok_pretokenize(m->tok, text, len, sp, n < max ? n : max, err);
        for (int i = 0; i < k && i < max; i++) ends[i] = sp[i].off + sp[i].len;
        free(sp);
        return k;
    }
    tok_pretok *p = tok_pretok_create(pre, err);
    if (!p) return -1;
    pretok_ends c = {.text = text, .ends = ends, .max = ends && max > 0 ? max : 0, .n = 0};
    int rc = tok_pretok_split(p, text, len, pretok_end, &c, err);
    tok_pretok_free(p);
    return rc ? -1 : (int)c.n;
}

int kvlm_token_to_text(const kvlm_model *m, int32_t token, char *buf, size_t cap) {
    if (!m->tok) return -1;
    return tok_token_to_bytes(m->tok, token, false, buf, cap);
}

int kvlm_token_to_piece(const kvlm_model *m, int32_t token, bool special, char *buf, size_t cap) {
    if (!m->tok) return -1;
    return tok_token_to_bytes(m->tok, token, special, buf, cap);
}

int32_t kvlm_token_fim(const kvlm_model *m, int which) {
    /* the texts llama.cpp recognises (the last: DeepSeek's, in full-width bars) */
    static const char *const texts[3][5] = {
        {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "<\xef\xbd\x9c" "fim\xe2\x96\x81" "begin\xef\xbd\x9c>"},
        {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "<\xef\xbd\x9c" "fim\xe2\x96\x81" "hole\xef\xbd\x9c>"},
        {"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "<\xef\xbd\x9c" "fim\xe2\x96\x81" "end\xef\xbd\x9c>"},
    };
    if (which < 0 || which > 2) return -1;
    const model_vocab *v = &m->vocab;
    int32_t id = which == KVLM_FIM_PRE ? v->fim_pre : which == KVLM_FIM_SUF ? v->fim_suf : v->fim_mid;
    if (id >= 0) return id;
    for (int t = 0; t < v->n_tokens && v->tokens; t++)
        for (int k = 0; k < 5; k++)
            if (v->tokens[t] && !strcmp(v->tokens[t], texts[which][k])) return t;
    return -1;
}

void kvlm_detok_init(kvlm_detok *d, const kvlm_model *m) {
    memset(d, 0, sizeof *d);
    d->model = m;
    d->prev = -1;
}

/* Length of the UTF-8 sequence a lead byte starts (0: not a lead byte). */
static int utf8_len(unsigned char c) {
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) return 2;
    if (c >= 0xe0 && c <= 0xef) return 3;
    if (c >= 0xf0 && c <= 0xf4) return 4;
    return 0;
}

static int put(char *out, size_t cap, size_t *n, const char *s, size_t len) {
    if (*n + len + 1 > cap) return -1;
    memcpy(out + *n, s, len);
    *n += len;
    out[*n] = 0;
    return 0;
}

/* Emits the whole UTF-8 sequences of pending + buf, keeping an unfinished
 * tail in d->pending; invalid bytes become U+FFFD. */
static size_t emit_utf8(kvlm_detok *d, const char *buf, size_t len, char *out, size_t cap) {
    char tmp[sizeof d->pending + 256];
    size_t all = (size_t)d->n_pending, n = 0, j = 0;
    if (len > 256) len = 256;
    memcpy(tmp, d->pending, all);
    memcpy(tmp + all, buf, len);
    all += len;
    d->n_pending = 0;
    while (j < all) {
        int l = utf8_len((unsigned char)tmp[j]);
        bool ok = l > 0;
        int have = l;
        if (ok && j + (size_t)l > all) have = (int)(all - j);
        for (int q = 1; ok && q < have; q++) ok = ((unsigned char)tmp[j + q] & 0xc0) == 0x80;
        if (ok && have < l) { /* a valid but unfinished sequence: wait for more */
            memcpy(d->pending, tmp + j, (size_t)have);
            d->n_pending = have;
            break;
        }
        if (!ok) { put(out, cap, &n, "\xef\xbf\xbd", 3); j++; continue; }
        put(out, cap, &n, tmp + j, (size_t)l);
        j += (size_t)l;
    }
    return n;
}

int kvlm_detok_push(kvlm_detok *d, int32_t token, char *out, size_t cap) {
    char buf[256];
    if (cap) out[0] = 0;
    int len = kvlm_token_to_piece(d->model, token, d->special, buf, sizeof buf);
    int32_t prev = d->prev;
    d->prev = token;
    if (len <= 0) return 0;
    const char *s = buf;
    /* SentencePiece adds a space before the first word; drop it after BOS, and
     * at the very start of text encoded without BOS (--no-bos) when the
     * tokenizer adds that space, so that decode(encode(text)) == text. */
    bool start = prev == d->model->vocab.bos || (prev == -1 && d->model->vocab.add_space_prefix);
    if (start && d->model->tok && tok_is_spm(d->model->tok) && s[0] == ' ') {
        s++;
        len--;
    }
    return (int)emit_utf8(d, s, (size_t)len, out, cap);
}

int kvlm_detok_flush(kvlm_detok *d, char *out, size_t cap) {
    size_t n = 0;
    if (cap) out[0] = 0;
    if (d->n_pending) put(out, cap, &n, "\xef\xbf\xbd", 3);
    d->n_pending = 0;
    return (int)n;
}

/* ---- text with spans of known tokens ------------------------------------------ */

/* Whether ids, detokenized after prev and flushed, give exactly text[0, len). */
static bool spells(const kvlm_model *m, int32_t prev, const int32_t *ids, int n, const char *text, size_t len) {
    kvlm_detok d;
    kvlm_detok_init(&d, m);
    d.prev = prev;
    char piece[sizeof d.pending + 256 * 3 + 1]; /* the most one push writes: every byte a U+FFFD */
    size_t at = 0;
    for (int i = 0; i <= n; i++) {
        int k = i < n ? kvlm_detok_push(&d, ids[i], piece, sizeof piece) : kvlm_detok_flush(&d, piece, sizeof piece);
        if (k < 0 || (size_t)k > len - at || memcmp(piece, text + at, (size_t)k)) return false;
        at += (size_t)k;
    }
    return at == len;
}

typedef struct { int32_t *t; size_t n, cap; } idbuf;

static bool idbuf_room(idbuf *b, size_t more) {
    if (b->n + more <= b->cap) return true;
    size_t cap = (b->n + more) * 2;
    int32_t *t = realloc(b->t, cap * sizeof *t);
    if (!t) return false;
    b->t = t;
    b->cap = cap;
    return true;
}

/* Appends the tokens of one piece of text. */
static int encode_piece(const kvlm_model *m, const char *text, size_t len, bool bos, bool special, bool cont, idbuf *b,
                        kvlm_error *err) {
    int n = tok_encode_cont(m->tok, text, len, bos, special, cont, NULL, 0, err);
    if (n < 0) return -1;
    if (!idbuf_room(b, (size_t)n)) return util_err_set(err, KVLM_ENOMEM, "out of memory"), -1;
    tok_encode_cont(m->tok, text, len, bos, special, cont, b->t + b->n, n, err);
    b->n += (size_t)n;
    return 0;
}

int kvlm_tokenize_spans(const kvlm_model *m, const char *text, size_t len, bool add_bos, bool parse_special,
                        kvlm_token_span *spans, int n_spans, int32_t *tokens, int max_tokens, kvlm_error *err) {
    if (!m->tok) return util_err_set(err, KVLM_EINVAL, "%s has no tokenizer", m->path), -1;
    if ((!text && len) || n_spans < 0 || (n_spans && !spans))
        return util_err_set(err, KVLM_EINVAL, "kvlm_tokenize_spans: no text or spans"), -1;
    size_t end = 0;
    for (int i = 0; i < n_spans; i++) {
        kvlm_token_span *sp = &spans[i];
        sp->at = -1;
        if (sp->offset < end || sp->offset > len || sp->len > len - sp->offset)
            return util_err_set(err, KVLM_EINVAL, "span %d (bytes %zu + %zu) is out of order or past the text's %zu bytes",
                                i, sp->offset, sp->len, len), -1;
        if (sp->n_ids < 0 || (sp->n_ids && !sp->ids))
            return util_err_set(err, KVLM_EINVAL, "span %d: %d ids", i, sp->n_ids), -1;
        for (int k = 0; k < sp->n_ids; k++)
            if (sp->ids[k] < 0 || sp->ids[k] >= m->vocab.n_tokens)
                return util_err_set(err, KVLM_EINVAL, "span %d: token %d is not below the vocabulary's %d", i,
                                    sp->ids[k], m->vocab.n_tokens), -1;
        end = sp->offset + sp->len;
    }
    idbuf b = {0};
    size_t pos = 0; /* the text before pos is encoded */
    bool cont = false;
    for (int i = 0; i < n_spans; i++) {
        kvlm_token_span *sp = &spans[i];
        if (!sp->len || !sp->n_ids) continue;
        size_t before = b.n;
        if (encode_piece(m, text + pos, sp->offset - pos, add_bos && pos == 0, parse_special, cont, &b, err)) goto fail;
        if (!spells(m, b.n ? b.t[b.n - 1] : -1, sp->ids, sp->n_ids, text + sp->offset, sp->len)) {
            b.n = before; /* encoded with what follows it */
            continue;
        }
        if (!idbuf_room(&b, (size_t)sp->n_ids)) { util_err_set(err, KVLM_ENOMEM, "out of memory"); goto fail; }
        if (b.n > INT32_MAX) break; /* too long: the count check below refuses it */
        sp->at = (int)b.n;
        memcpy(b.t + b.n, sp->ids, (size_t)sp->n_ids * sizeof *b.t);
        b.n += (size_t)sp->n_ids;
        pos = sp->offset + sp->len;
        cont = true;
    }
    if (encode_piece(m, text + pos, len - pos, add_bos && pos == 0, parse_special, cont, &b, err)) goto fail;
    if (b.n > INT32_MAX) { util_err_set(err, KVLM_ERANGE, "kvlm_tokenize_spans: %zu tokens", b.n); goto fail; }
    if (tokens && max_tokens > 0) memcpy(tokens, b.t, (b.n < (size_t)max_tokens ? b.n : (size_t)max_tokens) * sizeof *tokens);
    free(b.t);
    return (int)b.n;
fail:
    free(b.t);
    return -1;
}

void kvlm_plan_memory(const kvlm_model *m, const kvlm_plan_params *p, kvlm_plan *out) {
    kv_plan(&m->cfg, m->weight_bytes, p, out);
}

/* ---- chat templates (the text; tok/jinja renders it) ------------------------ */

const char *kvlm_model_chat_template(const kvlm_model *m, const char *name) {
    if (!m) return NULL;
    if (!name) return m->vocab.chat_template;
    for (int i = 0; i < m->vocab.n_named_templates; i++)
        if (!strcmp(m->vocab.named_template_names[i], name)) return m->vocab.named_templates[i];
    return NULL;
}

const char *kvlm_token_piece(const kvlm_model *m, int32_t token) {
    if (!m || token < 0 || token >= m->vocab.n_tokens) return NULL;
    return m->vocab.tokens[token];
}
