/* engine/model_api: the public model and token API: loading (weights from
 * model/, tokenizer from tok/), listing, converting, and streaming text out. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "engine/grammar.h"
#include "kv/planner.h"
#include "model/dtype.h"
#include "model/model.h"
#include "model/hf.h"
#include "ops/ops.h"
#include "tok/pretok.h"
#include "tok/tok.h"
#include "util/log.h"
#include "util/error.h"
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
 * in place from the file's 4 KiB pages, a stories110M-shape F16 decode ran
 * 8-10% slower, BF16 11-18%, bench_decode; docs/weights.md). Every later
 * step reads the copy. The file's pages of an untied tensor are then dropped
 * from memory (they are clean pages of a read-only mapping, read back from
 * the file if anything asks), so the copy does not double the resident
 * weights. Returns false if out of memory (the model then reads the file's
 * pages, which is only slower). */
static bool pack_weights(kvlm_model *m) {
    if (!m->layers) return true;
    model_tensor **ts = malloc(sizeof *ts * ((size_t)m->cfg.n_layers * MATMUL_PER_LAYER + 1));
    if (!ts) return false;
    int n = matmul_tensors(m, ts);
    size_t total = 0;
    for (int i = 0; i < n; i++)
        if (ts[i]->data) total += (copy_bytes(ts[i]) + 63) & ~(size_t)63;
    uint8_t *buf = total ? util_big_alloc(total, false) : NULL;
    if (!buf) { free(ts); return total == 0; }
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        model_tensor *t = ts[i];
        if (!t->data) continue;
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
        if (!tied || !packed) { /* a packed tied classifier's embedding rows still read the file */
            uintptr_t lo = ((uintptr_t)file + page - 1) & ~(uintptr_t)(page - 1);
            uintptr_t hi = ((uintptr_t)file + file_bytes(t)) & ~(uintptr_t)(page - 1);
            if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
        }
        off += (copy_bytes(t) + 63) & ~(size_t)63;
    }
    m->packed_buf = buf;
    m->packed_bytes = total;
    free(ts);
    return true;
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
    if (model_load(m, path, params, err)) { free(m); return NULL; }
    m->packed_buf = NULL;
    name_pre_regex(&m->vocab);
    pack_weights(m);
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
    if (!m->layers) return util_err_set(err, KVLM_EINVAL, "the model has no weights to save");
    return model_save_gguf(m, path, type, err);
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
    int len = kvlm_token_to_text(d->model, token, buf, sizeof buf);
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
