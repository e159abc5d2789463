/* server/job: a request the engine works on (a completion, a chat completion
 * or an embeddings job) as the OpenAI side (openai.c: its choices' texts and
 * JSON) and the transport (transport.c: its connection, SSE bytes, hang-up
 * watch, keep-alive) share it. j->mu guards what the engine thread and the
 * HTTP and watcher threads both touch. */
#ifndef KVLM_SERVER_JOB_H
#define KVLM_SERVER_JOB_H
#include "server/completion_text.h"
#include "server/server.h"

/* One choice of a request (an answer to one of its prompts). */
typedef struct {
    kvlm_detok dt;
    srv_ctext t;            /* its text, what was streamed and what may be (server/completion_text) */
    int finish, n_tokens;
    double t_last;         /* its last token's time (inter-token latency) */
    bool started;
    json_t *lp;            /* chat-style logprob entries of every token */
    size_t lp_sent;
    int32_t *ids;          /* a chat answer's token ids, for s->answers */
    int n_ids, cap_ids;
    bool ids_off;          /* not kept: past SRV_ANSWER_MAX_IDS, or no memory */
    int32_t last_token;
    json_t *stop_reason;   /* vLLM's: the stop string or stop token id that ended it (NULL: none) */
    int sub;               /* its prompt (j->subs) */
    kvlm_chat_reader *rd;  /* a chat answer read as it grows: reasoning, content, tool calls (docs/tool-calls.md) */
    size_t fed;            /* text given to rd */
    json_t *message;       /* rd's whole answer, once it ended */
    int n_calls;
} srv_choice;

/* One prompt of a request (an array prompt has several), one scheduler
 * request: its choices are j->ch[base, base + n). */
typedef struct srv_sub {
    struct srv_job *j;
    uint64_t id;
    int base, n_prompt, prompt_tokens, cached_tokens;
    double queue;          /* its queue time (scheduler events) */
    char *echo;            /* completions' echo: the prompt's text */
    json_t *plp;           /* vLLM's prompt_logprobs: [null, {id: {logprob, rank, decoded_token}}, ...] */
} srv_sub;

typedef struct srv_job {
    pthread_mutex_t mu;
    int refs;              /* the connection's (or its streamed response's) and the engine's */
    kvlm_server *srv;
    struct MHD_Connection *conn;
    srv_sock *sock;        /* conn's entry in the server's list, while conn is this job's (under mu) */
    bool suspended;        /* conn waits for the engine (under mu) */
    uint64_t id;
    char idstr[48];
    long created;
    bool chat, stream, include_usage, complete;
    const char *family;
    int n, n_ended, logprobs, fd;
    srv_choice *ch;
    srv_stops stops;       /* and include_stop_str_in_output */
    char error[512];
    int prompt_tokens, cached_tokens, completion_tokens;
    /* a chat request's answers are recorded (s->answers) with the key of its prompt and its last token */
    bool record;
    srv_prompt_key prompt_key;
    int32_t prompt_last;
    int reused, reused_tokens; /* its assistant messages taken as their generated ids */
    double t_submit, t_first, t_last, t_end;
    int32_t *bias_ids;     /* logit_bias, for rp->sampling until submitted */
    /* vLLM's, llama-server's and OpenAI's other fields (parse_compat) */
    srv_sub *subs;         /* its prompts */
    int n_subs, n_per;     /* prompts, and choices per prompt (n) */
    bool echo, continuous_usage, skip_special, fim;
    int min_tokens, max_tokens;
    int prompt_lp;         /* prompt_logprobs: alternatives per prompt token; -1: none */
    int32_t *stop_ids;     /* stop_token_ids, for rp->sampling and stop_reason */
    int n_stop_ids;
    char *stage_names;     /* samplers / dry breakers: strings the sampling params point into, until submitted */
    const char **breakers;
    int n_breakers;
    char *echo_text;       /* chat echo: the last assistant message's text */
    /* the request log */
    bool log_me;           /* submitted: the job writes the request's line when it goes */
    unsigned status;       /* what was sent: 200, or an error's status (0: nothing, the client went away) */
    char client[64];
    kvlm_grammar *grammar; /* response_format json_object or json_schema, or grammar (GBNF), or the tool calls' */
    char *tools_json, *choice_json; /* the request's tools and tool_choice (NULL: none) */
    bool parallel;         /* parallel_tool_calls */
    uint64_t id_seed;      /* the calls' ids come from it (the request's seed, or a random one) */
    bool calls;            /* tools given and tool_choice not "none": calls are read */
    char ptail[257];       /* the rendered prompt's end (whether it opened the reasoning) */
    float *bias;
    char *out;             /* SSE bytes not yet written */
    size_t out_len, out_cap, out_off;
    size_t counted;        /* out's bytes counted as the connection's unsent answer (srv_unsent_add) */
    bool cut;              /* the stream was reset for that cap: nothing more is written */
    bool http11;           /* an interim 1xx response may be sent */
    bool half_closed;      /* whole answer, the client's sending side ended: the watcher writes it */
    char *raw;             /* ... the answer it writes (HTTP head and JSON body), raw_off sent */
    size_t raw_len, raw_off;
    double t_out;          /* when bytes for the client were last queued (the keep-alive clock) */
    bool ka_body;          /* a whole answer kept alive: its 200 is chunked, whitespace before the JSON */
    bool body_out;         /* ... and the JSON (or the error) is queued after it */
    struct srv_job *wprev, *wnext; /* in the server's watched list (under srv->watch_mu) */
    srv_embed *emb;        /* POST /v1/embeddings: its inputs and vectors (server/embeddings.c); NULL: a completion */
} srv_job;

/* openai.c */
/* Drops a reference; the last frees the job (and writes its log line). */
void srv_job_release(srv_job *j);
/* Cancels every prompt of it in the scheduler (its choices end as cancelled). */
void srv_job_cancel(srv_job *j);
/* Its whole answer (a completion's, or an embeddings job's) as JSON. */
json_t *srv_job_answer(srv_job *j);

/* transport.c */
/* Queues o (consumed) as one server-sent event, unless the stream was cut. */
void srv_sse(srv_job *j, json_t *o);
/* After an engine event (engine thread, j->mu held): a stream's buffer
 * counted, a half-closed client's whole answer handed to the watcher, the
 * connection resumed when it has something to send. */
void srv_job_deliver(srv_job *j);
/* Whether the client's socket is still open (or unknown: fd < 0). */
bool srv_client_alive(int fd);
/* The hang-up watch of a job whose connection is suspended (srv_hangup),
 * holding a reference; srv_unwatch ends the connection's. */
void srv_watch(kvlm_server *s, srv_conn *cn, srv_job *j);
void srv_unwatch(kvlm_server *s, srv_conn *cn);
/* libmicrohttpd's content reader of a stream or kept-alive answer (cls: the
 * job, whose reference it takes), and its end. */
ssize_t srv_stream_reader(void *cls, uint64_t pos, char *buf, size_t max);
void srv_stream_done(void *cls);
#endif
