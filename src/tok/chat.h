/* tok/chat: chat templates: a conversation rendered as a prompt in the
 * format of a model family (tok_chat_names). */
#ifndef KVLM_TOK_CHAT_H
#define KVLM_TOK_CHAT_H
#include "kvlm.h"

/* Family name for a Jinja template string (detected by substrings, as
 * llama.cpp does) or a family name; NULL if unrecognised. tmpl NULL: "plain". */
const char *tok_chat_family(const char *tmpl);
/* The family names, as a list for messages ("chatml, llama2, ... or plain"). */
const char *tok_chat_names(void);
/* Renders with a family name from tok_chat_family; NULL on out of memory. */
char *tok_chat_render(const char *family, const char *const *roles, const char *const *contents, int n);
/* kvlm_chat's answer syntax (tool calls, reasoning) and model. */
struct tok_chat_syntax;
const struct tok_chat_syntax *tok_chat_syntax_of(const kvlm_chat *c);
const kvlm_model *tok_chat_model(const kvlm_chat *c);
#endif
