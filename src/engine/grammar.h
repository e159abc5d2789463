/* engine/grammar: holding generated text to a context-free grammar (structured
 * output). Grammars are written in llama.cpp's GBNF; JSON schemas, and the
 * JSON mode, become one (tok/json_schema). The grammar is compiled to
 * rules of alternatives of sequences of character classes (over Unicode code
 * points) and rule references; a matcher follows the text by a set of parse
 * stacks (hash-consed, so equal stacks are one id), and caches each (stack
 * set, byte) step, so the stack sets act as the states of a DFA built lazily
 * as the text visits them. Before each draw the sampler masks every token
 * whose bytes would leave the language: the model's token texts are walked
 * in sorted order, so a prefix shared by many tokens is stepped once and a
 * dead prefix refuses all the tokens that start with it. */
#ifndef KVLM_ENGINE_GRAMMAR_H
#define KVLM_ENGINE_GRAMMAR_H
#include <stdbool.h>
#include <stdint.h>
#include "kvlm.h"
#include "tok/tool_grammar.h"

/* One generation's place in a grammar (it holds a reference on it). */
typedef struct gm gm;
gm *gm_new(const kvlm_grammar *g);
void gm_free(gm *m);
/* Feeds n bytes; false (and nothing changes) when they leave the language. */
bool gm_feed(gm *m, const char *bytes, int n);
/* The text so far is a whole sentence of the grammar: it may end here. */
bool gm_done(const gm *m);
/* allowed[t] for every token of the grammar's model: its bytes keep the text
 * in the language (an end-of-generation token: gm_done). Returns how many. */
int gm_allowed(gm *m, bool *allowed);
/* Advances by token t's bytes; false (nothing changes) if they leave the
 * language; an end-of-generation token: gm_done. */
bool gm_feed_token(gm *m, int32_t t);
/* The grammar's model (NULL: one parsed for bytes only, no token mask). */
const kvlm_model *gm_model(const kvlm_grammar *g);

/* A model's token texts, sorted, built once per model on first use (kept
 * with the model). */
typedef struct gm_vocab gm_vocab;
void gm_vocab_free(gm_vocab *v);

/* A request's tool-call grammar (tok/tool_grammar's text) compiled for model's tokens. */
kvlm_grammar *eng_tool_grammar_compile(const kvlm_model *model, const tok_tool_gbnf *t, kvlm_error *err);
#endif
