/* tok/pretok: byte-level BPE pre-tokenizers: every tokenizer.ggml.pre name
 * llama.cpp knows maps to one or more regexes (run through PCRE2) and the
 * flags that go with it; text is split by the first regex, each piece by the
 * next, and so on, keeping both the matches and the gaps between them (as
 * llama.cpp and Hugging Face's "Isolated" split do). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tok/pretok.h"
#include <pcre2.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "util/error.h"
#include "util/log.h"

/* ---- the regexes (llama.cpp's lists; see docs/tokenizers.md) ------------------------ */

/* Contractions are spelled out ([sS] for (?i:s)) as llama.cpp does, so case
 * folding cannot reach beyond ASCII (PCRE2 would let U+017F match 's'). */
#define CONTR "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
/* GPT-2's pattern. llama.cpp writes it without the final \s+, which its own
 * split code has; with the gaps kept the chunks are the same either way. */
#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define RE_LLAMA3 CONTR "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}" \
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_QWEN2 CONTR "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}" \
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
/* Tekken, GPT-4o: "(?=\p{L})[^a-z]" stands for an upper-case letter and
 * "(?=\p{L})[^A-Z]" for a lower-case one, as llama.cpp writes them (its
 * engine has no \p{Lu}): a non-ASCII letter counts as both. */
#define UPPER(cls) "((?=[" cls "])([^a-z]))"
#define LOWER(cls) "((?=[" cls "])([^A-Z]))"
#define RE_CASE_APPROX(cls, contr, num, tail)                                                  \
    "[^\\r\\n\\p{L}\\p{N}]?" UPPER(cls) "*" LOWER(cls) "+" contr "|[^\\r\\n\\p{L}\\p{N}]?" \
    UPPER(cls) "+" LOWER(cls) "*" contr "|" num "| ?[^\\s\\p{L}\\p{N}]+" tail "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
/* The real case classes (Tiny Aya, Youtu). */
#define RE_CASED(num)                                                                            \
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+" CONTR \
    "?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*" CONTR \
    "?|" num "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
/* Kimi K2 (tokenization_kimi.py): the cased classes without Han, which goes
 * alone. PCRE2 10.42 has no class intersection (&&): a lookahead does it.
 * sc=Han: PCRE2's \p{Han} also takes what Script_Extensions gives Han
 * (U+3002 IDEOGRAPHIC FULL STOP, ...); Python's and Rust's do not. */
#define NOHAN(cls) "(?:(?!\\p{sc=Han})[" cls "])"
#define RE_KIMI "\\p{sc=Han}+|[^\\r\\n\\p{L}\\p{N}]?" NOHAN("\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}") "*"          \
    NOHAN("\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}") "+" CONTR "?|[^\\r\\n\\p{L}\\p{N}]?"                             \
    NOHAN("\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}") "+" NOHAN("\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}") "*" CONTR \
    "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
/* DeepSeek V3 and its kin: ASCII punctuation may lead an ASCII word, letters
 * keep their combining marks. */
#define RE_DS3(tail) "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+" \
    "|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+" tail
#define RE_DS3_TAIL "| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_HAN_KANA "[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+"
/* DeepSeek LLM and Coder: Han, everything from U+0800 to U+4E00, Hangul. */
#define RE_DS_CJK "[\\x{4E00}-\\x{9FA5}\\x{800}-\\x{4E00}\\x{AC00}-\\x{D7FF}]+"
/* DeepSeek LLM's letters (Latin, Greek, Cyrillic, Armenian, Georgian, ...). */
#define DS_LETTERS \
    "A-Za-z\\x{B5}\\x{C0}-\\x{D6}\\x{D8}-\\x{F6}\\x{F8}-\\x{1BA}\\x{1BC}-\\x{1BF}\\x{1C4}-\\x{293}" \
    "\\x{295}-\\x{2AF}\\x{370}-\\x{373}\\x{376}\\x{377}\\x{37B}-\\x{37D}\\x{37F}\\x{386}" \
    "\\x{388}-\\x{38A}\\x{38C}\\x{38E}-\\x{3A1}\\x{3A3}-\\x{3F5}\\x{3F7}-\\x{481}\\x{48A}-\\x{52F}" \
    "\\x{531}-\\x{556}\\x{10A0}-\\x{10C5}\\x{13A0}-\\x{13F5}\\x{13F8}-\\x{13FD}\\x{1C90}-\\x{1CBA}" \
    "\\x{1CBD}-\\x{1CBF}\\x{1D00}-\\x{1D2B}\\x{1D6B}-\\x{1D77}\\x{1D79}-\\x{1D9A}\\x{1E00}-\\x{1F15}" \
    "\\x{1F18}-\\x{1F1D}\\x{1F20}-\\x{1F45}\\x{1F48}-\\x{1F4D}\\x{1F50}-\\x{1F57}\\x{1F59}\\x{1F5B}" \
    "\\x{1F5D}\\x{1F5F}-\\x{1F7D}\\x{1F80}-\\x{1FB4}\\x{1FB6}-\\x{1FBC}\\x{1FBE}\\x{1FC2}-\\x{1FC4}" \
    "\\x{1FC6}-\\x{1FCC}\\x{1FD0}-\\x{1FD3}\\x{1FD6}-\\x{1FDB}\\x{1FE0}-\\x{1FEC}\\x{1FF2}-\\x{1FF4}" \
    "\\x{1FF6}-\\x{1FFC}\\x{2102}\\x{2107}\\x{210A}-\\x{2113}\\x{2115}\\x{2119}-\\x{211D}\\x{2124}" \
    "\\x{2126}\\x{2128}\\x{212A}-\\x{212D}\\x{212F}-\\x{2134}\\x{2139}\\x{213C}-\\x{213F}" \
    "\\x{2145}-\\x{2149}\\x{214E}\\x{2183}\\x{2184}\\x{2C00}-\\x{2C7B}\\x{2C7E}-\\x{2CE4}" \
    "\\x{2CEB}-\\x{2CEE}\\x{2CF2}\\x{2CF3}\\x{A640}-\\x{A66D}\\x{A680}-\\x{A69B}\\x{A722}-\\x{A76F}" \
    "\\x{A771}-\\x{A787}\\x{A78B}-\\x{A78E}\\x{AB70}-\\x{ABBF}\\x{FB00}-\\x{FB06}\\x{FB13}-\\x{FB17}" \
    "\\x{FF21}-\\x{FF3A}\\x{FF41}-\\x{FF5A}\\x{10400}-\\x{1044F}\\x{104B0}-\\x{104D3}" \
    "\\x{104D8}-\\x{104FB}\\x{10C80}-\\x{10CB2}\\x{10CC0}-\\x{10CF2}\\x{118A0}-\\x{118DF}" \
    "\\x{1E900}-\\x{1E943}"
/* ASCII and full-width punctuation, curly quotes, U+3000-U+3002. */
#define DS_PUNCT "!-/:-~\\x{FF01}-\\x{FF0F}\\x{FF1A}-\\x{FF5E}\\x{2018}-\\x{201F}\\x{3000}-\\x{3002}"
/* BLOOM: an optional space, then anything but whitespace and sentence
 * punctuation (the parentheses and '|' in the class are literal). */
#define RE_BLOOM " ?[^(\\s|.,!?\\x{2026}\\x{3002}\\x{FF0C}\\x{3001}\\x{964}\\x{6D4}\\x{60C})]+"
/* AFMoE's CJK, kana, Thai, Lao, Khmer, Myanmar and Hangul ranges. */
#define RE_AFMOE_CJK "[\\x{4E00}-\\x{9FFF}\\x{3400}-\\x{4DBF}\\x{F900}-\\x{FAFF}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}" \
    "\\x{FF65}-\\x{FF9F}\\x{2F00}-\\x{2FDF}\\x{E40}-\\x{E7F}\\x{E80}-\\x{EFF}\\x{1780}-\\x{17FF}\\x{1000}-\\x{109F}"   \
    "\\x{AA60}-\\x{AA7F}\\x{A9E0}-\\x{A9FF}\\x{AC00}-\\x{D7AF}\\x{1100}-\\x{11FF}]+"
#define RE_LINES "[^\\n]+|[\\n]+"
/* Not plain regexes: runs of digits cut into threes from the right, the
 * first group taking what is left over ("1234567" -> 1|234|567). A regex
 * says it with a lookahead over the rest of the run at every position,
 * which is quadratic in the run's length; here the regex after "=thirds:"
 * finds the runs, which become chunks of their own cut into threes, and
 * the one after "=cuts:" finds runs that are only cut where a group of
 * three starts (the text around them stays joined).
 * AFMoE: llama.cpp's own \p{AFMoE_digits} code, on runs of \p{N}. */
#define THIRDS_AFMOE "=thirds:\\p{N}+"
/* SuperBPE: the empty match "(?=(\d{3})+(?!\d))" cuts a run of \d where a
 * multiple of three digits is left. */
#define CUTS_SUPERBPE "=cuts:\\d+"
/* Tiny Aya: "\d{1,3}(?=(?:\d{3})*\b)" only matches in a run of \d that no
 * word character follows (\w as Python, Rust and Oniguruma have it). */
#define THIRDS_AYA "=thirds:(?<!\\d)\\d++(?![\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}])"

#define MAX_RE 6
enum { F_IGNORE_MERGES = 1, F_ADD_BOS = 2, F_RAW = 4, F_ESCAPE = 8 };
typedef struct {
    const char *names; /* '|'-separated pre values */
    const char *re[MAX_RE];
    unsigned flags;
} pre_def;

static const pre_def PRE_DEFS[] = {
    /* llama.cpp's fallback (no or "default" pre): punctuation runs, then
     * GPT-2's pattern, then digits cut into threes from the left. */
    {"default", {"[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"}, 0},
    {"gpt-2|gpt2|phi-2|jina-es|jina-de|gigachat|jina-v2-es|jina-v2-de|a.x-4.0|mellum|modern-bert|jina-v1-en"
     "|jina-v2-code|roberta-bpe|exaone4|mpt|olmo|jais|trillion|granite-docling",
     {RE_GPT2}, 0},
    {"llama-bpe|llama3|llama-v3|falcon3|falcon-h1|pixtral|midm-2.0|lfm2|jina-v5-nano", {RE_LLAMA3},
     F_IGNORE_MERGES | F_ADD_BOS},
    {"dbrx|smaug-bpe|glm4|chatglm-bpe", {RE_LLAMA3}, 0},
    {"jais-2",
     {CONTR "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
            "|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)"
            "|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}"},
     0},
    {"qwen2|deepseek-r1-qwen|kormo|f2llmv2|megrez|stablelm2|hunyuan|solar-open|grok-2", {RE_QWEN2}, 0},
    {"qwen35",
     {CONTR "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
            "|\\s+(?!\\S)|\\s+"},
     0},
    /* Digits one at a time first, then GPT-2's pattern. */
    {"starcoder|refact|command-r|smollm|codeshell|exaone|minerva-7b|mellum2", {"\\p{N}", RE_GPT2}, 0},
    {"falcon", {"[\\p{P}\\$\\+<=>\\^~\\|`]+", RE_GPT2, "[0-9][0-9][0-9]"}, 0},
    {"deepseek-llm",
     {"[\\r\\n]", "\\s?[" DS_LETTERS "]+", "\\s?[" DS_PUNCT "]+", "\\s+$", RE_DS_CJK, "\\p{N}+"}, 0},
    {"deepseek-coder", {"[\\r\\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", RE_DS_CJK, "\\p{N}"}, 0},
    {"deepseek-v3|hunyuan-dense|hy_v4|joyai-llm", {"\\p{N}{1,3}", RE_HAN_KANA, RE_DS3(RE_DS3_TAIL)}, 0},
    {"spark2_5",
     {"\\p{N}{1,3}", RE_HAN_KANA, RE_DS3("| ?[\\p{P}\\p{S}]+|[\\r\\n]|\\s+(?!\\S)|\\s+"), "\\p{N}"}, 0},
    {"youtu",
     {"[\\x{AC00}-\\x{D7A3}\\x{3131}-\\x{318E}]+"
      "|[\\x{FF01}\\x{2026}\\x{201C}\\x{201D}\\x{2018}\\x{2019}\\x{2014}\\x{FF1A}\\x{FF1B}\\x{FF0C}\\x{3001}-\\x{303F}"
      "\\x{FE30}-\\x{FE4F}]+|[\\x{3105}-\\x{312F}]+|" RE_HAN_KANA,
      RE_CASED("\\p{N}")},
     F_IGNORE_MERGES},
    /* AFMoE: digit runs cut into threes from the right (llama.cpp's own
     * \p{AFMoE_digits} code), then CJK and other scripts, then DeepSeek V3's. */
    {"afmoe", {THIRDS_AFMOE, RE_AFMOE_CJK, RE_DS3(RE_DS3_TAIL)}, 0},
    {"bloom|gpt3-finnish|poro-chat", {RE_BLOOM}, 0},
    {"viking", {RE_BLOOM, "\\p{N}"}, 0},
    {"tekken", {RE_CASE_APPROX("\\p{L}", "", "\\p{N}", "[\\r\\n/]*")}, F_IGNORE_MERGES | F_ADD_BOS},
    /* Chameleon: sentinel and image tokens whole, then tabs, newlines and
     * two or four spaces, digits and punctuation alone, then GPT-2's. */
    {"chameleon",
     {"<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", "\\p{N}",
      "[\\p{P}!-/:-@\\[-`{-~]", RE_GPT2},
     F_ADD_BOS},
    {"gpt-4o|llama4|kanana2|talkie|minimax-m2",
     {RE_CASE_APPROX("\\p{L}", CONTR "?", "\\p{N}{1,3}", "[\\r\\n/]*")}, 0},
    {"granite-embed-multi-97m",
     {RE_CASE_APPROX("\\p{L}\\p{M}", CONTR "?", "\\p{N}{1,3}", "[\\r\\n/]*")}, F_IGNORE_MERGES},
    {"tiny_aya|cohere2moe", {THIRDS_AYA, RE_CASED("\\p{N}{1,3}")}, 0},
    {"kimi-k2", {RE_KIMI}, 0},
    /* SuperBPE: digit runs alone, cut into threes from the right by an
     * empty lookahead match. */
    {"superbpe", {"\\p{N}+", CUTS_SUPERBPE}, 0},
    {"bailingmoe|bailingmoe2|llada-moe",
     {"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
      "|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"},
     0},
    {"seed-coder",
     {CONTR "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, 0},
    /* Qwen2's without the contractions (Turkish suffixes stay on the word). */
    {"ufakzeka", {"[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, 0},
    {"laguna", {RE_LINES, RE_QWEN2}, 0},
    /* EXAONE MoE: words joined by single spaces stay one chunk. */
    {"exaone-moe",
     {CONTR "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?"
            "|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"},
     0},
    {"minicpm5",
     {"\\p{N}{1,3}", CONTR "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
                     "|\\s+(?!\\S)|\\s+"},
     F_IGNORE_MERGES},
    /* Gemma 4 style: spaces become U+2581, only newlines split, and the
     * tokens are UTF-8 text with <0xHH> byte fallback (no GPT-2 bytes). */
    {"gemma4|granite-embed-multi-311m|sarvam-moe", {RE_LINES}, F_RAW | F_ESCAPE},
    {"whitespace", {"\\S+"}, F_RAW},
};
#define N_PRE_DEFS (sizeof PRE_DEFS / sizeof PRE_DEFS[0])

struct tok_pretok {
    pcre2_code *re[MAX_RE];
    char mode[MAX_RE]; /* 'r': regex, 't': "=thirds:", 'c': "=cuts:" */
    int n_re;
    unsigned flags;
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

const char *tok_pretok_names(char *buf, size_t cap, bool aliases) {
    size_t o = 0;
    if (cap < 4) return "";
    for (size_t i = 0; i < N_PRE_DEFS; i++)
        for (const char *c = PRE_DEFS[i].names; *c && o + 3 < cap; c++) {
            if (*c == '|' && !aliases) break;
            if (*c == '|' || (c == PRE_DEFS[i].names && i > 0)) { buf[o++] = ','; buf[o++] = ' '; }
            if (*c != '|') buf[o++] = *c;
        }
    buf[o] = 0;
    return buf;
}

int tok_pretok_n_defs(void) { return (int)N_PRE_DEFS; }

const char *tok_pretok_def_names(int i) { return i >= 0 && i < (int)N_PRE_DEFS ? PRE_DEFS[i].names : NULL; }

void tok_pretok_free(tok_pretok *p) {
    if (!p) return;
    for (int i = 0; i < p->n_re; i++) pcre2_code_free(p->re[i]);
    free(p);
}

/* \s as llama.cpp (and Python, and Unicode's White_Space) mean it: PCRE2's
 * own \s (and \p{Xsp}) also take U+180E MONGOLIAN VOWEL SEPARATOR. */
#define WS_SET "\\t-\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"

/* Copies re with \s and \S spelled as WS_SET; NULL if out of memory. */
static char *expand_ws(const char *re) {
    size_t n = strlen(re), o = 0, cap = n + 1;
    for (size_t i = 0; i < n; i++) cap += re[i] == '\\' ? sizeof "[^" WS_SET "]" : 0;
    char *out = malloc(cap);
    if (!out) return NULL;
    bool in_class = false;
    for (size_t i = 0; i < n; i++) {
        char c = re[i];
        if (c == '\\' && i + 1 < n) {
            char d = re[i + 1];
            const char *rep = NULL;
            if (d == 's') rep = in_class ? WS_SET : "[" WS_SET "]";
            else if (d == 'S' && !in_class) rep = "[^" WS_SET "]";
            if (rep) {
                size_t l = strlen(rep);
                memcpy(out + o, rep, l);
                o += l;
            } else {
                out[o++] = c;
                out[o++] = d;
            }
            i++;
            continue;
        }
        /* A ']' right after "[" or "[^" would be literal; no pattern here has one. */
        if (c == '[' && !in_class) in_class = true;
        else if (c == ']' && in_class) in_class = false;
        out[o++] = c;
    }
    out[o] = 0;
    return out;
}

tok_pretok *tok_pretok_create(const char *pre, kvlm_error *err) {
    /* No pre at all is llama.cpp's "default" too (which warns of it). */
    const char *name = (pre && *pre) ? pre : "default";
    if (!pre || !*pre) LOG_WARN("tokenizer: no tokenizer.ggml.pre; using llama.cpp's \"default\" pre-tokenizer");
    const pre_def *d = NULL;
    for (size_t i = 0; i < N_PRE_DEFS && !d; i++)
        if (name_in(PRE_DEFS[i].names, name)) d = &PRE_DEFS[i];
    if (!d) {
        /* The message has room for one name per row; the log gets them all. */
        char names[400], all[4096];
        LOG_DEBUG("pre-tokenizers: %s", tok_pretok_names(all, sizeof all, true));
        util_err_set(err, KVLM_EUNSUPPORTED,
                     "unknown pre-tokenizer \"%.40s\" (tokenizer.ggml.pre); supported: %s and their aliases "
                     "(docs/tokenizers.md)",
                     name, tok_pretok_names(names, sizeof names, false));
        return NULL;
    }
    tok_pretok *p = calloc(1, sizeof *p);
    if (!p) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    p->flags = d->flags;
    for (int i = 0; i < MAX_RE && d->re[i]; i++) {
        int ec;
        PCRE2_SIZE eo;
        const char *re_src = d->re[i];
        char mode = 'r';
        if (!strncmp(re_src, "=thirds:", 8)) mode = 't', re_src += 8;
        else if (!strncmp(re_src, "=cuts:", 6)) mode = 'c', re_src += 6;
        char *src = expand_ws(re_src);
        if (!src) { util_err_set(err, KVLM_ENOMEM, "out of memory"); tok_pretok_free(p); return NULL; }
        /* MATCH_INVALID_UTF: arbitrary bytes are allowed in the subject;
         * invalid sequences simply never match and end up as gap chunks.
         * DOLLAR_ENDONLY: '$' is the end of the piece, never before a final
         * newline (as in llama.cpp's std::regex and Hugging Face's Rust). */
        pcre2_code *re = pcre2_compile((PCRE2_SPTR)src, PCRE2_ZERO_TERMINATED,
                                       PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | PCRE2_DOLLAR_ENDONLY,
                                       &ec, &eo, NULL);
        free(src);
        if (!re) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(ec, msg, sizeof msg);
            util_err_set(err, KVLM_EINVAL, "pre-tokenizer \"%s\": regex %d: error at %zu: %s", name, i + 1,
                         (size_t)eo, (const char *)msg);
            tok_pretok_free(p);
            return NULL;
        }
        (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* the interpreter is the fallback */
        p->mode[p->n_re] = mode;
        p->re[p->n_re++] = re;
    }
    return p;
}

bool tok_pretok_ignore_merges(const tok_pretok *p) { return p->flags & F_IGNORE_MERGES; }
bool tok_pretok_add_bos(const tok_pretok *p) { return p->flags & F_ADD_BOS; }
bool tok_pretok_raw(const tok_pretok *p) { return p->flags & F_RAW; }
bool tok_pretok_escape_spaces(const tok_pretok *p) { return p->flags & F_ESCAPE; }

typedef struct {
    const tok_pretok *p;
    pcre2_match_data *md[MAX_RE];
    pcre2_match_context *mc;
    pcre2_jit_stack *js; /* made when the default 32 KiB is not enough */
    tok_chunk_fn fn;
    void *ctx;
    kvlm_error *err;
} split_state;

/* Length of the UTF-8 sequence that starts with byte b (1 for a stray byte). */
static size_t utf8_step(const char *text, size_t pos, size_t len) {
    unsigned char b = (unsigned char)text[pos];
    size_t n = b < 0xC0 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    size_t k = 1;
    while (k < n && pos + k < len && ((unsigned char)text[pos + k] & 0xC0) == 0x80) k++;
    return k;
}

static int split_level(split_state *st, int level, const char *text, size_t len);

/* pcre2_match, with room to spare when a long run needs it: patterns that
 * repeat a group ("((?=[\p{L}])([^a-z]))*", "(?:\p{L}\p{M}*)+") take JIT
 * stack in proportion to the run. First a bigger JIT stack, then the
 * interpreter (whose heap limit grows with the text). */
static int match(split_state *st, const pcre2_code *re, const char *text, size_t len, size_t pos, uint32_t opts,
                 pcre2_match_data *md) {
    int rc = pcre2_match(re, (PCRE2_SPTR)text, len, pos, opts, md, st->mc);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !st->js) {
        if ((st->js = pcre2_jit_stack_create(64 * 1024, 256 * 1024 * 1024, NULL))) {
            pcre2_jit_stack_assign(st->mc, NULL, st->js);
            rc = pcre2_match(re, (PCRE2_SPTR)text, len, pos, opts, md, st->mc);
        }
    }
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) rc = pcre2_match(re, (PCRE2_SPTR)text, len, pos, opts | PCRE2_NO_JIT, md, st->mc);
    return rc;
}

/* "=thirds:" and "=cuts:": the run text[s, e) is cut where a group of three
 * characters starts, counting from its end; *off is where the pending text
 * starts. thirds: the run is a chunk of its own (cut at s and e too). */
static int split_run(split_state *st, int level, const char *text, size_t *off, size_t s, size_t e, bool thirds) {
    size_t n = 0; /* characters in the run */
    for (size_t i = s; i < e; i += utf8_step(text, i, e)) n++;
    size_t k = 0;
    int r;
    if (thirds && s > *off) {
        if ((r = split_level(st, level + 1, text + *off, s - *off))) return r;
        *off = s;
    }
    for (size_t i = s; i < e; i += utf8_step(text, i, e), k++) {
        if ((n - k) % 3 || n - k < 3 || i <= *off) continue;
        if ((r = split_level(st, level + 1, text + *off, i - *off))) return r;
        *off = i;
    }
    if (thirds && e > *off) {
        if ((r = split_level(st, level + 1, text + *off, e - *off))) return r;
        *off = e;
    }
    return 0;
}

static int split_level(split_state *st, int level, const char *text, size_t len) {
    if (len == 0) return 0;
    if (level == st->p->n_re) return st->fn(st->ctx, text, len);
    const pcre2_code *re = st->p->re[level];
    pcre2_match_data *md = st->md[level];
    size_t off = 0; /* start of the text not yet emitted */
    size_t pos = 0; /* where the next search starts */
    uint32_t opts = 0;
    while (pos <= len) {
        int rc = match(st, re, text, len, pos, opts, md);
        if (rc == PCRE2_ERROR_NOMATCH) {
            if (!opts) break;
            /* No non-empty match where an empty one was: step one character on. */
            opts = 0;
            if (pos >= len) break;
            pos += utf8_step(text, pos, len);
            continue;
        }
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
        int r;
        char mode = st->p->mode[level];
        if (mode != 'r') {
            if ((r = split_run(st, level, text, &off, s, e, mode == 't'))) return r;
            pos = e > s ? e : s + utf8_step(text, s, len);
            continue;
        }
        if (s > off && (r = split_level(st, level + 1, text + off, s - off))) return r;
        if (e > s) {
            if ((r = split_level(st, level + 1, text + s, e - s))) return r;
            off = pos = e;
            opts = 0;
        } else {
            /* An empty match (a lookahead alone) only cuts the text at s;
             * look for a non-empty match there before moving on, as
             * llama.cpp's std::regex_iterator and Python do. */
            off = pos = s;
            opts = PCRE2_NOTEMPTY_ATSTART | PCRE2_ANCHORED;
        }
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
    /* The interpreter's backtracking memory, in KiB: 20 MiB and 256 bytes a byte. */
    uint64_t heap = 20480u + (uint64_t)len / 4;
    pcre2_set_heap_limit(st.mc, heap > UINT32_MAX ? UINT32_MAX : (uint32_t)heap);
    r = split_level(&st, 0, text, len);
done:
    pcre2_match_context_free(st.mc);
    pcre2_jit_stack_free(st.js);
    for (int i = 0; i < p->n_re; i++) pcre2_match_data_free(st.md[i]);
    return r;
nomem:
    util_err_set(err, KVLM_ENOMEM, "out of memory");
    r = -1;
    goto done;
}

/* ---- pre-tokenizers from regex lists (tokenizer.json) ------------------------ */

/* Hugging Face writes Llama 3's and Qwen2's contractions case-insensitively;
 * the table spells them out (see CONTR). */
#define HF_CONTRACTIONS "(?i:'s|'t|'re|'ve|'m|'ll|'d)"

static char *canon_regex(const char *re) {
    size_t n = strlen(re), hl = strlen(HF_CONTRACTIONS), cl = strlen(CONTR), extra = 0;
    for (const char *p = strstr(re, HF_CONTRACTIONS); p; p = strstr(p + hl, HF_CONTRACTIONS)) extra += cl;
    char *out = malloc(n + extra + 1), *o = out;
    if (!out) return NULL;
    for (const char *p = re; *p;) {
        if (!strncmp(p, HF_CONTRACTIONS, hl)) { memcpy(o, CONTR, cl); o += cl; p += hl; }
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
    p->flags = ignore_merges ? F_IGNORE_MERGES : 0;
    for (int i = 0; i < n_re; i++) {
        int ec;
        PCRE2_SIZE eo;
        char *src = expand_ws(re[i]);
        if (!src) { util_err_set(err, KVLM_ENOMEM, "out of memory"); tok_pretok_free(p); return NULL; }
        /* as in tok_pretok_create: invalid UTF-8 never matches and becomes gap chunks */
        pcre2_code *c = pcre2_compile((PCRE2_SPTR)src, PCRE2_ZERO_TERMINATED,
                                      PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | PCRE2_DOLLAR_ENDONLY, &ec,
                                      &eo, NULL);
        free(src);
        if (!c) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(ec, msg, sizeof msg);
            util_err_set(err, KVLM_EFORMAT, "pre-tokenizer regex %d (\"%.60s\"): error at %zu: %s", i, re[i],
                         (size_t)eo, (const char *)msg);
            tok_pretok_free(p);
            return NULL;
        }
        (void)pcre2_jit_compile(c, PCRE2_JIT_COMPLETE);
        p->mode[p->n_re] = 'r';
        p->re[p->n_re++] = c;
    }
    return p;
}
