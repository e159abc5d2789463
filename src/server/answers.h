/* server/answers: the token ids of the chat answers this server generated,
 * kept in a bounded LRU so that a conversation sent back as text is tokenized
 * with them, and the prefix cache holds every earlier turn (docs/serving.md,
 * "Conversations and the prefix cache"). */
#ifndef KVLM_SERVER_ANSWERS_H
#define KVLM_SERVER_ANSWERS_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <jansson.h>
#include "kvlm.h"

typedef struct srv_answers srv_answers;

/* A hash of a prompt's token ids (and of the model): which prompt an answer
 * was generated after. */
typedef struct { uint64_t a, b; } srv_prompt_key;

/* An answer longer than this many tokens is not kept (its choice stops
 * keeping its ids past it). */
enum { SRV_ANSWER_MAX_IDS = 1 << 16 };

typedef struct {
    size_t entries, bytes, cap;  /* answers kept, the bytes they take (ids and bookkeeping), the cap */
    uint64_t recorded;           /* answers kept since the start (a same answer to a same prompt again: once) */
    uint64_t unmatched;          /* answers not kept: no prefix of their ids spells the text returned */
    uint64_t evicted;            /* answers dropped for the cap (least recently recorded or used first) */
    uint64_t reused, reused_tokens; /* assistant messages tokenized as their generated ids, and those ids */
} srv_answers_stats;

/* cap: bytes (ids and bookkeeping); model_id and the vocabulary seed the
 * keys. NULL when out of memory. */
srv_answers *srv_answers_create(size_t cap, const kvlm_model *m, const char *model_id);
void srv_answers_free(srv_answers *a);

srv_prompt_key srv_answers_prompt_key(const srv_answers *a, const int32_t *ids, int n);

/* Engine thread, a chat choice ended: the answer whose text the client got is
 * text (a stream keeps only its tail: the text's bytes from text_off on),
 * generated as ids after the prompt (key; prev: its last token). Kept as the
 * longest prefix of ids that spells the whole text (as kvlm_detok makes it
 * after prev; special: control tokens shown), if one does: a stop string
 * cut the text inside the ids. */
void srv_answers_record(srv_answers *a, srv_prompt_key prompt, int32_t prev, bool special, const int32_t *ids, int n,
                        const char *text, size_t len, size_t text_off);

/* HTTP thread: a chat prompt's tokens. text is the rendered prompt,
 * contents[0, n_msgs) the messages' texts in order (roles[i]: their roles).
 * Where an assistant message's text, found at its place in the prompt, is an
 * answer this server generated after exactly the tokens before it, it is
 * taken as the generated ids (kvlm_tokenize_spans); the rest is tokenized as
 * usual. Returns the tokens (malloc'd; *n_out of them), or NULL with err;
 * *reused and *reused_tokens: the messages taken and their ids. */
int32_t *srv_answers_tokenize(srv_answers *a, const kvlm_model *m, const char *text, size_t len, bool add_bos,
                              const char *const *roles, const char *const *contents, int n_msgs, int *n_out,
                              int *reused, int *reused_tokens, kvlm_error *err);
/* The same for a chat request's "messages" (a JSON array): each message's
 * text as kvlm_chat_render gives it to a template (a string; null: empty;
 * text parts joined with newlines); a message of another shape is never a
 * candidate. */
int32_t *srv_answers_tokenize_json(srv_answers *a, const kvlm_model *m, const char *text, size_t len, bool add_bos,
                                   json_t *messages, int *n_out, int *reused, int *reused_tokens, kvlm_error *err);
/* A request's reuse, counted once it is submitted. */
void srv_answers_count(srv_answers *a, int reused, int reused_tokens);
void srv_answers_stats_get(srv_answers *a, srv_answers_stats *st);

#endif
