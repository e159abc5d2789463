/* model/vocab: a tokenizer's vocabulary read from GGUF tokenizer.ggml.* keys or
 * from llama2.c's tokenizer.bin (validated), and written back to GGUF. */
#include "model/vocab.h"
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "util/error.h"
#include "util/file.h"

#define KEY_MODEL "tokenizer.ggml.model"
#define KEY_PRE "tokenizer.ggml.pre"
#define KEY_TOKENS "tokenizer.ggml.tokens"
#define KEY_SCORES "tokenizer.ggml.scores"
#define KEY_TYPES "tokenizer.ggml.token_type"
#define KEY_MERGES "tokenizer.ggml.merges"
#define KEY_BOS "tokenizer.ggml.bos_token_id"
#define KEY_EOS "tokenizer.ggml.eos_token_id"
#define KEY_UNK "tokenizer.ggml.unknown_token_id"
#define KEY_PAD "tokenizer.ggml.padding_token_id"
#define KEY_EOT "tokenizer.ggml.eot_token_id"
/* fill-in-the-middle (llama.cpp's keys; the older prefix/suffix/middle ones read too) */
#define KEY_FIM_PRE "tokenizer.ggml.fim_pre_token_id"
#define KEY_FIM_SUF "tokenizer.ggml.fim_suf_token_id"
#define KEY_FIM_MID "tokenizer.ggml.fim_mid_token_id"
#define KEY_SEP "tokenizer.ggml.seperator_token_id" /* sic: GGUF's spelling */
#define KEY_CLS "tokenizer.ggml.cls_token_id"
#define KEY_LOWER "tokenizer.ggml.normalizer.lowercase"
#define KEY_STRIP "tokenizer.ggml.normalizer.strip_accents"
#define KEY_ADD_BOS "tokenizer.ggml.add_bos_token"
#define KEY_ADD_EOS "tokenizer.ggml.add_eos_token"
#define KEY_ADD_SPACE "tokenizer.ggml.add_space_prefix"
#define KEY_TEMPLATE "tokenizer.chat_template"
/* kvlm's own: a byte-level pre-tokenizer by its regexes (model_vocab.pre_regex) */
#define KEY_PRE_REGEX "tokenizer.kvlm.pre_regex"
#define KEY_PRE_IGNORE_MERGES "tokenizer.kvlm.pre_ignore_merges"

/* Vocabularies beyond this are certainly corrupt (the largest real ones are ~256k). */
#define MAX_VOCAB (1 << 24)

static void vocab_reset(model_vocab *v) {
    memset(v, 0, sizeof *v);
    v->bos = v->eos = v->unk = v->pad = v->eot = v->sep = -1;
    v->fim_pre = v->fim_suf = v->fim_mid = -1;
}

void vocab_free(model_vocab *v) {
    if (!v) return;
    for (int i = 0; v->tokens && i < v->n_tokens; i++) free(v->tokens[i]);
    for (int i = 0; v->merges && i < v->n_merges; i++) free(v->merges[i]);
    for (int i = 0; v->pre_regex && i < v->n_pre_regex; i++) free(v->pre_regex[i]);
    free(v->pre_regex);
    free(v->tokens);
    free(v->lens);
    free(v->scores);
    free(v->types);
    free(v->merges);
    free(v->chat_template);
    for (int i = 0; i < v->n_named_templates; i++) {
        free(v->named_template_names[i]);
        free(v->named_templates[i]);
    }
    free(v->named_template_names);
    free(v->named_templates);
    vocab_reset(v);
}

static char *memdup_z(const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (!p) return NULL;
    if (n) memcpy(p, s, n);
    p[n] = 0;
    return p;
}

/* A string array of the file (or NULL if absent); error if of another type. */
static int get_str_array(const gguf_file *f, const char *key, const gguf_kv **out, kvlm_error *err) {
    const gguf_kv *kv = gguf_find(f, key);
    *out = NULL;
    if (!kv) return KVLM_OK;
    if (kv->type != GGUF_ARRAY || kv->arr_type != GGUF_STRING)
        return util_err_set(err, KVLM_EFORMAT, "%s has type %s%s%s, expected an array of strings", key,
                            gguf_vtype_name(kv->type), kv->type == GGUF_ARRAY ? " of " : "",
                            kv->type == GGUF_ARRAY ? gguf_vtype_name(kv->arr_type) : "");
    *out = kv;
    return KVLM_OK;
}

/* A numeric array of exactly n elements (or NULL if absent). */
static int get_num_array(const gguf_file *f, const char *key, uint64_t n, bool want_int, const gguf_kv **out,
                         kvlm_error *err) {
    const gguf_kv *kv = gguf_find(f, key);
    *out = NULL;
    if (!kv) return KVLM_OK;
    bool is_int = kv->type == GGUF_ARRAY && kv->arr_type != GGUF_FLOAT32 && kv->arr_type != GGUF_FLOAT64 &&
                  kv->arr_type != GGUF_STRING && kv->arr_type != GGUF_ARRAY && kv->arr_type != GGUF_BOOL;
    bool is_float = kv->type == GGUF_ARRAY && (kv->arr_type == GGUF_FLOAT32 || kv->arr_type == GGUF_FLOAT64);
    if (want_int ? !is_int : !(is_float || is_int))
        return util_err_set(err, KVLM_EFORMAT, "%s has type %s%s%s, expected an array of %s", key,
                            gguf_vtype_name(kv->type), kv->type == GGUF_ARRAY ? " of " : "",
                            kv->type == GGUF_ARRAY ? gguf_vtype_name(kv->arr_type) : "",
                            want_int ? "integers" : "numbers");
    if (kv->arr_n != n)
        return util_err_set(err, KVLM_EFORMAT, "%s has %" PRIu64 " entries but there are %" PRIu64 " tokens", key,
                            kv->arr_n, n);
    *out = kv;
    return KVLM_OK;
}

/* A token id key: absent -> def; -1 (or u32 0xffffffff) -> none; else must
 * be a valid id. */
static int get_id(const gguf_file *f, const char *key, int n_tokens, int32_t def, int32_t *out, kvlm_error *err) {
    const gguf_kv *kv = gguf_find(f, key);
    *out = def < n_tokens ? def : -1;
    if (!kv) return KVLM_OK;
    int64_t id;
    if (!gguf_get_int(f, key, &id))
        return util_err_set(err, KVLM_EFORMAT, "%s has type %s, expected an integer", key, gguf_vtype_name(kv->type));
    if (id == -1 || (kv->type == GGUF_UINT32 && id == (int64_t)UINT32_MAX)) {
        *out = -1;
        return KVLM_OK;
    }
    if (id < 0 || id >= n_tokens)
        return util_err_set(err, KVLM_EFORMAT, "%s is %" PRId64 ", outside the vocabulary of %d tokens", key, id,
                            n_tokens);
    *out = (int32_t)id;
    return KVLM_OK;
}

static int get_flag(const gguf_file *f, const char *key, bool *out, kvlm_error *err) {
    const gguf_kv *kv = gguf_find(f, key);
    if (!kv) return KVLM_OK;
    if (kv->type != GGUF_BOOL)
        return util_err_set(err, KVLM_EFORMAT, "%s has type %s, expected bool", key, gguf_vtype_name(kv->type));
    *out = kv->v.b;
    return KVLM_OK;
}

static int load_gguf(const gguf_file *f, model_vocab *v, kvlm_error *err) {
    const gguf_kv *kv_model = gguf_find(f, KEY_MODEL);
    if (!kv_model) return util_err_set(err, KVLM_EFORMAT, "no tokenizer in file (%s is missing)", KEY_MODEL);
    if (kv_model->type != GGUF_STRING)
        return util_err_set(err, KVLM_EFORMAT, "%s has type %s, expected string", KEY_MODEL,
                            gguf_vtype_name(kv_model->type));
    if (kv_model->v.s.len >= sizeof v->model)
        return util_err_set(err, KVLM_EFORMAT, "%s is %" PRIu64 " bytes long, which no tokenizer name is", KEY_MODEL,
                            kv_model->v.s.len);
    gguf_get_str(f, KEY_MODEL, v->model, sizeof v->model);
    const gguf_kv *kv_pre = gguf_find(f, KEY_PRE);
    if (kv_pre) {
        if (kv_pre->type != GGUF_STRING || kv_pre->v.s.len >= sizeof v->pre)
            return util_err_set(err, KVLM_EFORMAT, "%s must be a string shorter than %zu bytes", KEY_PRE,
                                sizeof v->pre);
        gguf_get_str(f, KEY_PRE, v->pre, sizeof v->pre);
    }

    const gguf_kv *toks, *scores, *types, *merges;
    int rc;
    if ((rc = get_str_array(f, KEY_TOKENS, &toks, err))) return rc;
    if (!toks || toks->arr_n == 0)
        return util_err_set(err, KVLM_EFORMAT, "no tokenizer in file (%s is %s)", KEY_TOKENS,
                            toks ? "empty" : "missing");
    if (toks->arr_n > MAX_VOCAB)
        return util_err_set(err, KVLM_EFORMAT, "%s has %" PRIu64 " tokens, more than the %d kvlm accepts", KEY_TOKENS,
                            toks->arr_n, MAX_VOCAB);
    uint64_t n = toks->arr_n;
    if ((rc = get_num_array(f, KEY_SCORES, n, false, &scores, err))) return rc;
    if ((rc = get_num_array(f, KEY_TYPES, n, true, &types, err))) return rc;
    if ((rc = get_str_array(f, KEY_MERGES, &merges, err))) return rc;
    if (merges && merges->arr_n > MAX_VOCAB * 4ull)
        return util_err_set(err, KVLM_EFORMAT, "%s has %" PRIu64 " entries, too many", KEY_MERGES, merges->arr_n);

    v->tokens = calloc((size_t)n, sizeof *v->tokens);
    v->lens = calloc((size_t)n, sizeof *v->lens);
    v->scores = calloc((size_t)n, sizeof *v->scores);
    v->types = calloc((size_t)n, sizeof *v->types);
    if (!v->tokens || !v->lens || !v->scores || !v->types)
        return util_err_set(err, KVLM_ENOMEM, "out of memory for %" PRIu64 " tokens", n);
    v->n_tokens = (int)n;
    for (uint64_t i = 0; i < n; i++) {
        gguf_str s = toks->arr_strs[i];
        if (s.len > UINT32_MAX / 2)
            return util_err_set(err, KVLM_EFORMAT, "token %" PRIu64 " is %" PRIu64 " bytes long", i, s.len);
        if (!(v->tokens[i] = memdup_z(s.data, (size_t)s.len)))
            return util_err_set(err, KVLM_ENOMEM, "out of memory for the tokens");
        v->lens[i] = (uint32_t)s.len;
        v->scores[i] = scores ? (float)gguf_arr_float(scores, i) : 0.0f;
        int64_t t = types ? gguf_arr_int(types, i) : VOCAB_T_NORMAL;
        /* 0 is "undefined" in the format; anything past BYTE is unknown to us */
        if (t < 0 || t > VOCAB_T_BYTE)
            return util_err_set(err, KVLM_EFORMAT, "%s[%" PRIu64 "] is %" PRId64 ", not a token type (0..6)", KEY_TYPES,
                                i, t);
        v->types[i] = (int32_t)t;
    }
    if (merges && merges->arr_n) {
        v->merges = calloc((size_t)merges->arr_n, sizeof *v->merges);
        if (!v->merges) return util_err_set(err, KVLM_ENOMEM, "out of memory for the merges");
        v->n_merges = (int)merges->arr_n;
        for (uint64_t i = 0; i < merges->arr_n; i++) {
            gguf_str s = merges->arr_strs[i];
            /* "left right": both sides non-empty, the separator found from
             * index 1 on (a left side may not be empty) */
            const char *sp = s.len > 2 ? memchr(s.data + 1, ' ', (size_t)s.len - 1) : NULL;
            if (!sp || sp == s.data + s.len - 1)
                return util_err_set(err, KVLM_EFORMAT, "%s[%" PRIu64 "] = \"%.*s\" is not of the form \"a b\"",
                                    KEY_MERGES, i, (int)(s.len < 60 ? s.len : 60), s.data);
            if (!(v->merges[i] = memdup_z(s.data, (size_t)s.len)))
                return util_err_set(err, KVLM_ENOMEM, "out of memory for the merges");
        }
    }

    bool llama = strcmp(v->model, "llama") == 0, wpm = strcmp(v->model, "bert") == 0;
    int nt = v->n_tokens;
    /* SentencePiece (llama) vocabularies default to <unk>=0, <s>=1, </s>=2
     * with BOS and a leading space; byte-level BPE (gpt2) to neither;
     * WordPiece (bert) to BERT's [UNK] 100, [CLS] 101 (as BOS), [SEP] 102 and
     * [PAD] 0, as llama.cpp does. llama.cpp's converter writes [CLS] as
     * cls_token_id (BERT's tokenizers name no BOS): taken when BOS is absent. */
    int32_t cls = -1;
    if ((rc = get_id(f, KEY_CLS, nt, wpm ? 101 : -1, &cls, err)) ||
        (rc = get_id(f, KEY_BOS, nt, llama ? 1 : cls, &v->bos, err)) ||
        (rc = get_id(f, KEY_EOS, nt, llama ? 2 : -1, &v->eos, err)) ||
        (rc = get_id(f, KEY_UNK, nt, llama ? 0 : wpm ? 100 : -1, &v->unk, err)) ||
        (rc = get_id(f, KEY_SEP, nt, wpm ? 102 : -1, &v->sep, err)) ||
        (rc = get_id(f, KEY_PAD, nt, wpm ? 0 : -1, &v->pad, err)) || (rc = get_id(f, KEY_EOT, nt, -1, &v->eot, err)) ||
        (rc = get_id(f, "tokenizer.ggml.prefix_token_id", nt, -1, &v->fim_pre, err)) ||
        (rc = get_id(f, "tokenizer.ggml.suffix_token_id", nt, -1, &v->fim_suf, err)) ||
        (rc = get_id(f, "tokenizer.ggml.middle_token_id", nt, -1, &v->fim_mid, err)) ||
        (gguf_find(f, KEY_FIM_PRE) && (rc = get_id(f, KEY_FIM_PRE, nt, -1, &v->fim_pre, err))) ||
        (gguf_find(f, KEY_FIM_SUF) && (rc = get_id(f, KEY_FIM_SUF, nt, -1, &v->fim_suf, err))) ||
        (gguf_find(f, KEY_FIM_MID) && (rc = get_id(f, KEY_FIM_MID, nt, -1, &v->fim_mid, err))))
        return rc;
    v->wpm_lower = true;
    if ((rc = get_flag(f, KEY_LOWER, &v->wpm_lower, err))) return rc;
    v->wpm_strip_accents = v->wpm_lower;
    if ((rc = get_flag(f, KEY_STRIP, &v->wpm_strip_accents, err))) return rc;
    v->add_bos = llama || wpm;
    v->add_eos = false;
    v->add_space_prefix = llama;
    v->add_bos_key = gguf_find(f, KEY_ADD_BOS) != NULL;
    if ((rc = get_flag(f, KEY_ADD_BOS, &v->add_bos, err)) || (rc = get_flag(f, KEY_ADD_EOS, &v->add_eos, err)) ||
        (rc = get_flag(f, KEY_ADD_SPACE, &v->add_space_prefix, err)))
        return rc;
    const gguf_kv *pre_re;
    if ((rc = get_str_array(f, KEY_PRE_REGEX, &pre_re, err))) return rc;
    if (pre_re) {
        if (pre_re->arr_n > 8)
            return util_err_set(err, KVLM_EFORMAT, "%s has %" PRIu64 " regexes (at most 8)", KEY_PRE_REGEX,
                                pre_re->arr_n);
        v->has_pre_regex = true;
        if (!(v->pre_regex = calloc((size_t)pre_re->arr_n + 1, sizeof *v->pre_regex)))
            return util_err_set(err, KVLM_ENOMEM, "out of memory");
        for (uint64_t i = 0; i < pre_re->arr_n; i++) {
            gguf_str s = pre_re->arr_strs[i];
            if (!(v->pre_regex[i] = memdup_z(s.data, (size_t)s.len)))
                return util_err_set(err, KVLM_ENOMEM, "out of memory");
            v->n_pre_regex++;
        }
        if ((rc = get_flag(f, KEY_PRE_IGNORE_MERGES, &v->pre_ignore_merges, err))) return rc;
    }
    const gguf_kv *tmpl = gguf_find(f, KEY_TEMPLATE);
    if (tmpl) {
        if (tmpl->type != GGUF_STRING)
            return util_err_set(err, KVLM_EFORMAT, "%s has type %s, expected string", KEY_TEMPLATE,
                                gguf_vtype_name(tmpl->type));
        if (!(v->chat_template = memdup_z(tmpl->v.s.data, (size_t)tmpl->v.s.len)))
            return util_err_set(err, KVLM_ENOMEM, "out of memory for the chat template");
    }
    const size_t pre_len = strlen(KEY_TEMPLATE ".");
    for (uint64_t i = 0; i < f->n_kv; i++) {
        const gguf_kv *kv = &f->kv[i];
        if (kv->key.len <= pre_len || memcmp(kv->key.data, KEY_TEMPLATE ".", pre_len)) continue;
        if (kv->type != GGUF_STRING)
            return util_err_set(err, KVLM_EFORMAT, "%.*s has type %s, expected string", (int)kv->key.len,
                                kv->key.data, gguf_vtype_name(kv->type));
        if (vocab_add_named_template(v, kv->key.data + pre_len, (size_t)kv->key.len - pre_len, kv->v.s.data,
                                     (size_t)kv->v.s.len))
            return util_err_set(err, KVLM_ENOMEM, "out of memory for the chat templates");
    }
    return KVLM_OK;
}

int vocab_add_named_template(model_vocab *v, const char *name, size_t name_len, const char *text, size_t text_len) {
    char **n = realloc(v->named_template_names, (size_t)(v->n_named_templates + 1) * sizeof *n);
    if (!n) return KVLM_ENOMEM;
    v->named_template_names = n;
    char **t = realloc(v->named_templates, (size_t)(v->n_named_templates + 1) * sizeof *t);
    if (!t) return KVLM_ENOMEM;
    v->named_templates = t;
    char *a = memdup_z(name, name_len), *b = memdup_z(text, text_len);
    if (!a || !b) { free(a); free(b); return KVLM_ENOMEM; }
    n[v->n_named_templates] = a;
    t[v->n_named_templates++] = b;
    return KVLM_OK;
}

int vocab_from_gguf(const gguf_file *f, model_vocab *v, kvlm_error *err) {
    vocab_reset(v);
    if (!f) return util_err_set(err, KVLM_EINVAL, "vocab_from_gguf: no file");
    int rc = load_gguf(f, v, err);
    if (rc) vocab_free(v);
    return rc;
}

/* ---- llama2.c tokenizer.bin ---------------------------------------------------- */

static bool is_byte_token(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return false;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        if (!((c >= '0' && c <= '9') || (c >= 'A' && c <= 'F') || (c >= 'a' && c <= 'f'))) return false;
    }
    return true;
}

static int load_llama2c(const char *path, const uint8_t *buf, size_t size, int n_vocab, model_vocab *v,
                        kvlm_error *err) {
    size_t off = 0;
    int32_t max_len;
    if (size < 4) return util_err_set(err, KVLM_EFORMAT, "%s: too short for a llama2.c tokenizer (%zu bytes)", path, size);
    memcpy(&max_len, buf, 4);
    off = 4;
    if (max_len <= 0 || max_len > (1 << 16))
        return util_err_set(err, KVLM_EFORMAT, "%s: max token length %d is not plausible: not a llama2.c tokenizer?",
                            path, max_len);
    v->tokens = calloc((size_t)n_vocab, sizeof *v->tokens);
    v->lens = calloc((size_t)n_vocab, sizeof *v->lens);
    v->scores = calloc((size_t)n_vocab, sizeof *v->scores);
    v->types = calloc((size_t)n_vocab, sizeof *v->types);
    if (!v->tokens || !v->lens || !v->scores || !v->types)
        return util_err_set(err, KVLM_ENOMEM, "out of memory for %d tokens", n_vocab);
    v->n_tokens = n_vocab;
    for (int i = 0; i < n_vocab; i++) {
        if (size - off < 8)
            return util_err_set(err, KVLM_EFORMAT,
                                "%s: truncated at token %d of %d (offset %zu of %zu bytes): does the tokenizer "
                                "belong to this model?",
                                path, i, n_vocab, off, size);
        int32_t len;
        memcpy(&v->scores[i], buf + off, 4);
        memcpy(&len, buf + off + 4, 4);
        off += 8;
        if (len < 0 || len > max_len)
            return util_err_set(err, KVLM_EFORMAT, "%s: token %d has length %d (the header's maximum is %d)", path, i,
                                len, max_len);
        if ((size_t)len > size - off)
            return util_err_set(err, KVLM_EFORMAT, "%s: token %d (%d bytes at offset %zu) runs past the end (%zu bytes)",
                                path, i, len, off, size);
        const char *s = (const char *)buf + off;
        off += (size_t)len;
        /* llama2.c's exporter wrote BOS/EOS as "\n<s>\n" / "\n</s>\n" and
         * every U+2581 as a space; undo both to get SentencePiece's tokens. */
        if (i == 1 && len == 5 && memcmp(s, "\n<s>\n", 5) == 0) { s = "<s>"; len = 3; }
        if (i == 2 && len == 6 && memcmp(s, "\n</s>\n", 6) == 0) { s = "</s>"; len = 4; }
        size_t spaces = 0;
        for (int k = 0; k < len; k++) spaces += s[k] == ' ';
        size_t out_len = (size_t)len + 2 * spaces;
        char *t = malloc(out_len + 1);
        if (!t) return util_err_set(err, KVLM_ENOMEM, "out of memory for the tokens");
        size_t o = 0;
        for (int k = 0; k < len; k++) {
            if (s[k] == ' ') {
                t[o++] = (char)0xE2;
                t[o++] = (char)0x96;
                t[o++] = (char)0x81;
            } else t[o++] = s[k];
        }
        t[o] = 0;
        v->tokens[i] = t;
        v->lens[i] = (uint32_t)out_len;
        v->types[i] = i == 0 ? VOCAB_T_UNKNOWN : (i == 1 || i == 2) ? VOCAB_T_CONTROL
                      : is_byte_token(t, out_len) ? VOCAB_T_BYTE : VOCAB_T_NORMAL;
    }
    /* Bytes after the last token are ignored, as llama2.c's run.c does: a
     * tokenizer may hold more tokens than the model uses. */
    snprintf(v->model, sizeof v->model, "llama");
    v->unk = 0;
    v->bos = n_vocab > 1 ? 1 : -1;
    v->eos = n_vocab > 2 ? 2 : -1;
    v->add_bos = true;
    v->add_space_prefix = true;
    return KVLM_OK;
}

int vocab_from_llama2c(const char *path, int n_vocab, model_vocab *v, kvlm_error *err) {
    vocab_reset(v);
    if (!path) return util_err_set(err, KVLM_EINVAL, "vocab_from_llama2c: no path");
    if (n_vocab <= 0 || n_vocab > MAX_VOCAB)
        return util_err_set(err, KVLM_EINVAL, "%s: vocabulary size %d from the model header is not plausible", path,
                            n_vocab);
    size_t size = 0;
    uint8_t *buf = (uint8_t *)util_read_file(path, (size_t)1 << 30, &size, err);
    if (!buf) return err ? err->code : KVLM_EIO;
    int rc = load_llama2c(path, buf, size, n_vocab, v, err);
    free(buf);
    if (rc) vocab_free(v);
    return rc;
}

/* ---- writing --------------------------------------------------------------------- */

void vocab_to_gguf(const model_vocab *v, gguf_writer *w) {
    if (!v || !w || v->n_tokens <= 0) return;
    gguf_writer_set_str(w, KEY_MODEL, v->model);
    if (v->pre[0]) gguf_writer_set_str(w, KEY_PRE, v->pre);
    gguf_writer_set_arr_strn(w, KEY_TOKENS, (const char *const *)v->tokens, v->lens, (uint64_t)v->n_tokens);
    if (v->scores) gguf_writer_set_arr_f32(w, KEY_SCORES, v->scores, (uint64_t)v->n_tokens);
    if (v->types) gguf_writer_set_arr_i32(w, KEY_TYPES, v->types, (uint64_t)v->n_tokens);
    if (v->n_merges > 0) gguf_writer_set_arr_str(w, KEY_MERGES, (const char *const *)v->merges, (uint64_t)v->n_merges);
    const struct { const char *key; int32_t id; } ids[] = {
        {KEY_BOS, v->bos}, {KEY_EOS, v->eos}, {KEY_UNK, v->unk}, {KEY_PAD, v->pad}, {KEY_EOT, v->eot},
        {KEY_FIM_PRE, v->fim_pre}, {KEY_FIM_SUF, v->fim_suf}, {KEY_FIM_MID, v->fim_mid}, {KEY_SEP, v->sep}};
    bool llama = strcmp(v->model, "llama") == 0;
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
        if (ids[i].id >= 0) gguf_writer_set_u32(w, ids[i].key, (uint32_t)ids[i].id);
        /* an absent BOS/EOS/UNK of a llama vocabulary would read back as the
         * default 1/2/0: say "none" explicitly */
        else if (llama && i < 3) gguf_writer_set_u32(w, ids[i].key, UINT32_MAX);
    }
    if (!strcmp(v->model, "bert")) { /* as llama.cpp's converter: [CLS] named as such too; the normalizer's flags */
        if (v->bos >= 0) gguf_writer_set_u32(w, KEY_CLS, (uint32_t)v->bos);
        gguf_writer_set_bool(w, KEY_LOWER, v->wpm_lower);
        if (v->wpm_strip_accents != v->wpm_lower) gguf_writer_set_bool(w, KEY_STRIP, v->wpm_strip_accents);
    }
    gguf_writer_set_bool(w, KEY_ADD_BOS, v->add_bos);
    gguf_writer_set_bool(w, KEY_ADD_EOS, v->add_eos);
    gguf_writer_set_bool(w, KEY_ADD_SPACE, v->add_space_prefix);
    if (v->chat_template) gguf_writer_set_str(w, KEY_TEMPLATE, v->chat_template);
    for (int i = 0; i < v->n_named_templates; i++) {
        char key[256];
        snprintf(key, sizeof key, "%s.%s", KEY_TEMPLATE, v->named_template_names[i]);
        gguf_writer_set_str(w, key, v->named_templates[i]);
    }
    if (v->has_pre_regex) {
        gguf_writer_set_arr_str(w, KEY_PRE_REGEX, (const char *const *)v->pre_regex, (uint64_t)v->n_pre_regex);
        gguf_writer_set_bool(w, KEY_PRE_IGNORE_MERGES, v->pre_ignore_merges);
    }
}
