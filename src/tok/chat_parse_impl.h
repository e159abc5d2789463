/* tok/chat_parse_impl: what the tool-call parsers share (tok/chat_parse.c,
 * tok/toolcall_*.c): the parser's state, text segments and calls, marker
 * search that holds back a marker's beginning at a partial text's end, and
 * the JSON scanner that writes the certain prefix of a value canonically. */
#ifndef KVLM_TOK_CHAT_PARSE_IMPL_H
#define KVLM_TOK_CHAT_PARSE_IMPL_H
#include "tok/chat_parse.h"

typedef struct { char *s; size_t n, cap; bool oom; } tc_buf;
void tc_put(tc_buf *b, const char *s, size_t n);
void tc_puts(tc_buf *b, const char *s);
void tc_putc(tc_buf *b, char c);

enum { TC_ID_OPENAI, TC_ID_MISTRAL };

typedef struct tc_parser tc_parser;
typedef void (*tc_parse_fn)(tc_parser *p, size_t from);

/* One family's syntax (tok/chat_parse.c's table). */
typedef struct tc_format {
    const char *name;
    tc_parse_fn parse;        /* the body after the reasoning (NULL: all content) */
    bool own_reasoning;       /* parse gets the whole text and finds the reasoning itself */
    const char *think_start, *think_end; /* its reasoning markers, or NULL (then <think> if the template has it) */
    bool think_open;          /* the text always starts inside the reasoning (Apriel) */
    int id_style;
    const char *markers[8];   /* what a call or a block starts with: held back from content while cut */
} tc_format;

struct tok_chat_syntax {
    const tc_format *f;
    int reasoning_format;
    const char *think_start, *think_end;
};

typedef struct {
    char *name;
    char *id;         /* the format's own id, or NULL */
    tc_buf args;      /* canonical compact JSON, the certain prefix */
    bool done;        /* whole */
} tc_call;

enum { SEG_TEXT, SEG_CALL, SEG_THINK_END };
typedef struct { int kind; size_t a, b; } tc_seg;

struct tc_parser {
    const tok_chat_syntax *s;
    const char *t;
    size_t n;
    bool partial;
    bool stop;          /* a partial text's uncertain end was reached: nothing more */
    const json_t *tools;
    uint64_t seed;
    const char *tail;   /* the prompt's end */
    tc_buf reasoning;
    bool has_reasoning;
    tc_seg *seg;        /* content pieces and calls, in order */
    int n_seg, cap_seg;
    tc_buf extra;       /* content made by the parser (not a span of the text) */
    tc_call *calls;
    int n_calls, cap_calls;
    bool oom;
};

/* ---- text ---- */
static inline bool tc_ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
size_t tc_skip_ws(const tc_parser *p, size_t i);
/* Whether t[i..) starts with m: 1 yes, 0 no, -1 the text ends inside it
 * (partial: a maybe). */
int tc_at(const tc_parser *p, size_t i, const char *m);
/* The first m at or after i: its position (1). Else, a partial text ending
 * in m's beginning: that beginning's position (-1); else n (0). */
int tc_find(const tc_parser *p, size_t i, const char *m, size_t *at);
/* Past blanks and m at t[*i]: 1 (and *i moved), 0 not there, -1 the text
 * ends before it can tell (partial). */
int tc_skip(const tc_parser *p, size_t *i, const char *m);
/* The earliest of ms[0..k): its index in *which. */
int tc_find_any(const tc_parser *p, size_t i, const char *const *ms, int k, size_t *at, int *which);
/* Content t[a, b). */
void tc_text(tc_parser *p, size_t a, size_t b);
/* Content that is not a span of the text (Functionary's "all" messages
 * joined, harmony's final channel). */
void tc_text_made(tc_parser *p, const char *s, size_t n);
/* The reasoning's end: content after it starts without blanks. */
void tc_think_end(tc_parser *p);
void tc_reason(tc_parser *p, const char *s, size_t n);

/* ---- calls ---- */
/* A new call (its segment too); NULL when the name is no name (empty, over
 * 256 bytes, control characters: the caller fails the call) or out of memory. */
tc_call *tc_call_new(tc_parser *p, const char *name, size_t len, const char *id, size_t id_len);
/* Drops the calls past the first n. */
void tc_calls_truncate(tc_parser *p, int n);
/* Drops the last call if it is unfinished. */
void tc_call_drop(tc_parser *p);
/* Drops the last call if unfinished; t[from..n) is content (a malformed or,
 * in a whole parse, cut call is left as written); nothing more is parsed. */
void tc_call_fail(tc_parser *p, size_t from);
/* After a call's piece: DONE goes on (true); MORE stops a partial parse
 * there (the call as far as it went), and fails a whole one; BAD fails. */
bool tc_go(tc_parser *p, int r, size_t from);
/* A call's arguments at t[*i]: an object (as far as certain), a string that
 * holds one (whole only), or null ({}). */
int tc_call_args(tc_parser *p, size_t *i, tc_buf *args);
bool tc_tool_known(const tc_parser *p, const char *name, size_t len);
/* The JSON schema of a tool's parameter, or NULL. */
const json_t *tc_param_schema(const tc_parser *p, const char *tool, const char *param);

/* ---- JSON ---- */
enum { JC_DONE, JC_MORE, JC_BAD };
enum { JC_MAX_DEPTH = 128 };
/* One JSON value at t[*i..n) after blanks: its canonical compact text (keys
 * in order, strings re-escaped minimally, numbers as written) as far as it
 * is certain goes to out (may be NULL). DONE: *i is past it. MORE: the text
 * ends inside it (a number at the very end is whole unless partial). BAD:
 * not JSON (or nested past JC_MAX_DEPTH). */
int tc_json(const tc_parser *p, size_t *i, tc_buf *out);
/* The same over any bytes (a string's decoded contents, ...), whole. */
int tc_json_str(const char *s, size_t n, tc_buf *out);
/* n without a UTF-8 sequence cut at s's end. */
size_t tc_utf8_whole(const char *s, size_t n);
/* s as a JSON string literal, escaped as tc_json writes them. */
void tc_json_quote(tc_buf *out, const char *s, size_t n);
/* A JSON string literal at t[*i]: its decoded bytes to out. */
int tc_json_string(const tc_parser *p, size_t *i, tc_buf *out);
/* A Python literal (True, None, 'x', [..], {..}) as canonical JSON (whole). */
int tc_python_value(const char *s, size_t n, size_t *used, tc_buf *out, int depth);

/* Python keyword arguments "k=v, ...)" (after the "(") as a JSON object. */
int tc_python_kwargs(const char *s, size_t n, size_t *used, tc_buf *out);

/* Keys of a JSON call object ({"name": ..., "arguments": {...}}). */
typedef struct {
    const char *name[3];
    const char *args[3];
    const char *id[2];
    bool known;          /* the name must be one of the request's tools */
} tc_keys;
extern const tc_keys tc_keys_default;
/* A call object at t[*i]: the call is made once its name is whole; its
 * arguments (an object, or a string holding one) as far as certain. DONE,
 * MORE (partial: as far as it goes) or BAD (nothing made). */
int tc_json_call(tc_parser *p, size_t *i, const tc_keys *k);
/* "[" call ("," call)* "]". */
int tc_json_call_list(tc_parser *p, size_t *i, const tc_keys *k);

/* ---- the families (tok/toolcall_json.c, tok/toolcall_xml.c) ---- */
void tc_parse_hermes(tc_parser *p, size_t i);
void tc_parse_generic(tc_parser *p, size_t i);
void tc_parse_llama3(tc_parser *p, size_t i);
void tc_parse_mistral(tc_parser *p, size_t i);
void tc_parse_mistral_nemo(tc_parser *p, size_t i);
void tc_parse_deepseek_r1(tc_parser *p, size_t i);
void tc_parse_deepseek_v31(tc_parser *p, size_t i);
void tc_parse_kimi(tc_parser *p, size_t i);
void tc_parse_command_r_plus(tc_parser *p, size_t i);
void tc_parse_command_r7b(tc_parser *p, size_t i);
void tc_parse_firefunction(tc_parser *p, size_t i);
void tc_parse_granite(tc_parser *p, size_t i);
void tc_parse_apriel(tc_parser *p, size_t i);
void tc_parse_gigachat(tc_parser *p, size_t i);
void tc_parse_functionary31(tc_parser *p, size_t i);
void tc_parse_functionary32(tc_parser *p, size_t i);
void tc_parse_gpt_oss(tc_parser *p, size_t i);
void tc_parse_qwen3_coder(tc_parser *p, size_t i);
void tc_parse_seed(tc_parser *p, size_t i);
void tc_parse_glm(tc_parser *p, size_t i);
void tc_parse_dsml(tc_parser *p, size_t i);
void tc_parse_mirothinker(tc_parser *p, size_t i);
void tc_parse_gemma4(tc_parser *p, size_t i);
void tc_parse_pythonic(tc_parser *p, size_t i);
void tc_parse_lfm2(tc_parser *p, size_t i);
#endif
