/* tests/test_pretok: every pre-tokenizer of the table: hand-written splits of
 * what sets each apart, the flags that go with them, long hostile runs, and
 * decode(encode(x)) == x through a small byte-level (or raw UTF-8) BPE
 * vocabulary over every one. tests/cli_pretok.sh checks the same table
 * against Python's regex module on a corpus. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "kvlm.h"
#include "model/gguf.h"
#include "model/vocab.h"
#include "tok/pretok.h"
#include "tok/tok.h"
#include "tok/tok_internal.h"
#include "util/utf8.h"

/* ---- splits ------------------------------------------------------------------------------ */

typedef struct {
    char joined[4096];
    size_t o;
    int n;
} joined_chunks;

static int join_chunk(void *ctx, const char *chunk, size_t n) {
    joined_chunks *j = ctx;
    assert_true(n > 0);
    assert_true(j->o + n + 2 < sizeof j->joined);
    if (j->n++) j->joined[j->o++] = '|';
    memcpy(j->joined + j->o, chunk, n);
    j->o += n;
    j->joined[j->o] = 0;
    return 0;
}

/* want: the chunks joined by '|' (no input here holds a '|'). */
static void expect_split(const char *pre, const char *text, const char *want) {
    kvlm_error err = {0};
    tok_pretok *p = tok_pretok_create(pre, &err);
    if (!p) fail_msg("%s: %s", pre, err.msg);
    joined_chunks j = {.o = 0};
    assert_int_equal(tok_pretok_split(p, text, strlen(text), join_chunk, &j, &err), 0);
    if (strcmp(j.joined, want) != 0) fail_msg("%s split of \"%s\":\n  want \"%s\"\n  got  \"%s\"", pre, text, want, j.joined);
    tok_pretok_free(p);
}

/* Written from each regex's meaning; each line shows what tells the
 * pre-tokenizer apart from its neighbours. */
static void test_splits(void **state) {
    (void)state;
    /* default (llama.cpp's fallback): punctuation runs first, digits in
     * threes from the left; GPT-2 keeps " 12345" whole. */
    expect_split("default", "Hello, world!! 12345 x", "Hello|,| world|!!| |123|45| x");
    expect_split("gpt-2", "Hello, world!! 12345 x", "Hello|,| world|!!| 12345| x");
    expect_split("gpt-2", "I'M don't", "I|'|M| don|'t");
    /* Falcon: like default, with '`' among the isolated symbols and no \p{N}+ step. */
    expect_split("falcon", "a+b=`c` 1234", "a|+|b|=`|c|`| |123|4");
    expect_split("default", "a+b=`c` 1234", "a|+|b|=|`|c|`| |123|4");
    /* Llama 3 family and its look-alikes (dbrx, glm4: same split, other flags). */
    expect_split("llama-bpe", "I'M 1234567 ok\t\n\nx", "I|'M| |123|456|7| ok|\t\n\n|x");
    expect_split("dbrx", "I'M 1234567 ok", "I|'M| |123|456|7| ok");
    expect_split("chatglm-bpe", " 很好", " 很好");
    /* jais-2: runs of spaces are cut into 512, 256, ..., 4, 2 or 1. */
    expect_split("jais-2", "a        b", "a|    |  | | b");
    expect_split("llama3", "a        b", "a|       | b");
    /* Qwen2 family: every digit alone; Qwen 3.5 keeps combining marks on the word. */
    expect_split("qwen2", "cafe\xCC\x81 42", "cafe|\xCC\x81| |4|2");
    expect_split("qwen35", "cafe\xCC\x81 42", "cafe\xCC\x81| |4|2");
    expect_split("megrez", "I'VE 42", "I|'VE| |4|2");
    /* StarCoder family: digits alone first, then GPT-2's. */
    expect_split("mellum2", "ab 123", "ab| |1|2|3");
    /* DeepSeek LLM: newlines alone, Latin/Greek/Cyrillic words, punctuation
     * (ASCII and full-width) with a leading space, trailing spaces, CJK and
     * Hangul runs, digit runs whole. */
    expect_split("deepseek-llm", "Hello world\n\n你好123 ！！ok  ", "Hello| world|\n|\n|你好|123| ！！|ok|  ");
    expect_split("deepseek-llm", "Привет мир 안녕", "Привет| мир| |안녕");
    /* DeepSeek Coder: any letters, punctuation (not symbols) runs, digits alone. */
    expect_split("deepseek-coder", "x = foo(1, 22)\n", "x| =| foo|(|1|,| |2|2|)|\n");
    /* DeepSeek V3: digits in threes, Han and kana alone (no leading space),
     * ASCII punctuation may lead an ASCII word only, marks stay on letters. */
    expect_split("deepseek-v3", "Hello, World! 1234567 很好\n\n", "Hello|,| World|!| |123|456|7| |很好|\n\n");
    expect_split("deepseek-v3", ".hello x.\xC3\xA9t\xC3\xA9 e\xCC\x81", ".hello| x|.|\xC3\xA9t\xC3\xA9| e\xCC\x81");
    expect_split("llama-bpe", ".hello x.\xC3\xA9t\xC3\xA9 e\xCC\x81", ".hello| x|.\xC3\xA9t\xC3\xA9| e|\xCC\x81");
    expect_split("hunyuan-dense", "1234", "123|4");
    /* Spark 2.5: symbol runs without their newlines, newlines one by one, digits alone at the end. */
    expect_split("spark2_5", "ok!\n\n1234", "ok|!|\n|\n|1|2|3|4");
    expect_split("deepseek-v3", "ok!\n\n1234", "ok|!\n\n|123|4");
    /* Youtu: Hangul, CJK punctuation, bopomofo, Han/kana runs first; then
     * real upper/lower-case classes, digits alone. */
    expect_split("youtu", "안녕하세요！ HelloWorld 123", "안녕하세요|！| Hello|World| |1|2|3");
    /* AFMoE: digit runs in threes from the right. */
    expect_split("afmoe", "x1234567y 12", "x|1|234|567|y| |12");
    /* BLOOM family: a space and everything up to whitespace or sentence
     * punctuation (digits included); Viking then cuts digits. */
    expect_split("bloom", "Hello, world! How are you?", "Hello|,| world|!| How| are| you|?");
    expect_split("poro-chat", "a  b (x) abc123", "a| | b| (|x|)| abc123");
    expect_split("gpt3-finnish", "Hei。Moi", "Hei|。|Moi");
    expect_split("viking", "abc123 x", "abc|1|2|3| x");
    /* Tekken: case changes split words, digits alone, no contractions. */
    expect_split("tekken", "HelloWorld ABCdef HELLOworld 123", "Hello|World| ABCdef| HELLOworld| |1|2|3");
    expect_split("tekken", "don't x/\ny", "don|'t| x|/\n|y");
    /* GPT-4o family: the same cases, contractions ride on the word, digits in threes. */
    expect_split("gpt-4o", "don't HelloWorld 12345", "don't| Hello|World| |123|45");
    expect_split("llama4", "\xC3\x80\xC3\x89\xC3\x8E x", "\xC3\x80\xC3\x89\xC3\x8E| x");
    /* Granite embedding 97M: combining marks count as letters. */
    expect_split("granite-embed-multi-97m", "cafe\xCC\x81 x", "cafe\xCC\x81| x");
    expect_split("gpt-4o", "cafe\xCC\x81 x", "cafe|\xCC\x81| x");
    /* Chameleon: sentinels and image tokens first (later regexes still cut
     * them, as in llama.cpp: the special-token pass handles them), two or
     * four spaces, digits and punctuation alone. */
    expect_split("chameleon", "<sentinel:12>IMGIMGABZ  x12!", "<|sentinel|:|1|2|>|IMGIMGABZ|  |x|1|2|!");
    expect_split("chameleon", "a   b c", "a|  | b| c");
    /* Tiny Aya: digits in threes from the right where a word boundary ends the run. */
    expect_split("tiny_aya", "1234567 apples", "1|234|567| apples");
    expect_split("tiny_aya", "abc1234", "abc|1|234");
    expect_split("cohere2moe", "1234x", "123|4|x");
    /* Kimi K2: Han runs alone, case-split words with their contractions. */
    expect_split("kimi-k2", "你好World HELLOworld don't x你 12345", "你好|World| HELLOworld| don't| x|你| |123|45");
    /* SuperBPE: digit runs cut in threes from the right by an empty match. */
    expect_split("superbpe", "x1234567y 123456", "x|1|234|567|y |123|456");
    /* BailingMoE: case-insensitive contractions, digits alone. */
    expect_split("bailingmoe", "I'M 42\n\n\nx", "I|'M| |4|2|\n\n\n|x");
    /* Seed-Coder: symbol runs never take the newline. */
    expect_split("seed-coder", "x;\n", "x|;|\n");
    expect_split("qwen2", "x;\n", "x|;\n");
    /* ufakzeka: no contractions, so a suffix after ' stays on it. */
    expect_split("ufakzeka", "x'sy Ankara'da", "x|'sy| Ankara|'da");
    expect_split("qwen2", "x'sy", "x|'s|y");
    /* Laguna: lines first, then Qwen2's. */
    expect_split("laguna", "a \n\nb", "a| |\n\n|b");
    expect_split("qwen2", "a \n\nb", "a| \n\n|b");
    /* EXAONE MoE: words joined by single spaces stay together. */
    expect_split("exaone-moe", "Hello big world!\nx  y", "Hello big world|!\n|x| | y");
    /* MiniCPM 5: digits in threes before anything else. */
    expect_split("minicpm5", "abc 12345", "abc| |123|45");
    /* Gemma 4 style and whitespace: only newlines, or only whitespace. */
    expect_split("gemma4", "a b\n\nc d", "a b|\n\n|c d");
    expect_split("whitespace", "a  b\tc", "a|  |b|\t|c");
    /* \s is Unicode's White_Space: U+180E is not (PCRE2's own \s takes it), U+0085 and U+3000 are. */
    expect_split("gpt-2", "a\xE1\xA0\x8E!", "a|\xE1\xA0\x8E!");
    expect_split("gpt-2", "a\xC2\x85\xC2\x85" "b", "a|\xC2\x85|\xC2\x85|b");
    expect_split("llama-bpe", "a\xE3\x80\x80\xE3\x80\x80" "b", "a|\xE3\x80\x80|\xE3\x80\x80" "b");
}

/* ---- the table ------------------------------------------------------------------------- */

/* Every alias splits as the first name of its row, on a text that exercises
 * most patterns. */
static void test_aliases(void **state) {
    (void)state;
    static const char sample[] = "Hello, World! I'M don't 1234567 x\t\n\n  y 你好 안녕 е\xCC\x81 <sentinel:3>!!";
    int rows = tok_pretok_n_defs();
    assert_true(rows >= 30);
    int names = 0;
    for (int r = 0; r < rows; r++) {
        const char *list = tok_pretok_def_names(r);
        char first[64];
        size_t fl = strcspn(list, "|");
        snprintf(first, sizeof first, "%.*s", (int)fl, list);
        kvlm_error err = {0};
        tok_pretok *p0 = tok_pretok_create(first, &err);
        if (!p0) fail_msg("%s: %s", first, err.msg);
        joined_chunks want = {.o = 0};
        assert_int_equal(tok_pretok_split(p0, sample, sizeof sample - 1, join_chunk, &want, &err), 0);
        for (const char *c = list;;) {
            size_t l = strcspn(c, "|");
            char name[64];
            snprintf(name, sizeof name, "%.*s", (int)l, c);
            tok_pretok *p = tok_pretok_create(name, &err);
            if (!p) fail_msg("%s: %s", name, err.msg);
            joined_chunks got = {.o = 0};
            assert_int_equal(tok_pretok_split(p, sample, sizeof sample - 1, join_chunk, &got, &err), 0);
            assert_string_equal(got.joined, want.joined);
            assert_int_equal(tok_pretok_ignore_merges(p), tok_pretok_ignore_merges(p0));
            assert_int_equal(tok_pretok_add_bos(p), tok_pretok_add_bos(p0));
            tok_pretok_free(p);
            names++;
            if (!c[l]) break;
            c += l + 1;
        }
        tok_pretok_free(p0);
    }
    /* llama.cpp maps 90 names (kvlm adds "gpt2"); none may be lost. */
    assert_int_equal(names, 91);
}

static void test_flags(void **state) {
    (void)state;
    static const struct { const char *pre; bool ignore_merges, add_bos, raw, escape; } cases[] = {
        {"llama-bpe", true, true, false, false},   {"pixtral", true, true, false, false},
        {"dbrx", false, false, false, false},      {"smaug-bpe", false, false, false, false},
        {"tekken", true, true, false, false},      {"chameleon", false, true, false, false},
        {"youtu", true, false, false, false},      {"minicpm5", true, false, false, false},
        {"granite-embed-multi-97m", true, false, false, false},
        {"qwen2", false, false, false, false},     {"gpt-4o", false, false, false, false},
        {"gemma4", false, false, true, true},      {"sarvam-moe", false, false, true, true},
        {"whitespace", false, false, true, false}, {"default", false, false, false, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvlm_error err = {0};
        tok_pretok *p = tok_pretok_create(cases[i].pre, &err);
        if (!p) fail_msg("%s: %s", cases[i].pre, err.msg);
        if (tok_pretok_ignore_merges(p) != cases[i].ignore_merges || tok_pretok_add_bos(p) != cases[i].add_bos ||
            tok_pretok_raw(p) != cases[i].raw || tok_pretok_escape_spaces(p) != cases[i].escape)
            fail_msg("%s: flags %d%d%d%d", cases[i].pre, tok_pretok_ignore_merges(p), tok_pretok_add_bos(p),
                     tok_pretok_raw(p), tok_pretok_escape_spaces(p));
        tok_pretok_free(p);
    }
}

static void test_unknown(void **state) {
    (void)state;
    kvlm_error err = {0};
    assert_null(tok_pretok_create("no-such-pre", &err));
    assert_int_equal(err.code, KVLM_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "\"no-such-pre\""));
    assert_non_null(strstr(err.msg, "tokenizer.ggml.pre"));
    /* The message names one pre-tokenizer of every kind. */
    for (int r = 0; r < tok_pretok_n_defs(); r++) {
        char first[64];
        const char *list = tok_pretok_def_names(r);
        snprintf(first, sizeof first, "%.*s", (int)strcspn(list, "|"), list);
        if (!strstr(err.msg, first)) fail_msg("\"%s\" missing from: %s", first, err.msg);
    }
    /* A name only differing in case is still unknown (llama.cpp compares exactly). */
    assert_null(tok_pretok_create("Qwen2", &err));
    char all[4096];
    tok_pretok_names(all, sizeof all, true);
    assert_non_null(strstr(all, "deepseek-r1-qwen"));
    assert_non_null(strstr(all, "poro-chat"));
}

static int count_chunk(void *ctx, const char *chunk, size_t n) {
    size_t *c = ctx;
    (void)chunk;
    c[0]++;
    c[1] += n;
    return 0;
}

/* Long runs through every row: the chunks cover the text, and no pattern
 * backtracks past PCRE2's limits (the test would time out or warn). */
static void test_hostile(void **state) {
    (void)state;
    size_t big = tu_quick() ? 4000 : 60000;
    char *buf = malloc(big);
    assert_non_null(buf);
    const char *fills[] = {" ", "\n", " \n", "\t ", "1", "a", "A", "\xFF", "\xE4\xB8\xAD", "'s", " \xC3", "e\xCC\x81",
                           "a b ", "!?", "IMGIMG"};
    for (int r = 0; r < tok_pretok_n_defs(); r++) {
        char first[64];
        const char *list = tok_pretok_def_names(r);
        snprintf(first, sizeof first, "%.*s", (int)strcspn(list, "|"), list);
        kvlm_error err = {0};
        tok_pretok *p = tok_pretok_create(first, &err);
        if (!p) fail_msg("%s: %s", first, err.msg);
        for (size_t f = 0; f < sizeof fills / sizeof fills[0]; f++) {
            size_t fl = strlen(fills[f]);
            for (size_t i = 0; i < big; i++) buf[i] = fills[f][i % fl];
            buf[big - 1] = 'x';
            size_t c[2] = {0, 0};
            assert_int_equal(tok_pretok_split(p, buf, big, count_chunk, c, &err), 0);
            if (c[1] != big) fail_msg("%s on \"%s\"...: chunks cover %zu of %zu bytes", first, fills[f], c[1], big);
        }
        tok_pretok_free(p);
    }
    free(buf);
}

/* ---- round trips through a small vocabulary --------------------------------------------------- */

static void vocab_add(model_vocab *v, int *cap, const char *s, size_t n, int32_t type) {
    if (v->n_tokens == *cap) {
        *cap *= 2;
        v->tokens = realloc(v->tokens, (size_t)*cap * sizeof *v->tokens);
        v->lens = realloc(v->lens, (size_t)*cap * sizeof *v->lens);
        v->types = realloc(v->types, (size_t)*cap * sizeof *v->types);
        assert_true(v->tokens && v->lens && v->types);
    }
    char *t = malloc(n + 1);
    assert_non_null(t);
    memcpy(t, s, n);
    t[n] = 0;
    v->tokens[v->n_tokens] = t;
    v->lens[v->n_tokens] = (uint32_t)n;
    v->types[v->n_tokens] = type;
    v->n_tokens++;
}

/* A byte-level vocabulary: the 256 GPT-2 byte characters, then merges of
 * frequent pairs ("Ġ t", "h e", ...), each merge's result a token; or, raw,
 * <0xHH> byte tokens and plain UTF-8 tokens with U+2581 for spaces. */
static void build_vocab(model_vocab *v, const char *pre, bool raw) {
    memset(v, 0, sizeof *v);
    snprintf(v->model, sizeof v->model, "gpt2");
    snprintf(v->pre, sizeof v->pre, "%s", pre);
    int cap = 512;
    v->tokens = malloc((size_t)cap * sizeof *v->tokens);
    v->lens = malloc((size_t)cap * sizeof *v->lens);
    v->types = malloc((size_t)cap * sizeof *v->types);
    v->bos = v->eos = v->unk = v->pad = v->eot = -1;
    static const char *const pairs[][2] = {
        {"t", "h"}, {"th", "e"}, {"i", "n"}, {"a", "n"}, {"e", "r"}, {"o", "n"}, {"1", "2"}, {"12", "3"},
        {"\xE4\xBD\xA0", "\xE5\xA5\xBD"}, {"'", "s"}, {"e", "\xCC\x81"}, {"\n", "\n"}, {"h", "e"}, {"l", "l"},
    };
    const char *sp = raw ? "\xE2\x96\x81" : "\xC4\xA0"; /* how a space is written */
    v->merges = calloc(64, sizeof *v->merges);
    assert_non_null(v->merges);
    if (raw) {
        for (int b = 0; b < 256; b++) {
            char s[8];
            snprintf(s, sizeof s, "<0x%02X>", b);
            vocab_add(v, &cap, s, 6, VOCAB_T_BYTE);
        }
        static const char *const chars[] = {"t", "h", "e", "i", "n", "a", "r", "o", "1", "2", "3", "'", "s", "l",
                                            "\n", "\xE4\xBD\xA0", "\xE5\xA5\xBD", "\xCC\x81", "\xE2\x96\x81"};
        for (size_t i = 0; i < sizeof chars / sizeof chars[0]; i++)
            vocab_add(v, &cap, chars[i], strlen(chars[i]), VOCAB_T_NORMAL);
    } else {
        for (int b = 0; b < 256; b++) {
            char u[4];
            int n = util_utf8_encode(tok_bpe_byte_cp((uint8_t)b), u);
            vocab_add(v, &cap, u, (size_t)n, VOCAB_T_NORMAL);
        }
    }
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0] + 2; i++) {
        char a[32], b[32], m[72];
        if (i < sizeof pairs / sizeof pairs[0]) {
            /* Byte-level tokens spell each byte as its GPT-2 character. */
            const char *src[2] = {pairs[i][0], pairs[i][1]};
            char *dst[2] = {a, b};
            for (int k = 0; k < 2; k++) {
                size_t o = 0;
                for (const char *c = src[k]; *c; c++) {
                    if (raw) dst[k][o++] = *c;
                    else o += (size_t)util_utf8_encode(tok_bpe_byte_cp((uint8_t)*c), dst[k] + o);
                }
                dst[k][o] = 0;
            }
        } else if (i == sizeof pairs / sizeof pairs[0]) {
            snprintf(a, sizeof a, "%s", sp);
            snprintf(b, sizeof b, "th");
        } else {
            snprintf(a, sizeof a, "%sth", sp);
            snprintf(b, sizeof b, "e");
        }
        snprintf(m, sizeof m, "%s %s", a, b);
        v->merges[v->n_merges++] = strdup(m);
        snprintf(m, sizeof m, "%s%s", a, b);
        vocab_add(v, &cap, m, strlen(m), VOCAB_T_NORMAL);
    }
    vocab_add(v, &cap, "<|endoftext|>", 13, VOCAB_T_CONTROL);
}

static void round_trip(const tok_tokenizer *t, const char *pre, const char *s, size_t len) {
    kvlm_error err = {0};
    int n = tok_encode(t, s, len, false, false, NULL, 0, &err);
    if (n < 0) fail_msg("%s: %s", pre, err.msg);
    int32_t *ids = malloc(((size_t)n + 1) * sizeof *ids);
    assert_non_null(ids);
    assert_int_equal(tok_encode(t, s, len, false, false, ids, n, &err), n);
    char *out = malloc(len * 2 + 16);
    assert_non_null(out);
    size_t o = 0;
    for (int i = 0; i < n; i++) {
        int k = tok_token_to_bytes(t, ids[i], false, out + o, len * 2 + 16 - o);
        assert_true(k >= 0);
        o += (size_t)k;
    }
    if (o != len || memcmp(out, s, len) != 0)
        fail_msg("%s: round trip of %zu bytes gave %zu: \"%.*s\" -> \"%.*s\"", pre, len, o, (int)(len < 120 ? len : 120), s,
                 (int)(o < 120 ? o : 120), out);
    free(out);
    free(ids);
}

/* A random string of valid UTF-8 from a pool that mixes what the patterns
 * treat differently. */
static size_t random_text(char *buf, size_t cap, uint64_t *st) {
    static const uint32_t pool[] = {' ', ' ', ' ', '\n', '\t', '\r', 'a', 'e', 'h', 't', 'T', 'H', 'Z', '1', '2',
                                    '3', '0', '\'', 's', 'M', '.', ',', '!', '?', '(', ')', '`', '~', '$', '+', '<',
                                    '/', '_', '-', '"', 0x4F60, 0x597D, 0x4E2D, 0xAC00, 0xD55C, 0x3042, 0x30AB,
                                    0x3000, 0x3002, 0xFF01, 0x2026, 0x0301, 0x00E9, 0x00C9, 0x0410, 0x0430, 0x05D0,
                                    0x0627, 0x0964, 0x0E01, 0x0661, 0x00B2, 0x2167, 0x1F600, 0x1F44D, 0x00A0,
                                    0x2009, 0x180E, 0x0085, 0x2028, 0x017F, 0x212A, 0xFB01, 0x10400, 0x2581};
    size_t n = 1 + (*st >> 33) % 40, o = 0;
    for (size_t i = 0; i < n && o + 4 < cap; i++) {
        *st = *st * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t cp;
        if ((*st >> 60) == 0) {
            /* now and then any scalar value from the first planes */
            cp = (uint32_t)((*st >> 20) % 0x30000);
            if (cp >= 0xD800 && cp < 0xE000) cp = 'x';
        } else {
            cp = pool[(*st >> 33) % (sizeof pool / sizeof pool[0])];
        }
        o += (size_t)util_utf8_encode(cp, buf + o);
    }
    return o;
}

static void test_round_trips(void **state) {
    (void)state;
    static const char *const texts[] = {
        "Hello, World! I'M don't 1234567 x\t\n\n  y",
        "the theory 123 你好 caf\xC3\xA9 e\xCC\x81 \xF0\x9F\x98\x80!!\r\n",
        "  leading and trailing spaces  ",
        "<sentinel:7>IMGIMGABZ    four spaces\n",
        "\xE2\x96\x81 a literal U+2581",
    };
    int iters = tu_quick() ? 50 : 400;
    for (int r = 0; r < tok_pretok_n_defs(); r++) {
        char first[64];
        const char *list = tok_pretok_def_names(r);
        snprintf(first, sizeof first, "%.*s", (int)strcspn(list, "|"), list);
        kvlm_error err = {0};
        tok_pretok *p = tok_pretok_create(first, &err);
        if (!p) fail_msg("%s: %s", first, err.msg);
        bool raw = tok_pretok_raw(p);
        tok_pretok_free(p);
        model_vocab v;
        build_vocab(&v, first, raw);
        tok_tokenizer *t = tok_create(&v, &err);
        if (!t) fail_msg("%s: %s", first, err.msg);
        /* Where spaces are written U+2581, a U+2581 in the text comes back
         * as a space (as with SentencePiece): leave those texts out there. */
        bool escape = t->escape;
        for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
            if (!escape || !strstr(texts[i], "\xE2\x96\x81")) round_trip(t, first, texts[i], strlen(texts[i]));
        uint64_t st = 0x9E3779B97F4A7C15ull + (uint64_t)r;
        char buf[256];
        for (int k = 0; k < iters; k++) {
            size_t n = random_text(buf, sizeof buf - 1, &st);
            buf[n] = 0;
            if (escape && strstr(buf, "\xE2\x96\x81")) continue;
            round_trip(t, first, buf, n);
        }
        /* Any bytes at all, invalid UTF-8 included: byte-level BPE and the
         * raw byte fallback both give them back. */
        for (int k = 0; k < iters; k++) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            size_t n = 1 + (st >> 33) % 48;
            for (size_t i = 0; i < n; i++) {
                st = st * 6364136223846793005ull + 1442695040888963407ull;
                buf[i] = (char)(st >> 56);
            }
            if (escape && memmem(buf, n, "\xE2\x96\x81", 3)) continue;
            round_trip(t, first, buf, n);
        }
        /* The merges did run: " the" is one token in both kinds of vocabulary
         * (unless the pre-tokenizer cuts the space off the word). */
        int32_t ids[8];
        int n = tok_encode(t, "the", 3, false, false, ids, 8, &err);
        assert_int_equal(n, 1);
        tok_free(t);
        vocab_free(&v);
    }
}

/* Raw vocabularies encode as llama.cpp does for Gemma 4: spaces as U+2581,
 * characters merged by rank, the rest as <0xHH> tokens. */
static void test_raw_encoding(void **state) {
    (void)state;
    model_vocab v;
    build_vocab(&v, "gemma4", true);
    kvlm_error err = {0};
    tok_tokenizer *t = tok_create(&v, &err);
    if (!t) fail_msg("%s", err.msg);
    int32_t ids[16];
    /* " the": U+2581 + t + h + e; "t h" and "th e" rank before "▁ th",
     * so the merges end at ▁ + the. */
    int n = tok_encode(t, " the", 4, false, false, ids, 16, &err);
    assert_int_equal(n, 2);
    char piece[16];
    assert_int_equal(tok_token_to_bytes(t, ids[0], false, piece, sizeof piece), 1);
    assert_memory_equal(piece, " ", 1);
    assert_int_equal(tok_token_to_bytes(t, ids[1], false, piece, sizeof piece), 3);
    assert_memory_equal(piece, "the", 3);
    assert_string_equal(v.tokens[ids[0]], "\xE2\x96\x81");
    /* 'Z' is no token: its byte token <0x5A>. */
    n = tok_encode(t, "Z", 1, false, false, ids, 16, &err);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], 0x5A);
    /* A newline run that is a token is taken whole. */
    n = tok_encode(t, "\n\n", 2, false, false, ids, 16, &err);
    assert_int_equal(n, 1);
    assert_int_equal(tok_token_to_bytes(t, ids[0], false, piece, sizeof piece), 2);
    tok_free(t);
    vocab_free(&v);
}

/* Without tokenizer.ggml.add_bos_token, kvlm_add_bos follows the
 * pre-tokenizer (Llama 3 adds BOS, Qwen2 does not), as llama.cpp does; the
 * key, when there, wins. */
static bool load_add_bos(const char *pre, int key) {
    static const char *const toks[] = {"a", "b", "<|begin_of_text|>"};
    gguf_writer *w = gguf_writer_create();
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    gguf_writer_set_str(w, "tokenizer.ggml.pre", pre);
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
    static const int32_t types[] = {1, 1, 3};
    gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", types, 3);
    static const char *const merges[] = {"a b"};
    gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, 1);
    gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 2);
    if (key >= 0) gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", key);
    void *mem;
    size_t size;
    kvlm_error err = {0};
    assert_int_equal(gguf_writer_write_mem(w, &mem, &size, &err), KVLM_OK);
    gguf_writer_free(w);
    const char *path = tu_tmp_path(".gguf");
    assert_int_equal(tu_write_file(path, mem, size), 0);
    free(mem);
    kvlm_model_params mp = {0};
    mp.vocab_only = true;
    kvlm_model *m = kvlm_model_load(path, &mp, &err);
    if (!m) fail_msg("%s: %s", pre, err.msg);
    bool add = kvlm_add_bos(m);
    /* The pre-tokenizer's chunks through the public API. */
    size_t ends[4];
    assert_int_equal(kvlm_pretokenize(m, NULL, "ab  a", 5, ends, 4, &err), 3);
    assert_int_equal(ends[0], 2);
    assert_int_equal(ends[2], 5);
    kvlm_model_free(m);
    return add;
}

static void test_default_add_bos(void **state) {
    (void)state;
    assert_true(load_add_bos("llama-bpe", -1));
    assert_true(load_add_bos("tekken", -1));
    assert_false(load_add_bos("llama-bpe", 0));
    assert_false(load_add_bos("qwen2", -1));
    assert_true(load_add_bos("qwen2", 1));
    /* kvlm_pretokenize with a name needs no model; an unknown one is refused. */
    kvlm_error err = {0};
    size_t ends[8];
    assert_int_equal(kvlm_pretokenize(NULL, "qwen2", "x 12", 4, ends, 8, &err), 4);
    assert_int_equal(ends[3], 4);
    assert_int_equal(kvlm_pretokenize(NULL, "no-such", "x", 1, ends, 8, &err), -1);
    assert_int_equal(err.code, KVLM_EUNSUPPORTED);
    assert_int_equal(kvlm_pretokenize(NULL, NULL, "x", 1, ends, 8, &err), -1);
}

/* Real text through every pre-tokenizer and the small vocabulary. */
static void test_corpus_round_trips(void **state) {
    (void)state;
    const char *path = tu_corpus_path("wiki.test.raw");
    if (!path) skip();
    size_t len;
    char *text = tu_read_file(path, &len);
    assert_non_null(text);
    if (len > 30000) len = 30000;
    while (len > 0 && ((unsigned char)text[len] & 0xC0) == 0x80) len--; /* whole characters */
    for (int r = 0; r < tok_pretok_n_defs(); r++) {
        char first[64];
        const char *list = tok_pretok_def_names(r);
        snprintf(first, sizeof first, "%.*s", (int)strcspn(list, "|"), list);
        kvlm_error err = {0};
        tok_pretok *p = tok_pretok_create(first, &err);
        if (!p) fail_msg("%s: %s", first, err.msg);
        bool raw = tok_pretok_raw(p);
        tok_pretok_free(p);
        model_vocab v;
        build_vocab(&v, first, raw);
        tok_tokenizer *t = tok_create(&v, &err);
        if (!t) fail_msg("%s: %s", first, err.msg);
        round_trip(t, first, text, len);
        tok_free(t);
        vocab_free(&v);
    }
    free(text);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_splits),     cmocka_unit_test(test_aliases),     cmocka_unit_test(test_flags),
        cmocka_unit_test(test_unknown),    cmocka_unit_test(test_hostile),     cmocka_unit_test(test_round_trips),
        cmocka_unit_test(test_raw_encoding), cmocka_unit_test(test_default_add_bos),
        cmocka_unit_test(test_corpus_round_trips),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
