/* tok/pretok: byte-level BPE pre-tokenizers: each pre name maps to one or
 * more regexes; text is split by the first, each piece by the next, and so
 * on, keeping both the matches and the gaps between them (as llama.cpp and
 * Hugging Face's "Isolated" split do). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tok/pretok.h"
#include <pcre2.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "util/error.h"
#include "util/log.h"

/* GPT-2's pattern. The trailing \s+ catches a lone whitespace character
 * before a non-space that no other branch takes. */
#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
/* Llama 3 and Qwen2 write the contractions as (?i:...); spelled out here so
 * case folding cannot reach beyond ASCII (PCRE2 would let 'ſ' match 's'). */
#define RE_CONTRACTIONS "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
#define RE_LLAMA3 RE_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}" \
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_QWEN2 RE_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}" \
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

#define MAX_RE 3
typedef struct {
    const char *names; /* '|'-separated pre values */
    const char *re[MAX_RE];
    bool ignore_merges;
} pre_def;

static const pre_def PRE_DEFS[] = {
    {"default|gpt-2|gpt2|mpt|olmo|jais", {RE_GPT2}, false},
    {"llama-bpe|llama3|llama-v3|smaug-bpe|dbrx", {RE_LLAMA3}, true},
    {"qwen2|stablelm2|deepseek-r1-qwen", {RE_QWEN2}, false},
    /* Digits one at a time first, then GPT-2's pattern. */
    {"starcoder|refact|command-r|smollm|codeshell|exaone|minerva-7b", {"\\p{N}", RE_GPT2}, false},
};
#define N_PRE_DEFS (sizeof PRE_DEFS / sizeof PRE_DEFS[0])

struct tok_pretok {
    pcre2_code *re[MAX_RE];
    int n_re;
    bool ignore_merges;
};

static bool name_in(const char *names, const char *name) {
    size_t n = strlen(name);
    for (const char *p = names;;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && memcmp(p, name, n) == 0) return true;
        if (!bar) return false;
        p = bar + 1;
    }
}

const char *tok_pretok_names(char *buf, size_t cap) {
    size_t o = 0;
    if (cap < 4) return "";
    for (size_t i = 0; i < N_PRE_DEFS; i++)
        for (const char *c = PRE_DEFS[i].names; *c && o + 3 < cap; c++) {
            if (*c == '|' || (c == PRE_DEFS[i].names && i > 0)) { buf[o++] = ','; buf[o++] = ' '; }
            if (*c != '|') buf[o++] = *c;
        }
    buf[o] = 0;
    return buf;
}

void tok_pretok_free(tok_pretok *p) {
    if (!p) return;
    for (int i = 0; i < p->n_re; i++) pcre2_code_free(p->re[i]);
    free(p);
}

tok_pretok *tok_pretok_create(const char *pre, kvlm_error *err) {
    const char *name = (pre && *pre) ? pre : "default";
    const pre_def *d = NULL;
    for (size_t i = 0; i < N_PRE_DEFS && !d; i++)
        if (name_in(PRE_DEFS[i].names, name)) d = &PRE_DEFS[i];
    if (!d) {
        char names[400];
        util_err_set(err, KVLM_EUNSUPPORTED, "unknown pre-tokenizer \"%s\" (tokenizer.ggml.pre); supported: %s",
                     name, tok_pretok_names(names, sizeof names));
        return NULL;
    }
    tok_pretok *p = calloc(1, sizeof *p);
    if (!p) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    p->ignore_merges = d->ignore_merges;
    for (int i = 0; i < MAX_RE && d->re[i]; i++) {
        int ec;
        PCRE2_SIZE eo;
        /* MATCH_INVALID_UTF: arbitrary bytes are allowed in the subject;
         * invalid sequences simply never match and end up as gap chunks. */
        pcre2_code *re = pcre2_compile((PCRE2_SPTR)d->re[i], PCRE2_ZERO_TERMINATED,
                                       PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &ec, &eo, NULL);
        if (!re) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(ec, msg, sizeof msg);
            util_err_set(err, KVLM_EINVAL, "pre-tokenizer \"%s\": regex error at %zu: %s", name, (size_t)eo,
                         (const char *)msg);
            tok_pretok_free(p);
            return NULL;
        }
        (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* the interpreter is the fallback */
        p->re[p->n_re++] = re;
    }
    return p;
}

bool tok_pretok_ignore_merges(const tok_pretok *p) { return p->ignore_merges; }

typedef struct {
    const tok_pretok *p;
    pcre2_match_data *md[MAX_RE];
    pcre2_match_context *mc;
    tok_chunk_fn fn;
    void *ctx;
    kvlm_error *err;
} split_state;

static int split_level(split_state *st, int level, const char *text, size_t len) {
    if (len == 0) return 0;
    if (level == st->p->n_re) return st->fn(st->ctx, text, len);
    const pcre2_code *re = st->p->re[level];
    pcre2_match_data *md = st->md[level];
    size_t off = 0;
    while (off < len) {
        int rc = pcre2_match(re, (PCRE2_SPTR)text, len, off, 0, md, st->mc);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            /* A resource limit of PCRE2: the rest becomes one chunk, which
             * still encodes (and decodes) correctly, only less compactly. */
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            LOG_WARN("pre-tokenizer: %s; %zu bytes left unsplit", (const char *)msg, len - off);
            break;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t s = ov[0], e = ov[1];
        if (e <= s) {
            /* None of the patterns matches empty text; guard anyway so the
             * loop always advances. */
            if (s >= len) break;
            e = s + 1;
        }
        int r;
        if (s > off && (r = split_level(st, level + 1, text + off, s - off))) return r;
        if ((r = split_level(st, level + 1, text + s, e - s))) return r;
        off = e;
    }
    return split_level(st, level + 1, text + off, len - off);
}

int tok_pretok_split(const tok_pretok *p, const char *text, size_t len, tok_chunk_fn fn, void *ctx,
                     kvlm_error *err) {
    split_state st = {.p = p, .fn = fn, .ctx = ctx, .err = err};
    int r = 0;
    /* Match data per call keeps one tokenizer usable from many threads. */
    for (int i = 0; i < p->n_re; i++)
        if (!(st.md[i] = pcre2_match_data_create(1, NULL))) goto nomem;
    if (!(st.mc = pcre2_match_context_create(NULL))) goto nomem;
    /* \s*[\r\n]+ backtracks over a whole run of spaces before \s+(?!\S)
     * takes it: linear work, but past PCRE2's default limit (10 million)
     * for runs of some megabytes. Allow work in proportion to the text. */
    uint64_t limit = 10000000u + 64u * (uint64_t)len;
    pcre2_set_match_limit(st.mc, limit > UINT32_MAX ? UINT32_MAX : (uint32_t)limit);
    r = split_level(&st, 0, text, len);
done:
    pcre2_match_context_free(st.mc);
    for (int i = 0; i < p->n_re; i++) pcre2_match_data_free(st.md[i]);
    return r;
nomem:
    util_err_set(err, KVLM_ENOMEM, "out of memory");
    r = -1;
    goto done;
}

/* ---- pre-tokenizers from regex lists (tokenizer.json) ------------------------ */

/* Hugging Face writes Llama 3's and Qwen2's contractions case-insensitively;
 * the table spells them out (see RE_CONTRACTIONS). */
#define HF_CONTRACTIONS "(?i:'s|'t|'re|'ve|'m|'ll|'d)"

static char *canon_regex(const char *re) {
    size_t n = strlen(re), hl = strlen(HF_CONTRACTIONS), cl = strlen(RE_CONTRACTIONS), extra = 0;
    for (const char *p = strstr(re, HF_CONTRACTIONS); p; p = strstr(p + hl, HF_CONTRACTIONS)) extra += cl;
    char *out = malloc(n + extra + 1), *o = out;
    if (!out) return NULL;
    for (const char *p = re; *p;) {
        if (!strncmp(p, HF_CONTRACTIONS, hl)) { memcpy(o, RE_CONTRACTIONS, cl); o += cl; p += hl; }
        else *o++ = *p++;
    }
    *o = 0;
    return out;
}

bool tok_pretok_find(const char *const *re, int n_re, char *name, size_t cap) {
    if (n_re <= 0 || n_re > MAX_RE) return false;
    char *canon[MAX_RE] = {0};
    bool found = false, ok = true;
    for (int i = 0; i < n_re; i++) ok &= (canon[i] = canon_regex(re[i])) != NULL;
    for (size_t d = 0; ok && d < N_PRE_DEFS && !found; d++) {
        const pre_def *def = &PRE_DEFS[d];
        int k = 0;
        while (k < MAX_RE && def->re[k]) k++;
        if (k != n_re) continue;
        bool same = true;
        for (int i = 0; i < n_re && same; i++) same = !strcmp(def->re[i], canon[i]);
        if (!same) continue;
        const char *bar = strchr(def->names, '|');
        size_t len = bar ? (size_t)(bar - def->names) : strlen(def->names);
        if (cap) {
            if (len >= cap) len = cap - 1;
            memcpy(name, def->names, len);
            name[len] = 0;
        }
        found = true;
    }
    for (int i = 0; i < n_re; i++) free(canon[i]);
    return found;
}

tok_pretok *tok_pretok_create_regex(const char *const *re, int n_re, bool ignore_merges, kvlm_error *err) {
    if (n_re < 0 || n_re > MAX_RE) {
        util_err_set(err, KVLM_EUNSUPPORTED, "pre-tokenizer of %d regexes: at most %d are supported", n_re, MAX_RE);
        return NULL;
    }
    tok_pretok *p = calloc(1, sizeof *p);
    if (!p) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    p->ignore_merges = ignore_merges;
    for (int i = 0; i < n_re; i++) {
        int ec;
        PCRE2_SIZE eo;
        /* as in tok_pretok_create: invalid UTF-8 never matches and becomes gap chunks */
        pcre2_code *c = pcre2_compile((PCRE2_SPTR)re[i], PCRE2_ZERO_TERMINATED,
                                      PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &ec, &eo, NULL);
        if (!c) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(ec, msg, sizeof msg);
            util_err_set(err, KVLM_EFORMAT, "pre-tokenizer regex %d (\"%.60s\"): error at %zu: %s", i, re[i],
                         (size_t)eo, (const char *)msg);
            tok_pretok_free(p);
            return NULL;
        }
        (void)pcre2_jit_compile(c, PCRE2_JIT_COMPLETE);
        p->re[p->n_re++] = c;
    }
    return p;
}
