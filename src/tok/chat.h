/* tok/chat: chat templates: a conversation rendered as a prompt in the
 * format of a model family (ChatML, Llama 2, Llama 3, Zephyr, plain). */
#ifndef KVLM_TOK_CHAT_H
#define KVLM_TOK_CHAT_H
#include "kvlm.h"

/* Family name for a Jinja template string (detected by substrings, as
 * llama.cpp does) or a family name; NULL if unrecognised. tmpl NULL: "plain". */
const char *tok_chat_family(const char *tmpl);
/* Renders with a family name from tok_chat_family; NULL on out of memory. */
char *tok_chat_render(const char *family, const char *const *roles, const char *const *contents, int n);
#endif
