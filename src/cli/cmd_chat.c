/* cli/cmd_chat: `kvlm chat`: a conversation in the terminal. Each line read
 * is a user turn; the whole conversation is rendered with the model's chat
 * template and tokenized again, and only what differs from the tokens in the
 * cache is taken back and prefilled: the earlier turns stay in the KV cache.
 * One line of figures per turn on stderr says how much came from it. */
#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef KVLM_HAVE_LIBEDIT
#include <histedit.h>
#endif
#include "cli/cli.h"
#include "cli/llama_flags.h"
#include "cli/progress.h"

/* The "plain" template has no end-of-turn token: a model that goes on to
 * write the user's next line is stopped there, as llama.cpp's reverse prompt does. */
static const char k_plain_stop[] = "\nUser:";

/* Ctrl-C (SIGINT), as llama-cli's: while an answer is made, the first stops
 * it (what was said joins the conversation); a second before it has stopped
 * (a long prefill) quits at once; at the prompt it quits. */
static volatile sig_atomic_t g_answering, g_stop, g_quit;

static void on_sigint(int sig) {
    (void)sig;
    if (!g_answering) { g_quit = 1; return; }
    if (g_stop) {
        static const char msg[] = "\n[interrupted]\n";
        ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
        (void)w;
        _exit(130);
    }
    g_stop = 1;
}

/* At the prompt a read is interrupted by Ctrl-C (and so ends); while
 * answering, the writes to the terminal go on through it. */
static void sigint_mode(bool answering) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = answering ? SA_RESTART : 0;
    if (answering) g_stop = 0;
    g_answering = answering;
    sigaction(SIGINT, &sa, NULL);
}

/* Where messages come from: a terminal, with line editing and history
 * (libedit: arrows, Ctrl-R, ...; --input-history FILE keeps the lines
 * typed), or plain lines from a pipe or file. */
typedef struct {
    bool tty;
#ifdef KVLM_HAVE_LIBEDIT
    EditLine *el;
    History *hist;
    const char *hist_file;
#endif
} line_reader;

#ifdef KVLM_HAVE_LIBEDIT
static bool g_continued; /* the prompt of a message's next line */
static char *edit_prompt(EditLine *el) {
    (void)el;
    return g_continued ? ". " : "> ";
}
#endif

static void reader_open(line_reader *r, const char *hist_file) {
    memset(r, 0, sizeof *r);
    r->tty = isatty(STDIN_FILENO);
#ifdef KVLM_HAVE_LIBEDIT
    if (!r->tty || !isatty(STDERR_FILENO)) return; /* (stderr to a file: plain lines) */
    /* prompt and echo on stderr: stdout holds only the answers */
    if (!(r->el = el_init("kvlm", stdin, stderr, stderr))) return;
    HistEvent ev;
    if ((r->hist = history_init())) {
        history(r->hist, &ev, H_SETSIZE, 1000);
        history(r->hist, &ev, H_SETUNIQUE, 1);
        if (hist_file && access(hist_file, F_OK) == 0) history(r->hist, &ev, H_LOAD, hist_file);
        r->hist_file = hist_file;
        el_set(r->el, EL_HIST, history, r->hist);
    }
    el_set(r->el, EL_EDITOR, "emacs");
    el_set(r->el, EL_PROMPT, edit_prompt);
    el_source(r->el, NULL); /* ~/.editrc, as other libedit programs */
#else
    (void)hist_file;
#endif
}

static void reader_close(line_reader *r) {
#ifdef KVLM_HAVE_LIBEDIT
    if (r->el) el_end(r->el);
    if (r->hist) history_end(r->hist);
    r->el = NULL;
    r->hist = NULL;
#else
    (void)r;
#endif
}

/* One line without its end (malloc'd), NULL at the end of input or on Ctrl-C. */
static char *reader_line(line_reader *r, bool continued) {
    if (g_quit) return NULL;
#ifdef KVLM_HAVE_LIBEDIT
    if (r->el) {
        g_continued = continued;
        int n = 0;
        const char *s = el_gets(r->el, &n);
        if (!s || n <= 0 || g_quit) return NULL;
        char *line = strdup(s);
        if (!line) return NULL;
        line[strcspn(line, "\r\n")] = 0;
        if (*line && r->hist) {
            HistEvent ev;
            history(r->hist, &ev, H_ENTER, line);
            if (r->hist_file) history(r->hist, &ev, H_SAVE, r->hist_file);
        }
        return line;
    }
#endif
    if (r->tty) fputs(continued ? ". " : "> ", stderr);
    char *line = NULL;
    size_t cap = 0;
    ssize_t n = getline(&line, &cap, stdin);
    if (n < 0 || g_quit) {
        free(line);
        return NULL;
    }
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = 0;
    return line;
}

static void chat_usage(FILE *f) {
    fprintf(f,
            "usage: kvlm chat -m MODEL [--system TEXT] [-n N] [options]\n\n"
            "A conversation: each line read from standard input is a user message (end a line with \\\n"
            "to go on on the next one; /reset starts over, /exit or end of input ends), and the\n"
            "model's answer streams to standard output. The conversation stays in the KV cache\n"
            "between turns: each turn prefills only the tokens that differ from those already\n"
            "there, and a line on stderr says how many came from the cache.\n\n"
            "  -m, --model FILE        GGUF, llama2.c .bin, or a Hugging Face model directory (docs/hf-checkpoints.md)\n"
            "      --tokenizer FILE    tokenizer.bin for llama2.c models (default: beside the model)\n"
            "      --system TEXT       a system message before the first turn\n"
            "      --history FILE      the conversation so far: read at the start (when FILE exists) and each\n"
            "                          turn appended; with --kv-disk DIR its cache comes back from DIR too\n"
            CLI_CHAT_USAGE
            "  -n, --n-predict N       most tokens of one answer (default 512; at most half the context:\n"
            "                          said when cut); -1 or -2: until the end of the turn or a full context\n"
            "  -r, --reverse-prompt T  an answer ends where T would begin (repeatable)\n"
            "      --ignore-eos        answers end only at -n or a full context (end-of-turn tokens banned)\n"
            "  -e, --escape            read \\n, \\t, \\\\, \\', \\\", \\xHH in messages, --system and -r\n"
            "      --input-history FILE  the lines typed at the terminal, kept for the up arrow (line editing\n"
            "                          and history: libedit; Ctrl-C stops an answer, at the prompt it quits)\n"
            CLI_SAMPLER_USAGE
            CLI_GRAMMAR_USAGE
            CLI_CTX_USAGE
            "      --no-kv-cache       recompute the whole conversation for every token (the naive baseline)\n"
            CLI_LLAMA_USAGE
            "  -h, --help              this help\n\n"
            "When the conversation no longer fits the context with room for an answer, its oldest\n"
            "turns are left out (the system message stays).\n", kvlm_chat_family_names());
}

typedef struct {
    char **role, **text;
    int n, cap;
} convo;

static bool convo_add(convo *c, const char *role, const char *text, size_t len) {
    if (c->n == c->cap) {
        int cap = c->cap ? 2 * c->cap : 16;
        char **r = realloc(c->role, (size_t)cap * sizeof *r);
        if (r) c->role = r;
        char **t = realloc(c->text, (size_t)cap * sizeof *t);
        if (t) c->text = t;
        if (!r || !t) return false;
        c->cap = cap;
    }
    char *s = malloc(len + 1);
    if (!s) return false;
    memcpy(s, text, len);
    s[len] = 0;
    c->role[c->n] = (char *)role;
    c->text[c->n++] = s;
    return true;
}

/* Appends k bytes to the answer (NUL-terminated); false out of memory. */
static bool reply_add(char **r, size_t *len, size_t *cap, const char *p, int k) {
    if (k <= 0) return true;
    if (*len + (size_t)k + 1 > *cap) {
        size_t c = 2 * (*len + (size_t)k + 1);
        char *n = realloc(*r, c);
        if (!n) return false;
        *r = n;
        *cap = c;
    }
    memcpy(*r + *len, p, (size_t)k);
    *len += (size_t)k;
    (*r)[*len] = 0;
    return true;
}

/* --history: one message a line, "user: TEXT" or "assistant: TEXT" (or
 * "system: "), with backslash, newline and carriage return escaped. */
static void history_write(FILE *f, const char *role, const char *text) {
    fprintf(f, "%s: ", role);
    for (const char *p = text; *p; p++) {
        if (*p == '\\') fputs("\\\\", f);
        else if (*p == '\n') fputs("\\n", f);
        else if (*p == '\r') fputs("\\r", f);
        else fputc(*p, f);
    }
    fputc('\n', f);
    fflush(f);
}

/* Reads FILE's messages into c; false (with a message) for a line it cannot read. */
static bool history_read(const char *path, convo *c) {
    size_t len;
    char *all = cli_read_file("chat", path, &len); /* NUL-terminated: all[len] may be written */
    if (!all) return false;
    static const char *const roles[] = {"system", "user", "assistant"};
    bool ok = true;
    int line = 0;
    for (char *s = all; ok && s < all + len;) {
        char *nl = memchr(s, '\n', (size_t)(all + len - s)), *end = nl ? nl : all + len, *next = end + 1;
        *end = 0;
        line++;
        const char *role = NULL;
        for (int r = 0; r < 3 && !role && end > s; r++) {
            size_t k = strlen(roles[r]);
            if (!strncmp(s, roles[r], k) && s[k] == ':' && s[k + 1] == ' ') {
                role = roles[r];
                s += k + 2;
            }
        }
        char *w = s;
        for (const char *q = s; role && *q; q++) {
            if (*q != '\\') { *w++ = *q; continue; }
            q++;
            if (*q == 'n') *w++ = '\n';
            else if (*q == 'r') *w++ = '\r';
            else if (*q == '\\') *w++ = '\\';
            else role = NULL; /* a stray backslash (or one at the end) */
        }
        if (role) ok = convo_add(c, role, s, (size_t)(w - s));
        else {
            cli_fail("chat", "%s, line %d: expected \"user: \", \"assistant: \" or \"system: \" and the message, "
                     "with \\\\, \\n and \\r escaped", path, line);
            ok = false;
        }
        s = next;
    }
    free(all);
    return ok;
}

/* Takes out messages [at, at + k). */
static void convo_drop(convo *c, int at, int k) {
    for (int i = at; i < at + k; i++) free(c->text[i]);
    memmove(c->role + at, c->role + at + k, (size_t)(c->n - at - k) * sizeof *c->role);
    memmove(c->text + at, c->text + at + k, (size_t)(c->n - at - k) * sizeof *c->text);
    c->n -= k;
}

/* One message: a line, or lines joined while they end with a backslash.
 * NULL at the end of input or on Ctrl-C at the prompt. */
static char *read_message(line_reader *r) {
    char *msg = NULL, *line;
    size_t len = 0;
    while ((line = reader_line(r, msg != NULL))) {
        size_t n = strlen(line);
        bool more = n > 0 && line[n - 1] == '\\';
        if (more) line[--n] = 0;
        char *m = realloc(msg, len + n + 2);
        if (!m) { free(line); break; }
        msg = m;
        memcpy(msg + len, line, n);
        free(line);
        len += n;
        msg[len] = 0;
        if (!more) break;
        msg[len++] = '\n';
        msg[len] = 0;
    }
    if (g_quit) { free(msg); return NULL; }
    return msg;
}

/* The conversation as the model's template renders it, tokenized; the
 * oldest turns (after a system message) are left out until it fits with
 * room for an answer. Returns the token count, 0 when even the last message
 * alone does not fit (it is taken out), -1 on an error (message printed). */
static int render(const kvlm_model *model, const kvlm_chat *chat, convo *c, int room, int32_t **toks, int *cap,
                  int *dropped) {
    kvlm_error err = {0};
    for (;;) {
        char *text = NULL, *req = NULL;
        json_t *msgs = json_array();
        for (int i = 0; msgs && i < c->n; i++)
            json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", c->role[i], "content", c->text[i]));
        json_t *r = msgs ? json_pack("{s:o}", "messages", msgs) : NULL;
        if (r) req = json_dumps(r, JSON_COMPACT);
        json_decref(r);
        if (!req) { cli_fail("chat", "out of memory"); return -1; }
        size_t len = 0;
        int rc = kvlm_chat_render(chat, req, &text, &len, &err);
        free(req);
        if (rc) {
            cli_fail("chat", "%s", err.msg);
            return -1;
        }
        int n = kvlm_tokenize(model, text, len, kvlm_add_bos(model), true, NULL, 0, &err);
        if (n > *cap) {
            int32_t *t = realloc(*toks, (size_t)n * sizeof *t);
            if (!t) { free(text); cli_fail("chat", "out of memory"); return -1; }
            *toks = t;
            *cap = n;
        }
        if (n > 0) n = kvlm_tokenize(model, text, len, kvlm_add_bos(model), true, *toks, n, &err);
        free(text);
        if (n < 0) { cli_fail("chat", "%s", err.msg); return -1; }
        if (n <= room) return n;
        int first = c->n && !strcmp(c->role[0], "system") ? 1 : 0;
        if (c->n - first <= 1) { /* the new message alone is too long */
            fprintf(stderr, "kvlm chat: this message is %d tokens with the template; the context leaves %d "
                            "(raise --ctx or -n less): left out\n", n, room);
            convo_drop(c, c->n - 1, 1);
            return 0;
        }
        /* a user message and the answer after it, or a lone message */
        int k = first + 1 < c->n - 1 && strcmp(c->role[first + 1], "user") ? 2 : 1;
        convo_drop(c, first, k);
        *dropped += k;
    }
}

int cmd_chat(int argc, char **argv) {
    const char *model_path = NULL, *tok_path = NULL, *system = NULL, *tmpl = NULL, *tmpl_file = NULL, *kv_mem = NULL,
               *evict = NULL, *history = NULL, *input_history = NULL;
    int n_predict = 512;
    cli_llama ll;
    cli_llama_init(&ll);
    bool seed_set = false;
    cli_grammar_opts gopt = {0};
    kvlm_grammar *grammar = NULL;
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    kvlm_sampler_params sp = kvlm_sampler_default_params();
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) { chat_usage(stdout); return 0; }
        else if (cli_opt_str(argc, argv, &i, "-m", "--model", &model_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--tokenizer", &tok_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--system", &system, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--history", &history, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--input-history", &input_history, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--chat-template", &tmpl, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--chat-template-file", &tmpl_file, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, "-n", "--n-predict", &n_predict, &bad)) {}
        else if (cli_opt_sampler(argc, argv, &i, &sp, &seed_set, &bad)) {}
        else if (cli_opt_grammar(argc, argv, &i, &gopt, &bad)) {}
        else if (cli_opt_ctx(argc, argv, &i, &cp, &kv_mem, &evict, &bad)) {}
        else if (cli_is(argv[i], NULL, "--no-kv-cache")) cp.no_kv_cache = true;
        else if (cli_opt_llama(argc, argv, &i, &ll, &bad)) {}
        else if (cli_llama_unsupported("chat", argv[i])) return 1;
        else { fprintf(stderr, "kvlm chat: unknown option '%s'\n", argv[i]); chat_usage(stderr); return 1; }
        if (bad) return 1;
    }
    if (!model_path) { fprintf(stderr, "kvlm chat: no model given (-m FILE)\n"); chat_usage(stderr); return 1; }
    if (n_predict == 0 || n_predict < -2)
        return cli_fail("chat", "-n %d: expected 1 or more tokens an answer, or -1 (until the end of the turn)",
                        n_predict);
    if (cli_ctx_finish("chat", &cp, kv_mem, evict)) return 1;
    kvlm_model_params mp = {0};
    if (cli_llama_finish("chat", &ll, &cp, &mp)) return 1;
    if (ll.escape && system) cli_unescape((char *)system); /* (argv's own bytes) */
    if (cp.kv_evict)
        return cli_fail("chat", "the conversation stays whole in the cache between turns: not with --kv-evict");
    if (!seed_set) sp.seed = (uint64_t)time(NULL);
    if (cli_sampler_check("chat", &sp, 0)) return 1; /* as the server checks a request's */

    int rc = 1;
    kvlm_error err = {0};
    mp.tokenizer_path = tok_path;
    kvlm_model *model = NULL;
    kvlm_chat *chat = NULL;
    kvlm_ctx *ctx = NULL;
    kvlm_sampler *smp = NULL;
    int32_t *toks = NULL, *fed = NULL; /* this turn's prompt; the tokens in the cache, in order */
    int cap = 0, n_fed = 0, cap_fed = 0;
    char *reply = NULL, *msg = NULL;
    convo c = {0};
    FILE *hist = NULL;
    line_reader lr;
    reader_open(&lr, input_history);
    model = cli_model_load(model_path, &mp, &err);
    if (!model) { cli_fail("chat", "%s", err.msg); goto done; }
    sp.model = model; /* its end-of-generation tokens (--ignore-eos) and token texts (DRY's breakers) */
    sp.ignore_eos = ll.ignore_eos;
    if (cli_sampler_check("chat", &sp, kvlm_vocab_size(model))) goto done; /* the bias's token ids */
    if (ll.verbose) {
        char desc[1024];
        kvlm_model_describe(model, desc, sizeof desc);
        fprintf(stderr, "kvlm chat: %s: %s\n", model_path, desc);
    }
    if (!(chat = cli_chat("chat", model, tmpl, tmpl_file, NULL, KVLM_REASONING_AUTO))) goto done;
    ctx = kvlm_ctx_create(model, &cp, &err);
    if (!ctx) { cli_fail("chat", "%s", err.msg); goto done; }
    bool gfailed;
    grammar = cli_grammar("chat", &gopt, model, &gfailed);
    if (gfailed) goto done;
    sp.grammar = grammar;
    int budget = kvlm_ctx_kv_budget(ctx);
    /* room kept for an answer when the conversation is fitted to the context */
    int room = n_predict;
    char limit[160] = "-n reached";
    if (n_predict < 0) { /* until the end of the turn: the default's room, the context's end the limit */
        room = budget / 2 < 512 ? budget / 2 : 512;
        n_predict = budget;
    } else if (n_predict >= budget) {
        const char *what = budget < kvlm_ctx_n_ctx(ctx) ? "KV budget" : "context";
        fprintf(stderr, "kvlm chat: -n %d leaves no room for a prompt in the %s of %d tokens: answers stop at %d "
                "tokens (raise %s, or -n -1: until the end of the turn)\n", n_predict, what, budget, budget / 2,
                budget < kvlm_ctx_n_ctx(ctx) ? "--kv-budget" : "--ctx");
        snprintf(limit, sizeof limit, "%d tokens (-n %d cut to fit the %s of %d)", budget / 2, n_predict, what, budget);
        room = n_predict = budget / 2;
    }
    if (ll.verbose) {
        char dev[512];
        kvlm_ctx_describe_device(ctx, dev, sizeof dev);
        fprintf(stderr, "kvlm chat: %s; context %d, answers up to %d tokens\n", dev, budget, n_predict);
    }
    cap_fed = budget;
    if (!(fed = malloc((size_t)cap_fed * sizeof *fed))) { cli_fail("chat", "out of memory"); goto done; }
    if (history && access(history, F_OK) == 0 && !history_read(history, &c)) goto done;
    if (history && !(hist = fopen(history, "a"))) { cli_fail("chat", "cannot write %s", history); goto done; }
    int n_read = c.n;
    /* a conversation read back keeps its own system message */
    bool has_system = c.n && !strcmp(c.role[0], "system");
    if (system && !c.n) {
        if (!convo_add(&c, "system", system, strlen(system))) { cli_fail("chat", "out of memory"); goto done; }
        if (hist) history_write(hist, "system", system);
        has_system = true;
    }
    if (n_read) fprintf(stderr, "[%d messages read from %s]\n", n_read, history);
    const char *family = kvlm_chat_family(chat);
    sigint_mode(false);
    for (int turn = 1; (msg = read_message(&lr)); free(msg), msg = NULL) {
        if (!strcmp(msg, "/exit") || !strcmp(msg, "/quit")) break;
        if (ll.escape) cli_unescape(msg);
        if (!strcmp(msg, "/reset")) {
            convo_drop(&c, has_system ? 1 : 0, c.n - (has_system ? 1 : 0));
            if (hist && !(hist = freopen(history, "w", hist))) { cli_fail("chat", "cannot write %s", history); goto done; }
            if (hist && has_system) history_write(hist, "system", c.text[0]);
            fprintf(stderr, "[the conversation starts over]\n");
            continue;
        }
        if (!convo_add(&c, "user", msg, strlen(msg))) { cli_fail("chat", "out of memory"); goto done; }
        int dropped = 0;
        int n = render(model, chat, &c, budget - room, &toks, &cap, &dropped);
        if (n < 0) goto done;
        if (n == 0) continue;
        sigint_mode(true); /* Ctrl-C from here stops this answer */
        struct timespec t0, t1, t2;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        /* keep what the cache holds of this prompt, leaving a token to compute;
         * a sequence not begun yet takes what the prefix index and the tiers
         * hold (a conversation read back, with --kv-disk) */
        int keep = 0;
        while (keep < n_fed && keep < n - 1 && fed[keep] == toks[keep]) keep++;
        if (!n_fed && !cp.no_kv_cache) keep = kvlm_seq_reuse_prefix(ctx, 0, toks, n);
        else if (cp.no_kv_cache || kvlm_seq_trim(ctx, 0, keep, &err)) {
            /* no cache to take back (or q4_kc keys across a block): start
             * again from the full blocks the prefix index still has */
            kvlm_seq_free(ctx, 0);
            keep = cp.no_kv_cache ? 0 : kvlm_seq_reuse_prefix(ctx, 0, toks, n);
        }
        memcpy(fed, toks, (size_t)n * sizeof *fed);
        n_fed = n;
        kvlm_batch b = {n - keep, toks + keep, NULL, NULL, NULL};
        if (kvlm_decode(ctx, &b, &err)) { cli_fail("chat", "%s", err.msg); goto done; }
        /* each answer draws afresh (as a server request would): its own seed,
         * penalties over its own tokens, and with a grammar (--json, ...) a sentence of its own */
        kvlm_sampler_free(smp);
        kvlm_sampler_params tp = sp;
        tp.seed = sp.seed + (uint64_t)(turn - 1);
        if (!(smp = kvlm_sampler_create(&tp, kvlm_vocab_size(model)))) { cli_fail("chat", "out of memory"); goto done; }
        for (int i = 0; i < n; i++) kvlm_sampler_accept(smp, toks[i]);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        /* the answer: streamed, held back where it could begin a stop: the
         * plain template's next "User:", -r's texts */
        const char *stops[1 + CLI_MAX_REVERSE];
        int n_stops = 0;
        if (family && !strcmp(family, "plain")) stops[n_stops++] = k_plain_stop;
        for (int r = 0; r < ll.n_reverse; r++) stops[n_stops++] = ll.reverse[r];
        size_t len = 0, shown = 0, rcap = 256;
        free(reply);
        if (!(reply = malloc(rcap))) { cli_fail("chat", "out of memory"); goto done; }
        reply[0] = 0;
        kvlm_detok dt;
        kvlm_detok_init(&dt, model);
        dt.prev = toks[n - 1];
        int n_gen = 0;
        const char *why = "end of turn";
        bool stopped = false;
        char piece[1024];
        for (;;) {
            int32_t next = kvlm_sampler_sample(smp, kvlm_get_logits(ctx, -1));
            if (kvlm_token_is_eog(model, next)) break;
            n_gen++; /* (the sampler recorded it for its penalties) */
            int k = kvlm_detok_push(&dt, next, piece, sizeof piece);
            if (!reply_add(&reply, &len, &rcap, piece, k)) { cli_fail("chat", "out of memory"); goto done; }
            char *at = NULL;
            const char *hit = NULL;
            for (int s = 0; s < n_stops; s++) {
                char *p = strstr(reply, stops[s]);
                if (p && (!at || p < at)) at = p, hit = stops[s];
            }
            if (at) {
                len = (size_t)(at - reply);
                reply[len] = 0;
                stopped = true;
            }
            size_t safe = len;
            for (int s = 0; s < n_stops && !stopped; s++) /* bytes that could begin a stop stay back */
                for (size_t h = strlen(stops[s]) - 1; h > 0; h--)
                    if (h <= len && len - h < safe && !memcmp(reply + len - h, stops[s], h)) { safe = len - h; break; }
            if (safe > shown) {
                fwrite(reply + shown, 1, safe - shown, stdout);
                fflush(stdout);
                shown = safe;
            }
            if (stopped) { why = hit == k_plain_stop ? "the next \"User:\"" : "a reverse prompt (-r)"; break; }
            if (g_stop) { why = "Ctrl-C"; break; } /* what was said is kept, as llama-cli keeps it */
            if (n_gen >= n_predict) { why = limit; break; }
            if (n_fed >= budget) { why = "context full"; break; }
            kvlm_batch one = {1, &next, NULL, NULL, NULL};
            if (kvlm_decode(ctx, &one, &err)) { cli_fail("chat", "%s", err.msg); goto done; }
            fed[n_fed++] = next;
        }
        if (!stopped && !reply_add(&reply, &len, &rcap, piece, kvlm_detok_flush(&dt, piece, sizeof piece))) {
            cli_fail("chat", "out of memory");
            goto done;
        }
        fwrite(reply + shown, 1, len - shown, stdout);
        fputc('\n', stdout);
        fflush(stdout);
        sigint_mode(false); /* Ctrl-C from here quits */
        clock_gettime(CLOCK_MONOTONIC, &t2);
        /* the answer joins the conversation as the template will render it:
         * without the whitespace around it */
        size_t a = 0, e = len;
        while (a < e && (reply[a] == ' ' || reply[a] == '\n')) a++;
        while (e > a && (reply[e - 1] == ' ' || reply[e - 1] == '\n')) e--;
        if (!convo_add(&c, "assistant", reply + a, e - a)) { cli_fail("chat", "out of memory"); goto done; }
        if (hist) {
            history_write(hist, "user", c.text[c.n - 2]);
            history_write(hist, "assistant", c.text[c.n - 1]);
        }
        double prefill_s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        double decode_s = (double)(t2.tv_sec - t1.tv_sec) + 1e-9 * (double)(t2.tv_nsec - t1.tv_nsec);
        size_t kv = kvlm_ctx_kv_bytes(ctx);
        fprintf(stderr,
                "[turn %d: %d prompt tokens, %d from the cache, %d prefilled (%.1f tokens/s) | answer: %d tokens, "
                "%.1f tokens/s, stopped at %s | KV cache: %d tokens, %.2f MiB%s]\n",
                turn++, n, keep, n - keep, prefill_s > 0 ? (n - keep) / prefill_s : 0.0, n_gen,
                decode_s > 0 ? n_gen / decode_s : 0.0, why, kvlm_seq_n_past(ctx, 0), (double)kv / (1 << 20),
                dropped ? " | the oldest turns left out to fit the context" : "");
    }
    rc = g_quit ? 130 : 0; /* Ctrl-C at the prompt: the shell's code for it */
    if (g_quit) fputc('\n', stderr);
done:
    reader_close(&lr);
    signal(SIGINT, SIG_DFL);
    if (hist) fclose(hist);
    free(msg);
    free(reply);
    free(toks);
    free(fed);
    convo_drop(&c, 0, c.n);
    free(c.role);
    free(c.text);
    kvlm_sampler_free(smp);
    kvlm_ctx_free(ctx);
    kvlm_grammar_free(grammar);
    kvlm_chat_free(chat);
    kvlm_model_free(model);
    return rc;
}
