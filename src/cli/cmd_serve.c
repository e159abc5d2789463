/* cli/cmd_serve: `kvlm serve`: the OpenAI-compatible HTTP server over one
 * model and one paged KV cache, until SIGINT or SIGTERM. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include "cli/cli.h"
#include "cli/llama_flags.h"
#include "cli/progress.h"

/* A stop takes at most this long (docs/serving.md): the requests in flight
 * end, the KV tiers' queues are written (each gives up after its own
 * deadline); past it, or at a second SIGINT/SIGTERM, the process exits at once. */
#define SERVE_STOP_S 30

static void *stop_watchdog(void *arg) {
    const sigset_t *sigs = arg;
    struct timespec end, now;
    clock_gettime(CLOCK_MONOTONIC, &end);
    end.tv_sec += SERVE_STOP_S;
    int sig = -1;
    for (;;) { /* EINTR is not the time being up: LeakSanitizer stops every thread at exit, for one */
        clock_gettime(CLOCK_MONOTONIC, &now);
        struct timespec left = {end.tv_sec - now.tv_sec, end.tv_nsec - now.tv_nsec};
        if (left.tv_nsec < 0) left.tv_sec--, left.tv_nsec += 1000000000L;
        if (left.tv_sec < 0) break;
        sig = sigtimedwait(sigs, NULL, &left);
        if (sig > 0 || errno != EINTR) break;
    }
    if (sig > 0) fprintf(stderr, "kvlm serve: %s again, exiting at once\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    else fprintf(stderr, "kvlm serve: still stopping after %d s (a KV tier not answering?), exiting at once\n",
                 SERVE_STOP_S);
    _exit(1);
    return NULL;
}

/* The log (docs/serving.md, "Logs"): every line, the library's and the
 * server's, through one callback, with the time and level; text, or one
 * JSON object a line (the server's own lines are JSON objects already:
 * time and level are put in front). A line that stderr cannot take at once
 * (a pipe nobody reads) is dropped and counted, never waited for: the
 * engine thread logs too. */
static bool g_log_json;
static unsigned long g_log_dropped;

static void log_line(void *user, int level, const char *msg) {
    (void)user;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char when[64], line[4096];
    snprintf(when, sizeof when, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
             tm.tm_hour, tm.tm_min, tm.tm_sec, (int)(ts.tv_nsec / 1000000));
    const char *lv = kvlm_log_level_name(level);
    int n;
    if (!g_log_json) {
        static const char *const up[] = {"DEBUG", "INFO ", "WARN ", "ERROR"};
        n = snprintf(line, sizeof line, "%s %s %s\n", when, level >= 0 && level < 4 ? up[level] : "?    ", msg);
    } else if (msg[0] == '{') { /* the server's: an object already */
        n = snprintf(line, sizeof line, "{\"time\":\"%s\",\"level\":\"%s\",%s\n", when, lv, msg + 1);
    } else { /* a message: escaped as a JSON string */
        n = snprintf(line, sizeof line, "{\"time\":\"%s\",\"level\":\"%s\",\"msg\":\"", when, lv);
        for (const unsigned char *c = (const unsigned char *)msg; *c && n < (int)sizeof line - 8; c++) {
            if (*c == '"' || *c == '\\') n += snprintf(line + n, sizeof line - (size_t)n, "\\%c", *c);
            else if (*c < 0x20) n += snprintf(line + n, sizeof line - (size_t)n, "\\u%04x", *c);
            else line[n++] = (char)*c;
        }
        n += snprintf(line + n, sizeof line - (size_t)n, "\"}\n");
    }
    if (n <= 0) return;
    if (n >= (int)sizeof line) { /* cut: still one line */
        n = (int)sizeof line - 1;
        line[n - 1] = '\n';
    }
    struct pollfd pf = {.fd = STDERR_FILENO, .events = POLLOUT};
    if (poll(&pf, 1, 0) != 1 || !(pf.revents & POLLOUT)) {
        g_log_dropped++;
        return;
    }
    if (g_log_dropped) {
        char note[128];
        int k = snprintf(note, sizeof note, "%s WARN  %lu log lines were dropped: stderr was not being read\n", when,
                         g_log_dropped);
        if (write(STDERR_FILENO, note, (size_t)k) == k) g_log_dropped = 0;
    }
    if (write(STDERR_FILENO, line, (size_t)n) != n) g_log_dropped++;
}

static void serve_usage(FILE *f) {
    fprintf(f,
            "usage: kvlm serve -m MODEL [options]\n\n"
            "Serves the model over HTTP: POST /v1/completions and /v1/chat/completions (OpenAI-compatible,\n"
            "streamed or not), GET /v1/models, /health, /metrics (Prometheus), /kvlm/status and a web page\n"
            "at /. Requests are batched continuously in one KV cache; prints\n"
            "'kvlm serve: listening on http://HOST:PORT' (https with TLS) when ready; SIGINT/SIGTERM stop it\n"
            "(within 30 s; a second one at once).\n"
            "Limits and access options are described in docs/serving.md.\n\n"
            "  -m, --model FILE        GGUF, llama2.c .bin, or a Hugging Face model directory (docs/hf-checkpoints.md)\n"
            "      --tokenizer FILE    tokenizer.bin for llama2.c models (default: beside the model)\n"
            "      --host ADDR         address to listen on, IPv4 or IPv6 (default 127.0.0.1; ::1, ::)\n"
            "      --port N            port (default 8080; 0 = any free port)\n"
            "      --alias NAME        the model id clients use (default: the file name without extension)\n"
            CLI_CHAT_USAGE
            CLI_TOOLS_USAGE
            "      --max-seqs N        sequences decoded at once (default 16)\n"
            "  -np, --parallel N       llama-server's slots: N sequences at once, each holding -c / N tokens\n"
            "      --batch-tokens N    most tokens per engine step, decode + prefill chunks (default 512;\n"
            "                          llama.cpp's -b and -ub)\n"
            "      --embeddings        serve POST /v1/embeddings (docs/embeddings.md; without it: 501); an\n"
            "                          encoder model (bert, nomic-bert) needs it and serves nothing else\n"
            CLI_CTX_USAGE
            "      --timeout S         close idle or stalled connections after S seconds (default 30)\n"
            "      --max-body SIZE     largest request body (default 1MiB)\n"
            "      --max-body-total SIZE  request bodies being received, all connections; past it 503\n"
            "                          (default 64MiB)\n"
            "      --max-unsent SIZE   answers made and not yet taken by the kernel, all connections; past\n"
            "                          it the connection holding most is reset (default 64MiB)\n"
            "      --answer-ids-mem SIZE  the token ids of recent chat answers, so that a conversation sent\n"
            "                          back as text takes them and hits the prefix cache (default 16MiB;\n"
            "                          0 = none kept)\n\n"
            "Limits against slow and idle clients (deadlines that a trickle of bytes does not reset):\n"
            "      --header-timeout S  a request's headers must be in S seconds after its connection opened\n"
            "                          or its previous answer ended (default 10)\n"
            "      --body-timeout S    its body S seconds after its headers (default 30)\n"
            "      --send-timeout S    an answer must be written S seconds after it is ready: a client that\n"
            "                          stops reading or reads a trickle is cut off (default 60)\n"
            "      --max-conns N       connections at once (default 4096, less if the fd limit is lower)\n"
            "      --max-conns-per-ip N  connections at once from one client address (default 256; 0 = no cap)\n"
            "      --keepalive-interval S  a request silent for S seconds gets bytes that change nothing: an\n"
            "                          SSE comment in a stream, whitespace before a whole answer's JSON (its\n"
            "                          200 then begins, chunked), so a balancer's timeout finds only hung\n"
            "                          servers (default 2; 0 = off)\n\n"
            "Access:\n"
            "      --api-key KEY       require 'Authorization: Bearer KEY' on every endpoint but /health, the\n"
            "                          web page and (unless --metrics-auth) /metrics; also from the\n"
            "                          environment variable KVLM_API_KEY\n"
            "      --api-key-file FILE the key from the first line of FILE\n"
            "      --metrics-auth      /metrics needs the key too\n"
            "      --cors-origin ORIGIN  let web pages from ORIGIN (e.g. https://app.example.com) call the API\n"
            "                          (repeatable; by default no cross-origin page can read the answers)\n"
            "      --ssl-key-file FILE, --ssl-cert-file FILE  serve HTTPS only, with this PEM key and certificate\n"
            "      --ssl-min-version V tls1.2 (default) or tls1.3: older TLS versions are refused\n\n"
            "For prefix-aware routers (docs/kv-events.md):\n"
            "      --kv-events URL     publish the KV cache's block changes in vLLM's KV-events format (ZeroMQ\n"
            "                          PUB, msgpack): tcp://*:5557 listens, tcp://HOST:5557 connects to a\n"
            "                          subscriber that listens (also ipc://PATH)\n"
            "      --kv-events-topic T the topic frame of every message (default empty, as vLLM; llm-d\n"
            "                          reads kv@POD@MODEL)\n"
            "      --kv-events-replay URL  vLLM's replay socket (ZeroMQ ROUTER, listens: tcp://*:5558): a\n"
            "                          subscriber that missed batches asks for them from a sequence number\n"
            "      --kv-events-buffer N  batches kept for replay (default 10000, as vLLM's buffer_steps)\n"
            "      --spec lookup       speculative decoding by prompt lookup: each running request's drafts\n"
            "                          checked in the same step (same output; docs/speculative.md)\n"
            "      --draft FILE        speculative decoding by a draft model (same vocabulary, e.g. a q4_0 copy\n"
            "                          made by kvlm convert; implies --spec draft): one context of its own for\n"
            "                          all requests, its own KV pool of the model's blocks and room for drafts\n"
            "                          (-md, --model-draft; --draft K with a number is --draft-n K)\n"
            "      --draft-n K         most drafts per request and step (default 8 lookup, 4 draft; at most 16)\n"
            "      --draft-p-min P     a request's drafts end before a token the draft model gives less than\n"
            "                          probability P (default 0: never; llama.cpp's --draft-p-min)\n"
            "      --draft-min N       fewer drafts than N are not checked: the request's token decodes alone\n"
            "                          (default 0; above --draft-n: --draft-n; llama.cpp's --draft-min)\n"
            "\nLogs (docs/serving.md, \"Logs\"): one line per request, a throughput line every 10 s while busy,\n"
            "preemptions and KV tier events, on stderr:\n"
            "      --log-format F      text (default) or json (one object a line)\n"
            "      --log-level L       debug, info (default: requests, throughput), warn or error\n"
            "  -v, --verbose           --log-level debug (also /health and /metrics requests)\n"
            "      --log-interval S    seconds between throughput lines while busy (default 10; 0 = none)\n"
            "      --strict-params     refuse (400) request fields kvlm does not use, instead of ignoring them\n"
            "                          and logging each name once (as vLLM does)\n"
            CLI_LLAMA_USAGE
            "  -h, --help              this help\n", kvlm_chat_family_names());
}

int cmd_serve(int argc, char **argv) {
    const char *model_path = NULL, *tmpl_file = NULL, *tok_path = NULL, *kv_mem = NULL, *evict = NULL, *max_body = NULL, *max_body_total = NULL,
               *max_unsent = NULL, *answer_mem = NULL, *reasoning = NULL;
    const char *key_file = NULL, *origin = NULL, *spec_name = NULL, *draft_path = NULL, *log_format = NULL,
               *log_level = NULL;
    float log_interval = 10;
    const char **origins = NULL;
    char *file_key = NULL;
    kvlm_server_params sp = {0};
    float keepalive = 2;
    sp.port = 8080;
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_seq_max = 16;
    cli_llama ll;
    cli_llama_init(&ll);
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) { serve_usage(stdout); return 0; }
        else if (cli_opt_str(argc, argv, &i, "-m", "--model", &model_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--tokenizer", &tok_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--host", &sp.host, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--port", &sp.port, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--alias", &sp.model_id, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--chat-template", &sp.chat_template, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--chat-template-file", &tmpl_file, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--tool-call-parser", &sp.tool_parser, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--reasoning-format", &reasoning, &bad)) {}
        else if (cli_opt_ctx(argc, argv, &i, &cp, &kv_mem, &evict, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--max-seqs", &cp.n_seq_max, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--batch-tokens", &sp.batch_tokens, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--timeout", &sp.timeout_s, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--max-body", &max_body, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--max-body-total", &max_body_total, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--max-unsent", &max_unsent, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--answer-ids-mem", &answer_mem, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--header-timeout", &sp.header_timeout_s, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--body-timeout", &sp.body_timeout_s, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--send-timeout", &sp.send_timeout_s, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--max-conns", &sp.max_conns, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--max-conns-per-ip", &sp.max_conns_per_ip, &bad)) {
            if (!bad && sp.max_conns_per_ip == 0) sp.max_conns_per_ip = -1; /* no cap */
        }
        else if (cli_opt_str(argc, argv, &i, NULL, "--api-key", &sp.api_key, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--api-key-file", &key_file, &bad)) {}
        else if (cli_is(argv[i], NULL, "--metrics-auth")) sp.metrics_auth = true;
        else if (cli_is(argv[i], NULL, "--embeddings")) sp.embeddings = true;
        else if (cli_opt_str(argc, argv, &i, NULL, "--cors-origin", &origin, &bad)) {
            if (bad) break;
            const char **o = realloc(origins, (size_t)(sp.n_cors_origins + 1) * sizeof *o);
            if (!o) { bad = true; cli_fail("serve", "out of memory"); break; }
            origins = o;
            origins[sp.n_cors_origins++] = origin;
        }
        else if (cli_opt_str(argc, argv, &i, NULL, "--ssl-key-file", &sp.ssl_key_file, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--ssl-cert-file", &sp.ssl_cert_file, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--ssl-min-version", &sp.ssl_min_version, &bad)) {}
        else if (cli_opt_float(argc, argv, &i, NULL, "--keepalive-interval", &keepalive, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--kv-events", &sp.kv_events, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--kv-events-topic", &sp.kv_events_topic, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--kv-events-replay", &sp.kv_events_replay, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--kv-events-buffer", &sp.kv_events_buffer, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--spec", &spec_name, &bad)) {}
        else if (cli_opt_float(argc, argv, &i, NULL, "--draft-p-min", &sp.spec_p_min, &bad)) {}
        else if (cli_opt_draft(argc, argv, &i, &draft_path, &sp.spec_n_draft, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--draft-min", &sp.spec_n_min, &bad) ||
                 cli_opt_int(argc, argv, &i, NULL, "--draft-n-min", &sp.spec_n_min, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--log-format", &log_format, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--log-level", &log_level, &bad)) {}
        else if (cli_is(argv[i], "-v", "--verbose")) log_level = "debug";
        else if (cli_opt_float(argc, argv, &i, NULL, "--log-interval", &log_interval, &bad)) {}
        else if (cli_is(argv[i], NULL, "--strict-params")) sp.strict_params = true;
        else if (cli_opt_llama(argc, argv, &i, &ll, &bad)) {}
        else if (cli_llama_unsupported("serve", argv[i])) { free(origins); return 1; }
        else { fprintf(stderr, "kvlm serve: unknown option '%s'\n", argv[i]); serve_usage(stderr); free(origins); return 1; }
        if (bad) { free(origins); return 1; }
    }
    sp.cors_origins = origins;
    int rc = 1;
    if (!model_path) { fprintf(stderr, "kvlm serve: no model given (-m FILE)\n"); serve_usage(stderr); goto out; }
    if (sp.port < 0 || sp.port > 65535) { cli_fail("serve", "--port must be in 0..65535"); goto out; }
    if (cp.n_seq_max < 1 || sp.batch_tokens < 0 || sp.timeout_s < 0 || sp.header_timeout_s < 0 ||
        sp.body_timeout_s < 0 || sp.send_timeout_s < 0 || sp.max_conns < 0 || sp.max_conns_per_ip < -1) {
        cli_fail("serve", "--batch-tokens, --timeout, --header-timeout, --body-timeout, --send-timeout, "
                 "--max-conns and --max-conns-per-ip must be >= 0, --max-seqs >= 1");
        goto out;
    }
    if (!(keepalive >= 0 && keepalive <= 3600)) {
        cli_fail("serve", "--keepalive-interval %g: expected seconds in 0..3600 (0 = off)", keepalive);
        goto out;
    }
    sp.keepalive_s = keepalive > 0 ? keepalive : -1;
    if (log_format && strcmp(log_format, "text") && strcmp(log_format, "json")) {
        cli_fail("serve", "--log-format %s: expected text or json", log_format);
        goto out;
    }
    int level = log_level ? kvlm_log_level_from_name(log_level) : KVLM_LOG_INFO;
    if (level < 0 || level == KVLM_LOG_OFF) {
        cli_fail("serve", "--log-level %s: expected debug, info, warn or error", log_level);
        goto out;
    }
    if (!(log_interval >= 0 && log_interval <= 86400)) {
        cli_fail("serve", "--log-interval %g: expected seconds in 0..86400 (0 = none)", log_interval);
        goto out;
    }
    sp.log_interval_s = log_interval > 0 ? log_interval : -1;
    sp.log_json = g_log_json = log_format && !strcmp(log_format, "json");
    kvlm_log_set_level(level);
    kvlm_log_set(log_line, NULL); /* every line of the library's and the server's from here on */
    if (cli_ctx_finish("serve", &cp, kv_mem, evict)) goto out;
    kvlm_model_params mp = {0};
    if (cli_llama_finish("serve", &ll, &cp, &mp)) goto out;
    sp.spec_mode = spec_name ? kvlm_spec_mode_from_name(spec_name) : draft_path ? KVLM_SPEC_DRAFT : KVLM_SPEC_NONE;
    if (sp.spec_mode < 0) { cli_fail("serve", "--spec %s: expected lookup, draft or none", spec_name); goto out; }
    if (sp.spec_mode == KVLM_SPEC_DRAFT && !draft_path) { cli_fail("serve", "--spec draft needs --draft MODEL"); goto out; }
    if (draft_path && sp.spec_mode != KVLM_SPEC_DRAFT) { cli_fail("serve", "--draft goes with --spec draft"); goto out; }
    if (draft_path && cp.device == KVLM_DEVICE_CUDA) { /* its rollback has not run on a GPU (docs/speculative.md) */
        cli_fail("serve", "--draft: speculative decoding runs on the CPU only (not --device cuda yet)");
        goto out;
    }
    if (sp.spec_n_draft < 0 || sp.spec_n_draft > 16) { cli_fail("serve", "--draft-n must be in 1..16"); goto out; }
    if (sp.spec_n_min < 0 || (sp.spec_n_min > 0 && !sp.spec_mode && !draft_path)) {
        cli_fail("serve", "--draft-min %d: expected 0 or more, with --spec lookup or --draft", sp.spec_n_min);
        goto out;
    }
    if (!(sp.spec_p_min >= 0 && sp.spec_p_min < 1) || (sp.spec_p_min > 0 && !draft_path)) {
        cli_fail("serve", "--draft-p-min %g: expected 0 <= P < 1, with --draft", sp.spec_p_min);
        goto out;
    }
    if (max_body && (cli_parse_size(max_body, &sp.max_body) || sp.max_body == 0)) {
        cli_fail("serve", "bad size '%s' (e.g. 1MiB)", max_body);
        goto out;
    }
    if (max_body_total && (cli_parse_size(max_body_total, &sp.max_body_total) || sp.max_body_total == 0)) {
        cli_fail("serve", "--max-body-total: bad size '%s' (e.g. 64MiB)", max_body_total);
        goto out;
    }
    if (max_unsent && (cli_parse_size(max_unsent, &sp.max_unsent) || sp.max_unsent == 0)) {
        cli_fail("serve", "--max-unsent: bad size '%s' (e.g. 64MiB)", max_unsent);
        goto out;
    }
    if (answer_mem) {
        size_t v = 0;
        if (cli_parse_size(answer_mem, &v) || v > ((size_t)1 << 40)) {
            cli_fail("serve", "--answer-ids-mem: bad size '%s' (e.g. 16MiB; 0: none kept)", answer_mem);
            goto out;
        }
        sp.answer_ids_mem = v ? (int64_t)v : -1;
    }
    if (!sp.api_key && key_file) { /* the first line, without its end */
        size_t len = 0;
        if (!(file_key = cli_read_file("serve", key_file, &len))) goto out;
        file_key[strcspn(file_key, "\r\n")] = '\0';
        sp.api_key = file_key;
    }
    if (!sp.api_key) sp.api_key = getenv("KVLM_API_KEY");
    if (sp.api_key && !*sp.api_key) { cli_fail("serve", "the API key is empty"); goto out; }
    /* one descriptor a connection: take all the process may have */
    struct rlimit rl;
    if (!getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
#ifdef __GLIBC__
    /* Clients' large buffers (request bodies, answers, streams' backlogs)
     * mapped on their own and unmapped when freed: glibc's moving threshold
     * would put them in its heap after the first such free, and keep their
     * pages once they go (docs/serving.md, "Memory bounds per peer"). */
    mallopt(M_MMAP_THRESHOLD, 128 << 10);
#endif
    cp.n_batch = sp.batch_tokens > 0 ? sp.batch_tokens : 512; /* one step = one pass */
    if ((sp.reasoning_format = cli_reasoning_format("serve", reasoning)) < 0) return 2;
    sp.max_seqs = cp.n_seq_max;

    /* Signals are taken by sigwait below; threads started from here inherit the mask. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    kvlm_error err = {0};
    mp.tokenizer_path = tok_path;
    kvlm_ctx *ctx = NULL, *dctx = NULL;
    kvlm_model *dmodel = NULL;
    kvlm_server *srv = NULL;
    kvlm_chat *chat = NULL;
    kvlm_model *model = cli_model_load(model_path, &mp, &err);
    if (!model) { cli_fail("serve", "%s", err.msg); goto done; }
    /* named here, the template must work; the model's own is the server's
     * to make (one it cannot render fails only chat requests) */
    if ((sp.chat_template || tmpl_file) &&
        !(sp.chat = chat = cli_chat("serve", model, sp.chat_template, tmpl_file, sp.tool_parser, sp.reasoning_format)))
        goto done;
    bool draft_shared = false;
    /* its cache in the model's pool when the shapes allow: one memory
     * budget, the model's sequences first (docs/speculative.md) */
    if (draft_path && !(dmodel = cli_load_draft("serve", draft_path, model, &cp, &draft_shared))) goto done;
    if (!(ctx = kvlm_ctx_create(model, &cp, &err))) { cli_fail("serve", "%s", err.msg); goto done; }
    kvlm_kv_stats st;
    kvlm_kv_stats_get(ctx, &st);
    if (draft_path) {
        /* One context for every request's draft sequence (the same ids, after
         * the model's in a shared pool). Else a pool of its own: as many
         * blocks as the model's plus room for every sequence's drafts (K - 1
         * tokens past its text: the blocks they may open), no eviction
         * (drafts are taken back; a sequence drafts while it fits), no tiers
         * and no swap (it rebuilds what it lost). */
        kvlm_ctx_params dcp = kvlm_ctx_default_params();
        dcp.n_ctx = kvlm_ctx_n_ctx(ctx);
        dcp.n_threads = cp.n_threads;
        dcp.n_batch = cp.n_batch;
        dcp.n_seq_max = cp.n_seq_max;
        dcp.block_size = st.block_size;
        int k = sp.spec_n_draft ? sp.spec_n_draft : 4;
        dcp.kv_blocks = st.n_blocks + cp.n_seq_max * ((k - 1 + st.block_size - 1) / st.block_size + 1);
        dcp.no_prefix_cache = cp.no_prefix_cache;
        dcp.cache_type_k = kvlm_cache_type_draft(cp.cache_type_k);
        dcp.cache_type_v = cp.cache_type_v;
        dcp.device = cp.device;
        dcp.no_kv_swap = true;
        dctx = draft_shared ? kvlm_ctx_create_draft(dmodel, ctx, &dcp, &err) : kvlm_ctx_create(dmodel, &dcp, &err);
        if (!dctx) {
            cli_fail("serve", "draft model %s: %s", draft_path, err.msg);
            goto done;
        }
        sp.draft_ctx = dctx;
    }
    if (!(srv = kvlm_server_start(ctx, &sp, &err))) {
        if (draft_path) cli_fail("serve", "draft model %s: %s", draft_path, err.msg);
        else cli_fail("serve", "%s", err.msg);
        goto done;
    }
    char evict_note[96] = ""; /* sequences then run past the context, to max_tokens */
    if (cp.kv_evict)
        snprintf(evict_note, sizeof evict_note, ", %s eviction at %d tokens a sequence", kvlm_evict_name(cp.kv_evict),
                 kvlm_ctx_kv_budget(ctx));
    kvlm_log(KVLM_LOG_INFO, "kvlm serve: context %d, %d sequences at once, KV cache %d blocks of %d tokens (%.1f MiB)%s",
             kvlm_ctx_n_ctx(ctx), cp.n_seq_max, st.n_blocks, st.block_size,
             (double)kvlm_ctx_kv_capacity_bytes(ctx) / (1 << 20), evict_note);
    if (dctx && draft_shared) {
        kvlm_kv_stats ds;
        kvlm_kv_stats_get(dctx, &ds);
        kvlm_log(KVLM_LOG_INFO, "kvlm serve: draft model %s, up to %d drafts a step, its KV cache in the model's pool "
                "(sequences %d..%d, %d of its tokens a block, keys %s; given back before any request is preempted)",
                draft_path, sp.spec_n_draft ? sp.spec_n_draft : 4, kvlm_ctx_seq_first(dctx),
                kvlm_ctx_seq_first(dctx) + kvlm_ctx_n_seq_max(dctx) - 1, ds.block_size,
                kvlm_cache_type_name(ds.type_k));
    } else if (dctx) {
        kvlm_kv_stats ds;
        kvlm_kv_stats_get(dctx, &ds);
        kvlm_log(KVLM_LOG_INFO, "kvlm serve: draft model %s, up to %d drafts a step, its KV cache %d blocks of %d tokens (%.1f MiB)",
                draft_path, sp.spec_n_draft ? sp.spec_n_draft : 4, ds.n_blocks, ds.block_size,
                (double)kvlm_ctx_kv_capacity_bytes(dctx) / (1 << 20));
    }
    const char *host = sp.host ? sp.host : "127.0.0.1";
    bool v6 = strchr(host, ':') != NULL; /* a literal IPv6 address goes in brackets in a URL */
    printf("kvlm serve: listening on %s://%s%s%s:%d\n", sp.ssl_key_file ? "https" : "http", v6 ? "[" : "", host,
           v6 ? "]" : "", kvlm_server_port(srv));
    fflush(stdout);
    int sig = 0;
    sigwait(&sigs, &sig);
    kvlm_log(KVLM_LOG_INFO, "kvlm serve: %s, stopping", sig == SIGINT ? "SIGINT" : "SIGTERM");
    static sigset_t wd_sigs; /* outlives this frame */
    wd_sigs = sigs;
    pthread_t wd;
    if (pthread_create(&wd, NULL, stop_watchdog, &wd_sigs) == 0) pthread_detach(wd);
    rc = 0;
done:
    kvlm_server_stop(srv);
    kvlm_chat_free(chat);
    kvlm_ctx_free(dctx);
    kvlm_model_free(dmodel);
    kvlm_ctx_free(ctx);
    kvlm_model_free(model);
    kvlm_log_set(NULL, NULL);
out:
    free(origins);
    free(file_key);
    return rc;
}
