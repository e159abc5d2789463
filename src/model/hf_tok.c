/* model/hf_tok: Hugging Face's tokenizer.json (BPE models: byte-level with
 * merges, or SentencePiece-converted with byte_fallback) and
 * tokenizer_config.json read into the model_vocab the GGUF path fills, so
 * that tok/ tokenizes both the same way. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "model/hf.h"
#include "util/error.h"
#include "util/file.h"

#define MAX_VOCAB (1 << 24)
#define MAX_PRE_REGEX 8
/* The regex of Hugging Face's ByteLevel pre-tokenizer (use_regex: true),
 * which is GPT-2's. */
#define HF_BYTELEVEL_RE "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define SPM_SPACE "\xe2\x96\x81" /* U+2581 */

typedef struct {
    const char *path;     /* tokenizer.json, for messages */
    bool byte_level;      /* a ByteLevel pre-tokenizer */
    bool metaspace;       /* a Metaspace pre-tokenizer (SentencePiece-style) */
    bool prefix_space;    /* Prepend("▁") or Metaspace prepending */
    bool replace_space;   /* Replace(" " -> "▁") */
    char *re[MAX_PRE_REGEX];
    bool split_space;     /* Split(" ", MergedWithPrevious): Gemma's, a no-op after replace_space */
    int n_re;
} hf_pre;

static void pre_free(hf_pre *p) {
    for (int i = 0; i < p->n_re; i++) free(p->re[i]);
    p->n_re = 0;
}

static int add_re(hf_pre *p, const char *re, kvlm_error *err) {
    if (p->n_re == MAX_PRE_REGEX)
        return util_err_set(err, KVLM_EUNSUPPORTED, "%s: more than %d pre-tokenizer splits", p->path, MAX_PRE_REGEX);
    if (!(p->re[p->n_re] = strdup(re))) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    p->n_re++;
    return KVLM_OK;
}

static const char *jstr(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* A Split pattern {"Regex": R} or {"String": S} as a regex (S quoted). */
static int split_pattern(hf_pre *p, json_t *pat, kvlm_error *err) {
    const char *re = jstr(pat, "Regex"), *s = jstr(pat, "String");
    if (re) return add_re(p, re, err);
    if (!s) return util_err_set(err, KVLM_EFORMAT, "%s: a Split pre-tokenizer has no Regex or String pattern", p->path);
    size_t n = strlen(s);
    char *q = malloc(2 * n + 1);
    if (!q) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (strchr("\\^$.|?*+()[]{}", s[i])) q[o++] = '\\';
        q[o++] = s[i];
    }
    q[o] = 0;
    int rc = add_re(p, q, err);
    free(q);
    return rc;
}

static int walk_pre(hf_pre *p, json_t *pt, kvlm_error *err) {
    if (!pt || json_is_null(pt)) return KVLM_OK;
    const char *type = jstr(pt, "type");
    if (!type) return util_err_set(err, KVLM_EFORMAT, "%s: a pre_tokenizer has no \"type\"", p->path);
    int rc;
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(pt, "pretokenizers"), *e;
        size_t i;
        json_array_foreach(list, i, e) if ((rc = walk_pre(p, e, err))) return rc;
        return KVLM_OK;
    }
    if (!strcmp(type, "ByteLevel")) {
        p->byte_level = true;
        if (json_is_true(json_object_get(pt, "add_prefix_space")))
            return util_err_set(err, KVLM_EUNSUPPORTED, "%s: ByteLevel with add_prefix_space is not supported",
                                p->path);
        json_t *ur = json_object_get(pt, "use_regex");
        return ur && json_is_false(ur) ? KVLM_OK : add_re(p, HF_BYTELEVEL_RE, err);
    }
    if (!strcmp(type, "Split")) {
        const char *beh = jstr(pt, "behavior"), *str = jstr(json_object_get(pt, "pattern"), "String");
        /* Gemma's tokenizer.json: the normalizer (which runs first) has
         * already made every space U+2581, so this split never matches; checked
         * once the normalizer is read */
        if (beh && !strcmp(beh, "MergedWithPrevious") && str && !strcmp(str, " ") &&
            !json_is_true(json_object_get(pt, "invert"))) {
            p->split_space = true;
            return KVLM_OK;
        }
        if (!beh || strcmp(beh, "Isolated") || json_is_true(json_object_get(pt, "invert")))
            return util_err_set(err, KVLM_EUNSUPPORTED, "%s: Split pre-tokenizer with behavior \"%s\"%s is not "
                                "supported (Isolated is)", p->path, beh ? beh : "?",
                                json_is_true(json_object_get(pt, "invert")) ? " and invert" : "");
        return split_pattern(p, json_object_get(pt, "pattern"), err);
    }
    if (!strcmp(type, "Digits"))
        return add_re(p, json_is_true(json_object_get(pt, "individual_digits")) ? "\\p{N}" : "\\p{N}+", err);
    if (!strcmp(type, "Metaspace")) {
        const char *r = jstr(pt, "replacement");
        if (r && strcmp(r, SPM_SPACE))
            return util_err_set(err, KVLM_EUNSUPPORTED, "%s: Metaspace replacement \"%s\" is not supported (U+2581 is)",
                                p->path, r);
        const char *scheme = jstr(pt, "prepend_scheme");
        json_t *aps = json_object_get(pt, "add_prefix_space");
        p->metaspace = true;
        p->prefix_space = scheme ? strcmp(scheme, "never") != 0 : !aps || json_is_true(aps);
        return KVLM_OK;
    }
    return util_err_set(err, KVLM_EUNSUPPORTED, "%s: pre-tokenizer \"%s\" is not supported (ByteLevel, Split, "
                        "Digits, Metaspace and Sequences of them are)", p->path, type);
}

static int walk_norm(hf_pre *p, json_t *n, kvlm_error *err) {
    if (!n || json_is_null(n)) return KVLM_OK;
    const char *type = jstr(n, "type");
    if (!type) return util_err_set(err, KVLM_EFORMAT, "%s: a normalizer has no \"type\"", p->path);
    int rc;
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(n, "normalizers"), *e;
        size_t i;
        json_array_foreach(list, i, e) if ((rc = walk_norm(p, e, err))) return rc;
        return KVLM_OK;
    }
    if (!strcmp(type, "Prepend")) {
        const char *s = jstr(n, "prepend");
        if (s && !strcmp(s, SPM_SPACE)) { p->prefix_space = true; return KVLM_OK; }
    } else if (!strcmp(type, "Replace")) {
        json_t *pat = json_object_get(n, "pattern");
        const char *from = jstr(pat, "String"), *to = jstr(n, "content");
        if (from && to && !strcmp(from, " ") && !strcmp(to, SPM_SPACE)) { p->replace_space = true; return KVLM_OK; }
    } else if (!strcmp(type, "NFC")) {
        /* Canonical composition: llama.cpp does not apply it either (Qwen2);
         * text that is already NFC (nearly all) tokenizes the same. */
        return KVLM_OK;
    }
    return util_err_set(err, KVLM_EUNSUPPORTED, "%s: normalizer \"%s\" is not supported (Prepend and Replace of "
                        "U+2581, NFC, and Sequences of them are)", p->path, type);
}

/* A token's text from tokenizer_config.json: "<s>" or {"content": "<s>", ...}. */
static const char *token_text(json_t *v) {
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_object(v)) return jstr(v, "content");
    return NULL;
}

static int32_t find_token(const model_vocab *v, const char *s) {
    if (!s) return -1;
    size_t n = strlen(s);
    /* added tokens come last, and a name is looked up a handful of times */
    for (int i = v->n_tokens - 1; i >= 0; i--)
        if (v->lens[i] == n && !memcmp(v->tokens[i], s, n)) return i;
    return -1;
}

/* Merges: "a b" strings or ["a", "b"] pairs; returns the joined "a b" text
 * (malloc'd) or NULL with err. */
static char *merge_text(const char *path, json_t *e, size_t i, kvlm_error *err) {
    const char *a = NULL, *b = NULL;
    char *out = NULL;
    if (json_is_string(e)) {
        const char *s = json_string_value(e);
        const char *sp = s[0] ? strchr(s + 1, ' ') : NULL;
        if (!sp || !sp[1] || strchr(sp + 1, ' ')) {
            util_err_set(err, KVLM_EFORMAT, "%s: merges[%zu] = \"%.60s\" is not of the form \"a b\"", path, i, s);
            return NULL;
        }
        if (!(out = strdup(s))) util_err_set(err, KVLM_ENOMEM, "out of memory");
        return out;
    }
    if (json_is_array(e) && json_array_size(e) == 2) {
        a = json_string_value(json_array_get(e, 0));
        b = json_string_value(json_array_get(e, 1));
    }
    if (!a || !b || !a[0] || !b[0]) {
        util_err_set(err, KVLM_EFORMAT, "%s: merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", path, i);
        return NULL;
    }
    if (strchr(a, ' ') || strchr(b, ' ')) {
        util_err_set(err, KVLM_EUNSUPPORTED, "%s: merges[%zu] = [\"%.30s\", \"%.30s\"]: tokens holding a space are "
                     "not supported in merges", path, i, a, b);
        return NULL;
    }
    size_t la = strlen(a), lb = strlen(b);
    if (!(out = malloc(la + lb + 2))) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    memcpy(out, a, la);
    out[la] = ' ';
    memcpy(out + la + 1, b, lb + 1);
    return out;
}

static int set_token(model_vocab *v, int id, const char *s, int type, kvlm_error *err) {
    free(v->tokens[id]);
    if (!(v->tokens[id] = strdup(s))) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    v->lens[id] = (uint32_t)strlen(s);
    v->types[id] = type;
    return KVLM_OK;
}

static bool is_byte_token(const char *s) {
    return strlen(s) == 6 && !memcmp(s, "<0x", 3) && s[5] == '>' && strchr("0123456789ABCDEFabcdef", s[3]) &&
           strchr("0123456789ABCDEFabcdef", s[4]) && s[3] && s[4];
}

typedef struct { const char *s; int32_t id; } tok_ent;
static int cmp_ent(const void *a, const void *b) { return strcmp(((const tok_ent *)a)->s, ((const tok_ent *)b)->s); }

/* SentencePiece-converted BPE: SentencePiece merges the adjacent pair whose
 * result has the best score, and Hugging Face's converter lists the merges
 * in that order, so a token's score is minus the rank of the first merge
 * that makes it; tokens no merge makes come after every merge. */
static int spm_scores(model_vocab *v, char **merges, int n_merges, kvlm_error *err) {
    for (int i = 0; i < v->n_tokens; i++) v->scores[i] = -(float)(n_merges + 1);
    tok_ent *e = malloc((size_t)v->n_tokens * sizeof *e);
    if (!e) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    for (int i = 0; i < v->n_tokens; i++) e[i] = (tok_ent){v->tokens[i], i};
    qsort(e, (size_t)v->n_tokens, sizeof *e, cmp_ent);
    char *buf = NULL;
    size_t cap = 0;
    int rc = KVLM_OK;
    for (int r = n_merges - 1; r >= 0; r--) {
        const char *m = merges[r], *sp = strchr(m + 1, ' ');
        size_t la = (size_t)(sp - m), lb = strlen(sp + 1);
        if (la + lb + 1 > cap) {
            char *nb = realloc(buf, cap = 2 * (la + lb + 1));
            if (!nb) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); break; }
            buf = nb;
        }
        memcpy(buf, m, la);
        memcpy(buf + la, sp + 1, lb + 1);
        tok_ent key = {buf, 0}, *hit = bsearch(&key, e, (size_t)v->n_tokens, sizeof *e, cmp_ent);
        /* from the last rank down: the first merge making a token wins */
        if (hit) v->scores[hit->id] = -(float)r;
    }
    free(buf);
    free(e);
    return rc;
}

static json_t *load_json(const char *path, bool required, kvlm_error *err, int *rc) {
    *rc = KVLM_OK;
    if (access(path, F_OK) != 0) {
        if (required) *rc = util_err_set(err, KVLM_EIO, "%s: missing", path);
        return NULL;
    }
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j) *rc = util_err_set(err, KVLM_EFORMAT, "%s: not valid JSON (line %d: %s)", path, je.line, je.text);
    else if (!json_is_object(j)) {
        *rc = util_err_set(err, KVLM_EFORMAT, "%s: not a JSON object", path);
        json_decref(j);
        j = NULL;
    }
    return j;
}

/* Newer Transformers save the chat template beside tokenizer_config.json:
 * chat_template.jinja (the text as it is), or a multimodal processor's
 * chat_template.json ({"chat_template": "..."}, Gemma 3's). *out: the
 * first found, or left NULL. */
static int template_file(const char *dir, char **out, kvlm_error *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    if (access(path, F_OK) == 0) {
        *out = util_read_file(path, 1u << 24, NULL, err);
        return *out ? KVLM_OK : err ? err->code : KVLM_EIO;
    }
    snprintf(path, sizeof path, "%s/chat_template.json", dir);
    int rc;
    json_t *j = load_json(path, false, err, &rc);
    if (!j) return rc;
    const char *t = json_string_value(json_object_get(j, "chat_template"));
    if (t && !(*out = strdup(t))) rc = util_err_set(err, KVLM_ENOMEM, "out of memory");
    json_decref(j);
    return rc;
}

/* A template that starts (or ends) with a special token adds it. */
static bool template_adds(json_t *post, bool first, const char *tok) {
    if (!tok || !post) return false;
    const char *type = jstr(post, "type");
    if (type && !strcmp(type, "Sequence")) {
        json_t *e;
        size_t i;
        json_array_foreach(json_object_get(post, "processors"), i, e) if (template_adds(e, first, tok)) return true;
        return false;
    }
    if (!type || strcmp(type, "TemplateProcessing")) return false;
    json_t *single = json_object_get(post, "single");
    size_t n = json_array_size(single);
    if (!n) return false;
    json_t *st = json_object_get(json_array_get(single, first ? 0 : n - 1), "SpecialToken");
    const char *id = jstr(st, "id");
    return id && !strcmp(id, tok);
}

static int load_vocab(const char *dir, int n_rows, model_vocab *v, kvlm_error *err) {
    char path[4096], cpath[4096];
    int rc;
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    json_t *root = load_json(path, false, err, &rc), *tcfg = NULL, *mcfg = NULL;
    char **merges = NULL;
    int n_merges = 0;
    hf_pre pre = {.path = path};
    if (rc) return rc;
    if (!root)
        return util_err_set(err, KVLM_EIO, "%s: no tokenizer.json (kvlm reads Hugging Face's fast-tokenizer file; a "
                            "tokenizer.model alone is not supported)", dir);
    json_t *model = json_object_get(root, "model");
    const char *mtype = jstr(model, "type");
    json_t *jvocab = json_object_get(model, "vocab"), *jmerges = json_object_get(model, "merges");
    if (!json_is_object(model) || (mtype && strcmp(mtype, "BPE")) || (!mtype && !json_is_array(jmerges))) {
        rc = util_err_set(err, KVLM_EUNSUPPORTED, "%s: tokenizer model \"%s\" is not supported (BPE is)", path,
                          mtype ? mtype : "?");
        goto done;
    }
    if (!json_is_object(jvocab) || !json_is_array(jmerges)) {
        rc = util_err_set(err, KVLM_EFORMAT, "%s: the BPE model needs a \"vocab\" object and a \"merges\" array", path);
        goto done;
    }
    if (jstr(model, "continuing_subword_prefix") || jstr(model, "end_of_word_suffix")) {
        rc = util_err_set(err, KVLM_EUNSUPPORTED, "%s: BPE with continuing_subword_prefix or end_of_word_suffix is not "
                          "supported", path);
        goto done;
    }
    if ((rc = walk_pre(&pre, json_object_get(root, "pre_tokenizer"), err)) ||
        (rc = walk_norm(&pre, json_object_get(root, "normalizer"), err)))
        goto done;
    bool byte_fallback = json_is_true(json_object_get(model, "byte_fallback"));
    bool spm = !pre.byte_level && (byte_fallback || pre.metaspace || pre.replace_space);
    if (!pre.byte_level && !spm) {
        rc = util_err_set(err, KVLM_EUNSUPPORTED, "%s: a BPE model with neither a ByteLevel pre-tokenizer nor "
                          "byte_fallback (SentencePiece) is not supported", path);
        goto done;
    }
    if (spm && !pre.metaspace && !pre.replace_space) {
        rc = util_err_set(err, KVLM_EUNSUPPORTED, "%s: byte_fallback BPE without the U+2581 space (a Metaspace "
                          "pre-tokenizer or a Replace normalizer) is not supported", path);
        goto done;
    }
    if (pre.split_space && !(spm && pre.replace_space)) {
        rc = util_err_set(err, KVLM_EUNSUPPORTED, "%s: a Split pre-tokenizer on \" \" (MergedWithPrevious) is "
                          "supported only after a Replace(\" \" -> \"" SPM_SPACE "\") normalizer, where it splits nothing "
                          "(Gemma's tokenizer.json)", path);
        goto done;
    }
    if (spm && pre.n_re) {
        /* the SentencePiece path has no pre-tokenizer splits: refuse rather than drop them */
        rc = util_err_set(err, KVLM_EUNSUPPORTED, "%s: pre-tokenizer splits (\"%.40s\") with a byte_fallback "
                          "(SentencePiece) BPE are not supported", path, pre.re[0]);
        goto done;
    }

    /* ids: the model's vocab and the added tokens; the largest + 1 tokens */
    json_int_t max_id = -1;
    const char *key;
    json_t *val, *added = json_object_get(root, "added_tokens");
    json_object_foreach(jvocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 || json_integer_value(val) >= MAX_VOCAB) {
            rc = util_err_set(err, KVLM_EFORMAT, "%s: vocab[\"%.40s\"] is not a token id", path, key);
            goto done;
        }
        if (json_integer_value(val) > max_id) max_id = json_integer_value(val);
    }
    size_t i;
    json_array_foreach(added, i, val) {
        json_t *id = json_object_get(val, "id");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= MAX_VOCAB ||
            !jstr(val, "content")) {
            rc = util_err_set(err, KVLM_EFORMAT, "%s: added_tokens[%zu] needs an \"id\" and a \"content\"", path, i);
            goto done;
        }
        if (json_integer_value(id) > max_id) max_id = json_integer_value(id);
    }
    if (max_id < 0) { rc = util_err_set(err, KVLM_EFORMAT, "%s: the vocabulary is empty", path); goto done; }
    int n = (int)max_id + 1;
    if (n_rows > 0 && n > n_rows) {
        rc = util_err_set(err, KVLM_EFORMAT, "%s: %d tokens, but the embedding has %d rows (config.json vocab_size)",
                          path, n, n_rows);
        goto done;
    }
    /* rows past the tokenizer's ids are padding, as llama.cpp's converter names them */
    if (n_rows > n) n = n_rows;
    v->tokens = calloc((size_t)n, sizeof *v->tokens);
    v->lens = calloc((size_t)n, sizeof *v->lens);
    v->scores = calloc((size_t)n, sizeof *v->scores);
    v->types = calloc((size_t)n, sizeof *v->types);
    if (!v->tokens || !v->lens || !v->scores || !v->types) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
    v->n_tokens = n;
    json_object_foreach(jvocab, key, val) {
        int id = (int)json_integer_value(val);
        if (v->tokens[id]) {
            rc = util_err_set(err, KVLM_EFORMAT, "%s: tokens \"%.40s\" and \"%.40s\" have the same id %d", path,
                              v->tokens[id], key, id);
            goto done;
        }
        if ((rc = set_token(v, id, key, spm && is_byte_token(key) ? VOCAB_T_BYTE : VOCAB_T_NORMAL, err))) goto done;
    }
    json_array_foreach(added, i, val) {
        int id = (int)json_integer_value(json_object_get(val, "id"));
        bool special = json_is_true(json_object_get(val, "special"));
        if ((rc = set_token(v, id, jstr(val, "content"), special ? VOCAB_T_CONTROL : VOCAB_T_USER_DEFINED, err)))
            goto done;
    }
    for (int k = 0; k < n; k++) {
        if (v->tokens[k]) continue;
        char pad[32];
        snprintf(pad, sizeof pad, "[PAD%d]", k);
        if ((rc = set_token(v, k, pad, VOCAB_T_UNUSED, err))) goto done;
    }

    n_merges = (int)json_array_size(jmerges);
    if (n_merges > 4 * MAX_VOCAB) { rc = util_err_set(err, KVLM_EFORMAT, "%s: too many merges", path); goto done; }
    if (n_merges && !(merges = calloc((size_t)n_merges, sizeof *merges))) {
        rc = util_err_set(err, KVLM_ENOMEM, "out of memory");
        goto done;
    }
    for (int r = 0; r < n_merges; r++)
        if (!(merges[r] = merge_text(path, json_array_get(jmerges, (size_t)r), (size_t)r, err))) {
            rc = err ? err->code : KVLM_EFORMAT;
            goto done;
        }
    const char *unk = jstr(model, "unk_token");
    v->unk = find_token(v, unk);
    if (v->unk >= 0) v->types[v->unk] = VOCAB_T_UNKNOWN;
    if (spm) {
        snprintf(v->model, sizeof v->model, "llama");
        snprintf(v->pre, sizeof v->pre, "default");
        v->add_space_prefix = pre.prefix_space;
        if ((rc = spm_scores(v, merges, n_merges, err))) goto done;
    } else {
        snprintf(v->model, sizeof v->model, "gpt2");
        /* an unknown name to other readers of a converted file (llama.cpp
         * refuses it rather than guess); kvlm reads the regexes themselves */
        snprintf(v->pre, sizeof v->pre, "kvlm-regex");
        v->merges = merges;
        v->n_merges = n_merges;
        merges = NULL;
        /* the pre-tokenizer's regexes; the engine names them when kvlm knows them */
        v->pre_regex = calloc((size_t)(pre.n_re ? pre.n_re : 1), sizeof *v->pre_regex);
        if (!v->pre_regex) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
        for (int k = 0; k < pre.n_re; k++) { v->pre_regex[k] = pre.re[k]; pre.re[k] = NULL; }
        v->n_pre_regex = pre.n_re;
        v->has_pre_regex = true;
        v->pre_ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
        pre.n_re = 0;
    }

    /* special tokens and flags: tokenizer_config.json, then config.json's ids */
    snprintf(cpath, sizeof cpath, "%s/tokenizer_config.json", dir);
    if (!(tcfg = load_json(cpath, false, err, &rc)) && rc) goto done;
    snprintf(cpath, sizeof cpath, "%s/config.json", dir);
    if (!(mcfg = load_json(cpath, false, err, &rc)) && rc) goto done;
    const char *bos = token_text(json_object_get(tcfg, "bos_token")), *eos = token_text(json_object_get(tcfg, "eos_token"));
    v->bos = find_token(v, bos);
    v->eos = find_token(v, eos);
    v->pad = find_token(v, token_text(json_object_get(tcfg, "pad_token")));
    const char *ukt = token_text(json_object_get(tcfg, "unk_token"));
    if (ukt && find_token(v, ukt) >= 0) v->unk = find_token(v, ukt);
    json_t *bid = json_object_get(mcfg, "bos_token_id"), *eid = json_object_get(mcfg, "eos_token_id");
    if (json_is_array(eid)) eid = json_array_get(eid, 0);
    if (v->bos < 0 && json_is_integer(bid) && json_integer_value(bid) >= 0 && json_integer_value(bid) < n)
        v->bos = (int32_t)json_integer_value(bid);
    if (v->eos < 0 && json_is_integer(eid) && json_integer_value(eid) >= 0 && json_integer_value(eid) < n)
        v->eos = (int32_t)json_integer_value(eid);
    json_t *post = json_object_get(root, "post_processor");
    json_t *ab = json_object_get(tcfg, "add_bos_token"), *ae = json_object_get(tcfg, "add_eos_token");
    const char *bos_text = v->bos >= 0 ? v->tokens[v->bos] : NULL, *eos_text = v->eos >= 0 ? v->tokens[v->eos] : NULL;
    v->add_bos = json_is_boolean(ab) ? json_is_true(ab) : template_adds(post, true, bos_text);
    v->add_eos = json_is_boolean(ae) ? json_is_true(ae) : template_adds(post, false, eos_text);
    json_t *tmpl = json_object_get(tcfg, "chat_template");
    const char *ts = json_string_value(tmpl);
    if (json_is_array(tmpl)) {
        /* named templates: the "default" one, and the others by their names */
        json_array_foreach(tmpl, i, val) {
            const char *name = jstr(val, "name"), *text = jstr(val, "template");
            if (!name || !text) continue;
            if (!strcmp(name, "default")) ts = text;
            else if (!rc && vocab_add_named_template(v, name, strlen(name), text, strlen(text)))
                rc = util_err_set(err, KVLM_ENOMEM, "out of memory");
        }
    }
    if (ts && !(v->chat_template = strdup(ts))) rc = util_err_set(err, KVLM_ENOMEM, "out of memory");
    if (!ts && !rc) rc = template_file(dir, &v->chat_template, err);
done:
    if (merges)
        for (int r = 0; r < n_merges; r++) free(merges[r]);
    free(merges);
    pre_free(&pre);
    json_decref(root);
    json_decref(tcfg);
    json_decref(mcfg);
    return rc;
}

int vocab_from_hf(const char *dir, int n_rows, model_vocab *v, kvlm_error *err) {
    vocab_free(v);
    int rc = load_vocab(dir, n_rows, v, err);
    if (rc) vocab_free(v);
    return rc;
}
