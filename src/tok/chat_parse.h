/* tok/chat_parse: what a chat model wrote, split as OpenAI and vLLM return it:
 * content, reasoning_content and tool_calls, for each family's syntax (Hermes,
 * Qwen3-Coder XML, Llama 3, Mistral, DeepSeek, Kimi, gpt-oss's harmony, ...),
 * picked from the chat template's text as llama.cpp and vLLM pick it; the
 * streaming deltas between two parses; the grammar that holds a call to the
 * family's syntax (docs/tool-calls.md). */
#ifndef KVLM_TOK_CHAT_PARSE_H
#define KVLM_TOK_CHAT_PARSE_H
#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kvlm.h"

/* A family's tool-call and reasoning syntax. */
typedef struct tok_chat_syntax tok_chat_syntax;

/* reasoning_format: auto splits reasoning into reasoning_content; none keeps
 * it in content as the model wrote it (llama-server's and vLLM's "none"). */
enum { TOK_REASONING_AUTO = KVLM_REASONING_AUTO, TOK_REASONING_NONE = KVLM_REASONING_NONE };

/* The syntax for a template's source (markers in it, as llama.cpp and vLLM
 * detect them), or the one named by override_name (--tool-call-parser: a name
 * from tok_chat_parser_names or one of vLLM's, e.g. "qwen3_coder"; an unknown
 * one is KVLM_EINVAL listing the names). template_src NULL and no override:
 * "generic" (a bare JSON call, <think> reasoning). */
tok_chat_syntax *tok_chat_syntax_new(const char *template_src, const char *override_name, int reasoning_format,
                                     kvlm_error *err);
void tok_chat_syntax_free(tok_chat_syntax *s);
const char *tok_chat_syntax_name(const tok_chat_syntax *s);
/* The names --tool-call-parser takes, for messages ("hermes, qwen3-coder, ..."). */
const char *tok_chat_parser_names(void);

typedef struct tok_chat_parse_opts {
    /* the rendered prompt's end (or the whole prompt): a prompt that opened
     * the reasoning (<think> in the generation prompt) starts the text inside
     * it; NULL: "" */
    const char *prompt_tail;
    /* the request's OpenAI tools array (NULL: none): a bare JSON call (Llama
     * 3, generic) must name one of them; XML parameters are typed by their
     * schema */
    const json_t *tools;
    /* generated tool-call ids are a function of (seed, index): the same text
     * parsed again gives the same ids (streaming) */
    uint64_t id_seed;
    /* the text may stop anywhere (streaming): only what is certain is
     * returned, never a marker's beginning as content, and a call's
     * arguments only as far as they will not change */
    bool partial;
    /* no calls are read (a request without tools, or tool_choice none): the
     * text after the reasoning is content (harmony's channels still read) */
    bool no_calls;
} tok_chat_parse_opts;

/* The text generated after the prompt, as an assistant message: {"role":
 * "assistant", "content": string (null when empty and there are calls),
 * "reasoning_content"?: string, "tool_calls"?: [{"id", "type": "function",
 * "function": {"name", "arguments": the arguments object as compact JSON
 * text}}]}. A call that is malformed or cut (in a whole parse) is left in
 * content as written. NULL only when out of memory (err filled). */
json_t *tok_chat_parse(const tok_chat_syntax *s, const tok_chat_parse_opts *o, const char *text, size_t len,
                       kvlm_error *err);

/* What an OpenAI chat.completion.chunk's delta adds from prev to cur (two
 * parses of a growing text; prev NULL: nothing before): {"content"?,
 * "reasoning_content"?, "tool_calls"?: [{"index", "id", "type", "function":
 * {"name", "arguments"}} for a new call, {"index", "function": {"arguments":
 * more}} after]}; NULL when nothing is new (or out of memory). Concatenating
 * the deltas of a text's growing parses gives its whole parse. */
json_t *tok_chat_delta(const json_t *prev, const json_t *cur);

/* A request's tools (an OpenAI tools array) checked: KVLM_EINVAL naming the
 * first fault ("'tools[1].function.name' must be ..."). */
int tok_chat_tools_check(const json_t *tools, kvlm_error *err);

/* tool_choice's forms (tok/chat_reader.c): NULL or "auto" with tools:
 * auto; "none" (or no tools): none; "required"; a named function (*name:
 * the tool's name, owned by tools). -1 with err filled (*which: the member
 * at fault) for another value, or a name none of the tools has. */
enum { TOK_CHOICE_NONE, TOK_CHOICE_AUTO, TOK_CHOICE_REQUIRED, TOK_CHOICE_NAMED };
int tok_chat_tool_choice(const json_t *tools, const json_t *choice, const char **name, const char **which,
                         kvlm_error *err);

/* ---- grammars (tok/chat_grammar.c) ---- */
/* A tool as a grammar sees it: the GBNF rules of its arguments object and
 * of each property's value (JSON), made by the caller from its schema
 * (tok/tool_grammar). */
typedef struct tok_chat_gbnf_tool {
    const char *name;
    const char *args_rule;
    int n_props;                          /* its parameters' properties, in the schema's order */
    const char *const *prop_names;
    const json_t *const *prop_schemas;
    const char *const *prop_rules;
    const bool *prop_required;
} tok_chat_gbnf_tool;
/* The GBNF of the family's calls (rules "root" and "tc_*"; the JSON rules
 * the tools' rules use are the caller's): at least one call, at most one
 * unless parallel, of the tools given. lazy (tool_choice auto): root starts
 * with a call's first word, and *triggers (malloc'd, each word malloc'd;
 * free with tok_chat_triggers_free) are those words; else (required, or a
 * named function) root is the whole answer: the reasoning where the family
 * writes it (opened by the prompt if prompt_tail shows it), then the calls.
 * NULL with err filled (KVLM_EUNSUPPORTED) for a family a grammar here cannot
 * write (gemma4's and pythonic values, "none"). */
char *tok_chat_syntax_gbnf(const tok_chat_syntax *s, const tok_chat_gbnf_tool *tools, int n_tools, bool parallel,
                           bool lazy, const char *prompt_tail, kvlm_grammar_trigger **triggers, int *n_triggers,
                           kvlm_error *err);
void tok_chat_triggers_free(kvlm_grammar_trigger *triggers, int n);
#endif
