/* tok/tool_grammar: the GBNF text of a request's tool calls: the family's
 * syntax, each tool's arguments held to its parameters' JSON schema
 * (engine/grammar compiles it: kvlm_chat_tool_grammar). */
#ifndef KVLM_TOK_TOOL_GRAMMAR_H
#define KVLM_TOK_TOOL_GRAMMAR_H
#include <stdbool.h>
#include "kvlm.h"
#include "tok/chat_parse.h"

typedef struct {
    char *gbnf;                     /* NULL: no grammar (tool_choice none, or auto in a family without one) */
    kvlm_grammar_trigger *triggers; /* lazy (tool_choice auto): the words that wake it */
    int n_triggers;
    const char *syntax;             /* the family's name, for the compiler's messages */
} tok_tool_gbnf;

/* The calls' grammar (tools checked by tok_chat_tools_check): only (a
 * function's name) or every tool; lazy: tool_choice auto (free text until a
 * call begins); else the answer is the calls (after the reasoning where the
 * family writes it; the prompt's end says whether it opened it). At most one
 * call unless parallel. Non-zero with err filled: a schema kvlm cannot hold
 * to (the JSON schema's message, prefixed by the tool), an unknown name, a
 * family without a grammar (KVLM_EUNSUPPORTED). */
int tok_tool_gbnf_make(const tok_chat_syntax *s, const char *prompt_tail, const json_t *tools, const char *only,
                       bool lazy, bool parallel, tok_tool_gbnf *out, kvlm_error *err);
/* The same from a request's JSON, as kvlm_chat_tool_grammar takes it (kvlm.h). */
int tok_chat_tool_gbnf(const kvlm_chat *chat, const char *prompt, size_t prompt_len, const char *tools_json,
                       const char *tool_choice_json, bool parallel, tok_tool_gbnf *out, kvlm_error *err);
void tok_tool_gbnf_free(tok_tool_gbnf *t);
#endif
