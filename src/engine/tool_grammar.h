/* engine/tool_grammar: the grammar of a request's tool calls: the family's
 * syntax, each tool's arguments held to its parameters' JSON schema. */
#ifndef KVLM_ENGINE_TOOL_GRAMMAR_H
#define KVLM_ENGINE_TOOL_GRAMMAR_H
#include <jansson.h>
#include <stdbool.h>
#include "kvlm.h"
#include "tok/chat_parse.h"

/* The calls' grammar for model's tokens (tools checked by tok_chat_tools_check): only (a function's name) or every
 * tool; lazy: tool_choice auto (free text until a call begins); else the
 * answer is the calls (after the reasoning where the family writes it; the
 * prompt's end says whether it opened it). At most one call unless
 * parallel. NULL with err filled: a schema kvlm cannot hold to (the JSON
 * schema's message, prefixed by the tool), an unknown name, a family
 * without a grammar (KVLM_EUNSUPPORTED). */
kvlm_grammar *eng_tool_grammar(const kvlm_model *model, const tok_chat_syntax *s, const char *prompt_tail,
                               const json_t *tools, const char *only, bool lazy, bool parallel, kvlm_error *err);
#endif
