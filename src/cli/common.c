/* cli/common: option parsing and error printing shared by the subcommands. */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>
#include "cli/cli.h"
#include "cli/llama_flags.h"

bool cli_is(const char *arg, const char *s, const char *l) {
    const char *alias;
    return (s && !strcmp(arg, s)) || (l && !strcmp(arg, l)) ||
           (l && (alias = cli_llama_alias(arg)) && !strcmp(alias, l)); /* llama.cpp's name for it */
}

int cli_fail(const char *cmd, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "kvlm %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return 1;
}

bool cli_opt_str(int argc, char **argv, int *i, const char *s, const char *l, const char **out, bool *bad) {
    if (!cli_is(argv[*i], s, l)) return false;
    if (*i + 1 >= argc) {
        fprintf(stderr, "kvlm: option %s needs a value\n", argv[*i]);
        *bad = true;
        return true;
    }
    *out = argv[++*i];
    return true;
}

bool cli_opt_cache_type(int argc, char **argv, int *i, const char *l, bool values, int *out, bool *bad) {
    const char *v;
    if (!cli_opt_str(argc, argv, i, NULL, l, &v, bad)) return false;
    if (*bad) return true;
    int t = kvlm_cache_type_from_name(v);
    if (t < 0) {
        char names[256] = "";
        int ids[32], n = kvlm_cache_types(ids, 32);
        for (int k = 0, len = 0; k < n && k < 32 && len < (int)sizeof names; k++) /* the table's, for this side */
            if (!values || kvlm_cache_type_for_values(ids[k]))
                len += snprintf(names + len, sizeof names - (size_t)len, "%s%s", len ? ", " : "",
                                kvlm_cache_type_name(ids[k]));
        fprintf(stderr, "kvlm: option %s: unknown cache type '%s' (%s)\n", l, v, names);
        *bad = true;
    } else if (values && !kvlm_cache_type_for_values(t)) {
        fprintf(stderr, "kvlm: option %s: %s quantizes keys per channel and is for keys only "
                        "(--cache-type-k); use q4_0 or q8_0 for values\n", l, v);
        *bad = true;
    } else *out = t;
    return true;
}

bool cli_opt_int(int argc, char **argv, int *i, const char *s, const char *l, int *out, bool *bad) {
    const char *v;
    if (!cli_opt_str(argc, argv, i, s, l, &v, bad)) return false;
    if (*bad) return true;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || *end || end == v || x < -2147483647L || x > 2147483647L) {
        fprintf(stderr, "kvlm: option %s: '%s' is not an integer\n", argv[*i - 1], v);
        *bad = true;
    } else *out = (int)x;
    return true;
}

bool cli_opt_u64(int argc, char **argv, int *i, const char *s, const char *l, uint64_t *out, bool *bad) {
    const char *v;
    if (!cli_opt_str(argc, argv, i, s, l, &v, bad)) return false;
    if (*bad) return true;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || *end || end == v || v[0] == '-') {
        fprintf(stderr, "kvlm: option %s: '%s' is not a non-negative integer\n", argv[*i - 1], v);
        *bad = true;
    } else *out = x;
    return true;
}

bool cli_opt_float(int argc, char **argv, int *i, const char *s, const char *l, float *out, bool *bad) {
    const char *v;
    if (!cli_opt_str(argc, argv, i, s, l, &v, bad)) return false;
    if (*bad) return true;
    char *end;
    errno = 0;
    float x = strtof(v, &end);
    if (errno || *end || end == v || x != x) {
        fprintf(stderr, "kvlm: option %s: '%s' is not a number\n", argv[*i - 1], v);
        *bad = true;
    } else *out = x;
    return true;
}

static bool cli_opt_device(int argc, char **argv, int *i, int *out, bool *bad) {
    const char *v;
    if (!cli_opt_str(argc, argv, i, "-dev", "--device", &v, bad)) return false;
    if (*bad) return true;
    int d = kvlm_device_from_name(v);
    /* llama.cpp's -dev names: none (the CPU), CUDA0, ... */
    if (d < 0 && !strcmp(v, "none")) d = KVLM_DEVICE_CPU;
    else if (d < 0 && (!strncmp(v, "CUDA", 4) || !strncmp(v, "cuda", 4))) d = KVLM_DEVICE_CUDA;
    if (d < 0) {
        fprintf(stderr, "kvlm: option --device: unknown device '%s' (cpu, cuda)\n", v);
        *bad = true;
    } else *out = d;
    return true;
}

/* --NAME SIZE with units, into a byte count. */
static bool opt_size(int argc, char **argv, int *i, const char *l, uint64_t *out, bool *bad) {
    const char *v;
    if (!cli_opt_str(argc, argv, i, NULL, l, &v, bad)) return false;
    if (*bad) return true;
    size_t n;
    if (cli_parse_size(v, &n)) {
        fprintf(stderr, "kvlm: option %s: bad size '%s' (e.g. 512MiB, 20GiB)\n", l, v);
        *bad = true;
    } else *out = n;
    return true;
}

/* --kv-swap-size SIZE; 0 turns the swap space off. */
static bool opt_swap(int argc, char **argv, int *i, kvlm_ctx_params *cp, bool *bad) {
    uint64_t n = 1;
    if (!opt_size(argc, argv, i, "--kv-swap-size", &n, bad)) return false;
    if (!*bad) {
        cp->kv_swap_size = n;
        cp->no_kv_swap = n == 0;
    }
    return true;
}

/* --logit-bias entries: one command's, for the process's life */
enum { MAX_BIAS = 256 };
static int32_t g_bias_ids[MAX_BIAS];
static float g_bias[MAX_BIAS];
/* --dry-sequence-breaker texts (argv's), likewise */
enum { MAX_DRY = 32 };
static const char *g_dry[MAX_DRY];
static int g_n_dry;

int cli_sampler_add_bias(kvlm_sampler_params *sp, int32_t id, float bias) {
    if (sp->n_bias == MAX_BIAS) return -1;
    g_bias_ids[sp->n_bias] = id;
    g_bias[sp->n_bias++] = bias;
    sp->bias_ids = g_bias_ids;
    sp->bias = g_bias;
    return 0;
}

bool cli_opt_sampler(int argc, char **argv, int *i, kvlm_sampler_params *sp, bool *seed_set, bool *bad) {
    const char *seed;
    if (cli_opt_str(argc, argv, i, NULL, "--seed", &seed, bad)) {
        /* -1: a random seed, as llama.cpp's -s -1 */
        if (!*bad && strcmp(seed, "-1")) {
            char *end;
            errno = 0;
            unsigned long long x = strtoull(seed, &end, 10);
            if (errno || *end || end == seed || seed[0] == '-') {
                fprintf(stderr, "kvlm: option %s: '%s' is not a seed (a non-negative integer, or -1 for a random one)\n",
                        argv[*i - 1], seed);
                *bad = true;
            } else {
                sp->seed = x;
                *seed_set = true;
            }
        }
        return true;
    }
    const char *lb = NULL;
    if (cli_opt_str(argc, argv, i, "-l", "--logit-bias", &lb, bad)) {
        if (*bad) return true;
        /* TOKEN_ID(+|-)BIAS, as llama.cpp takes it: 15043+1, 15043-inf. The id as the
         * server reads a logit_bias key (digits only); the bias a plain decimal or inf. */
        size_t nd = strspn(lb, "0123456789");
        int id = kvlm_parse_token_id(lb, nd);
        char sign = lb[nd];
        const char *num = lb + nd + (sign ? 1 : 0);
        char *vend = NULL;
        float v = !strcmp(num, "inf") ? INFINITY : strtof(num, &vend);
        bool plain = (sign == '+' || sign == '-') && (isdigit((unsigned char)num[0]) || num[0] == '.');
        for (const char *q = num; plain && vend && q < vend; q++) plain = strchr("0123456789.eE+-", *q) != NULL;
        if (id < 0 || !(plain || (sign && !strcmp(num, "inf"))) || isnan(v) || (vend && *vend)) {
            fprintf(stderr, "kvlm: --logit-bias %s: expected TOKEN_ID+BIAS or TOKEN_ID-BIAS, the id in decimal digits "
                            "(e.g. 15043+1, 2-inf)\n", lb);
            *bad = true;
            return true;
        }
        if (cli_sampler_add_bias(sp, id, sign == '-' ? -v : v)) {
            fprintf(stderr, "kvlm: at most %d --logit-bias options\n", MAX_BIAS);
            *bad = true;
        }
        return true;
    }
    const char *v;
    if (cli_opt_str(argc, argv, i, NULL, "--dry-sequence-breaker", &v, bad)) {
        /* llama.cpp's: the first one replaces the default breakers; "none": no breaker */
        if (*bad) return true;
        if (!strcmp(v, "none")) g_n_dry = 0;
        else if (g_n_dry == MAX_DRY) {
            fprintf(stderr, "kvlm: at most %d --dry-sequence-breaker options\n", MAX_DRY);
            *bad = true;
        } else g_dry[g_n_dry++] = v;
        sp->dry_sequence_breakers = g_dry;
        sp->n_dry_sequence_breakers = g_n_dry;
        return true;
    }
    bool seq = false;
    if (cli_opt_str(argc, argv, i, NULL, "--samplers", &v, bad) ||
        (seq = cli_opt_str(argc, argv, i, NULL, "--sampling-seq", &v, bad)) ||
        (seq = cli_opt_str(argc, argv, i, NULL, "--sampler-seq", &v, bad))) {
        /* llama.cpp's order of the stages: names separated by ';' (--samplers), or one
         * letter each (--sampling-seq dkypmxt) */
        if (*bad) return true;
        sp->n_stages = 0;
        for (const char *p = v; *p && !*bad;) {
            char name[32];
            size_t n = seq ? 1 : strcspn(p, ";");
            int st = 0;
            if (n && n < sizeof name) {
                memcpy(name, p, n);
                name[n] = 0;
                st = seq ? kvlm_sampler_stage_from_char(p[0]) : kvlm_sampler_stage_from_name(name);
            }
            if (!st || sp->n_stages == KVLM_MAX_STAGES) {
                fprintf(stderr, "kvlm: %s %s: '%.*s' is not a stage (penalties, dry, top_k, typ_p, top_p, min_p, xtc, "
                        "temperature; letters e d k y p m x t)\n", argv[*i - 1], v, (int)(n ? n : 1), p);
                *bad = true;
            } else sp->stages[sp->n_stages++] = st;
            p += n + (!seq && p[n] == ';');
        }
        return true;
    }
    if (cli_opt_int(argc, argv, i, NULL, "--repeat-last-n", &sp->repeat_last_n, bad)) {
        if (sp->repeat_last_n == -1) sp->repeat_last_n = 65536; /* llama.cpp's -1: the whole context (up to the most) */
        return true;
    }
    return cli_opt_float(argc, argv, i, NULL, "--temp", &sp->temperature, bad) ||
           cli_opt_int(argc, argv, i, NULL, "--top-k", &sp->top_k, bad) ||
           cli_opt_float(argc, argv, i, NULL, "--top-p", &sp->top_p, bad) ||
           cli_opt_float(argc, argv, i, NULL, "--min-p", &sp->min_p, bad) ||
           cli_opt_float(argc, argv, i, NULL, "--repeat-penalty", &sp->repeat_penalty, bad) ||
           cli_opt_float(argc, argv, i, NULL, "--presence-penalty", &sp->presence_penalty, bad) ||
           cli_opt_float(argc, argv, i, NULL, "--frequency-penalty", &sp->frequency_penalty, bad) ||
           cli_opt_float(argc, argv, i, NULL, "--typical", &sp->typical_p, bad) ||
           cli_opt_float(argc, argv, i, NULL, "--dry-multiplier", &sp->dry_multiplier, bad) ||
           cli_opt_float(argc, argv, i, NULL, "--dry-base", &sp->dry_base, bad) ||
           cli_opt_int(argc, argv, i, NULL, "--dry-allowed-length", &sp->dry_allowed_length, bad) ||
           cli_opt_int(argc, argv, i, NULL, "--dry-penalty-last-n", &sp->dry_penalty_last_n, bad) ||
           cli_opt_float(argc, argv, i, NULL, "--xtc-probability", &sp->xtc_probability, bad) ||
           cli_opt_float(argc, argv, i, NULL, "--xtc-threshold", &sp->xtc_threshold, bad);
}

int cli_sampler_check(const char *cmd, const kvlm_sampler_params *sp, int vocab) {
    kvlm_error err = {0};
    int i, f = kvlm_sampler_params_check(sp, vocab, &i, &err);
    if (f == KVLM_SAMPLER_OK) return 0;
    if (f == KVLM_SAMPLER_BIAS_ID || f == KVLM_SAMPLER_BIAS) {
        float b = sp->bias[i];
        return cli_fail(cmd, "--logit-bias %d%s%g: %s %s", (int)sp->bias_ids[i], b < 0 ? "-" : "+", fabsf(b),
                        f == KVLM_SAMPLER_BIAS ? "the bias" : "the token", err.msg);
    }
    /* the options' names for the fields the server calls temperature, top_k, ... */
    switch (f) {
    case KVLM_SAMPLER_TEMPERATURE: return cli_fail(cmd, "--temp %g: %s", sp->temperature, err.msg);
    case KVLM_SAMPLER_TOP_K: return cli_fail(cmd, "--top-k %d: %s", sp->top_k, err.msg);
    case KVLM_SAMPLER_TOP_P: return cli_fail(cmd, "--top-p %g: %s", sp->top_p, err.msg);
    case KVLM_SAMPLER_MIN_P: return cli_fail(cmd, "--min-p %g: %s", sp->min_p, err.msg);
    case KVLM_SAMPLER_REPEAT_PENALTY: return cli_fail(cmd, "--repeat-penalty %g: %s", sp->repeat_penalty, err.msg);
    case KVLM_SAMPLER_REPEAT_LAST_N: return cli_fail(cmd, "--repeat-last-n %d: %s", sp->repeat_last_n, err.msg);
    case KVLM_SAMPLER_FREQUENCY_PENALTY:
        return cli_fail(cmd, "--frequency-penalty %g: %s", sp->frequency_penalty, err.msg);
    case KVLM_SAMPLER_PRESENCE_PENALTY: return cli_fail(cmd, "--presence-penalty %g: %s", sp->presence_penalty, err.msg);
    case KVLM_SAMPLER_TYPICAL_P: return cli_fail(cmd, "--typical %g: %s", sp->typical_p, err.msg);
    case KVLM_SAMPLER_DRY_MULTIPLIER: return cli_fail(cmd, "--dry-multiplier %g: %s", sp->dry_multiplier, err.msg);
    case KVLM_SAMPLER_DRY_BASE: return cli_fail(cmd, "--dry-base %g: %s", sp->dry_base, err.msg);
    case KVLM_SAMPLER_DRY_ALLOWED_LENGTH:
        return cli_fail(cmd, "--dry-allowed-length %d: %s", sp->dry_allowed_length, err.msg);
    case KVLM_SAMPLER_DRY_PENALTY_LAST_N:
        return cli_fail(cmd, "--dry-penalty-last-n %d: %s", sp->dry_penalty_last_n, err.msg);
    case KVLM_SAMPLER_XTC_PROBABILITY: return cli_fail(cmd, "--xtc-probability %g: %s", sp->xtc_probability, err.msg);
    case KVLM_SAMPLER_XTC_THRESHOLD: return cli_fail(cmd, "--xtc-threshold %g: %s", sp->xtc_threshold, err.msg);
    case KVLM_SAMPLER_STAGES: return cli_fail(cmd, "--samplers: %s", err.msg);
    default: return cli_fail(cmd, "sampling: %s", err.msg); /* (fields no option sets) */
    }
}

/* --kv-key FILE: read at cli_ctx_finish; the bytes live as long as the process */
static const char *g_kv_key_file;
static unsigned char g_kv_key[4096];

/* --kv-redis-password-file: read by cli_ctx_finish */
static const char *g_redis_password_file;

bool cli_opt_ctx(int argc, char **argv, int *i, kvlm_ctx_params *cp, const char **kv_mem, const char **evict, bool *bad) {
    return opt_swap(argc, argv, i, cp, bad) ||
           cli_opt_str(argc, argv, i, NULL, "--kv-key", &g_kv_key_file, bad) ||
           cli_opt_int(argc, argv, i, "-c", "--ctx", &cp->n_ctx, bad) ||
           cli_opt_device(argc, argv, i, &cp->device, bad) ||
           opt_size(argc, argv, i, "--kv-host-size", &cp->kv_host_size, bad) ||
           cli_opt_str(argc, argv, i, NULL, "--kv-disk", &cp->kv_disk, bad) ||
           opt_size(argc, argv, i, "--kv-disk-size", &cp->kv_disk_size, bad) ||
           cli_opt_str(argc, argv, i, NULL, "--kv-redis", &cp->kv_redis, bad) ||
           cli_opt_str(argc, argv, i, NULL, "--kv-redis-password-file", &g_redis_password_file, bad) ||
           cli_opt_str(argc, argv, i, NULL, "--kv-redis-tls-ca", &cp->kv_redis_tls_ca, bad) ||
           cli_opt_str(argc, argv, i, NULL, "--kv-redis-tls-cert", &cp->kv_redis_tls_cert, bad) ||
           cli_opt_str(argc, argv, i, NULL, "--kv-redis-tls-key", &cp->kv_redis_tls_key, bad) ||
           cli_opt_int(argc, argv, i, "-t", "--threads", &cp->n_threads, bad) ||
           cli_opt_str(argc, argv, i, NULL, "--kv-mem", kv_mem, bad) ||
           cli_opt_int(argc, argv, i, NULL, "--block-size", &cp->block_size, bad) ||
           cli_opt_cache_type(argc, argv, i, "--cache-type-k", false, &cp->cache_type_k, bad) ||
           cli_opt_cache_type(argc, argv, i, "--cache-type-v", true, &cp->cache_type_v, bad) ||
           cli_opt_int(argc, argv, i, NULL, "--kv-budget", &cp->kv_budget, bad) ||
           cli_opt_str(argc, argv, i, NULL, "--kv-evict", evict, bad) ||
           cli_opt_int(argc, argv, i, NULL, "--kv-sinks", &cp->kv_sinks, bad) ||
           cli_opt_int(argc, argv, i, NULL, "--h2o-recent", &cp->h2o_recent, bad) ||
           cli_opt_float(argc, argv, i, NULL, "--h2o-heavy", &cp->h2o_heavy, bad);
}

/* The block-signing key: --kv-key FILE, else $KVLM_KV_KEY_FILE, else the
 * secret itself in $KVLM_KV_KEY; a file's one trailing newline is not part
 * of it (echo secret > FILE and KVLM_KV_KEY=secret give the same key). */
static int kv_key_finish(const char *cmd, kvlm_ctx_params *cp) {
    const char *file = g_kv_key_file, *opt = "--kv-key";
    if (!file && (file = getenv("KVLM_KV_KEY_FILE")) && *file) opt = "KVLM_KV_KEY_FILE";
    else if (!g_kv_key_file) file = NULL;
    size_t n = 0;
    if (file) {
        /* O_NONBLOCK: a FIFO must not hang the start (a link is fine: mounted secrets are links) */
        int fd = open(file, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
        struct stat st;
        if (fd < 0) return cli_fail(cmd, "%s %s: %s", opt, file, strerror(errno));
        if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > (off_t)sizeof g_kv_key) {
            close(fd);
            return cli_fail(cmd, "%s %s: not a regular file of at most %zu bytes", opt, file, sizeof g_kv_key);
        }
        ssize_t got = read(fd, g_kv_key, sizeof g_kv_key);
        close(fd);
        if (got < 0) return cli_fail(cmd, "%s %s: %s", opt, file, strerror(errno));
        n = (size_t)got;
        if (st.st_mode & (S_IRWXG | S_IRWXO))
            fprintf(stderr, "kvlm %s: warning: %s %s can be read by other users (chmod 600 it)\n", cmd, opt, file);
    } else {
        const char *env = getenv("KVLM_KV_KEY");
        if (!env || !*env) return 0;
        opt = "KVLM_KV_KEY";
        n = strlen(env);
        if (n > sizeof g_kv_key) return cli_fail(cmd, "KVLM_KV_KEY: longer than %zu bytes", sizeof g_kv_key);
        memcpy(g_kv_key, env, n);
    }
    if (n && g_kv_key[n - 1] == '\n') n--;
    if (n && g_kv_key[n - 1] == '\r') n--;
    if (n < KVLM_KV_MAC_KEY_MIN)
        return cli_fail(cmd, "%s: a block-signing key of %zu bytes is too short: give at least %d random bytes "
                        "(e.g. head -c 32 /dev/urandom | base64 > FILE)", opt, n, KVLM_KV_MAC_KEY_MIN);
    cp->kv_mac_key = g_kv_key;
    cp->kv_mac_key_len = n;
    return 0;
}

/* The Redis tier's password: the first line of --kv-redis-password-file,
 * else $KVLM_REDIS_PASSWORD, else the URL's (which anyone on the machine can
 * read in the process list: said once). 0, or 1 after an error. */
static int redis_password(const char *cmd, kvlm_ctx_params *cp) {
    if (!cp->kv_redis || !*cp->kv_redis) return 0;
    const char *env = getenv("KVLM_REDIS_PASSWORD");
    if (g_redis_password_file) {
        static char *text; /* kept for the process's life (reachable: no leak) */
        if (!text && !(text = cli_read_file(cmd, g_redis_password_file, NULL))) return 1;
        text[strcspn(text, "\n")] = 0;
        size_t n = strlen(text);
        if (n && text[n - 1] == '\r') text[--n] = 0;
        if (!n) return cli_fail(cmd, "--kv-redis-password-file %s: its first line (the password) is empty", g_redis_password_file);
        cp->kv_redis_password = text;
    } else if (env && *env) {
        cp->kv_redis_password = env;
    }
    /* a password in the URL: ":" in what comes before the last '@' after the scheme */
    const char *s = strstr(cp->kv_redis, "://"), *at;
    s = s ? s + 3 : cp->kv_redis;
    if ((at = strrchr(s, '@')) && memchr(s, ':', (size_t)(at - s)))
        fprintf(stderr, "kvlm %s: warning: the password in --kv-redis is visible to every user of this machine (ps, "
                        "/proc); give it with --kv-redis-password-file FILE or KVLM_REDIS_PASSWORD instead\n", cmd);
    return 0;
}

int cli_ctx_finish(const char *cmd, kvlm_ctx_params *cp, const char *kv_mem, const char *evict) {
    if (cp->n_ctx < 0 || cp->n_threads < 0 || cp->block_size < 0 || cp->kv_budget < 0 || cp->kv_sinks < 0 ||
        cp->h2o_recent < 0)
        return cli_fail(cmd, "--ctx, --threads, --block-size, --kv-budget, --kv-sinks and --h2o-recent must be >= 0");
    if (!(cp->h2o_heavy >= 0 && cp->h2o_heavy <= 1)) return cli_fail(cmd, "--h2o-heavy must be within 0..1");
    if (cp->n_ctx > 0 && cp->kv_budget > cp->n_ctx)
        return cli_fail(cmd, "--kv-budget %d is beyond the context of %d (raise --ctx)", cp->kv_budget, cp->n_ctx);
    if (evict && (cp->kv_evict = kvlm_evict_from_name(evict)) < 0)
        return cli_fail(cmd, "unknown --kv-evict '%s' (none, window, sinks, h2o)", evict);
    if (kv_mem && cli_parse_size(kv_mem, &cp->kv_mem))
        return cli_fail(cmd, "bad size '%s' for --kv-mem (e.g. 512MiB)", kv_mem);
    if (redis_password(cmd, cp)) return 1;
    return kv_key_finish(cmd, cp);
}

bool cli_opt_grammar(int argc, char **argv, int *i, cli_grammar_opts *g, bool *bad) {
    if (cli_is(argv[*i], NULL, "--json")) g->json = true;
    else if (!cli_opt_str(argc, argv, i, NULL, "--json-schema", &g->json_schema, bad) &&
             !cli_opt_str(argc, argv, i, NULL, "--json-schema-file", &g->json_schema_file, bad) &&
             !cli_opt_str(argc, argv, i, NULL, "--grammar", &g->grammar, bad) &&
             !cli_opt_str(argc, argv, i, NULL, "--grammar-file", &g->grammar_file, bad))
        return false;
    if (!*bad && g->n++) {
        *bad = true;
        fprintf(stderr, "kvlm: give one of --json, --json-schema, --json-schema-file, --grammar, --grammar-file\n");
    }
    return true;
}

kvlm_grammar *cli_grammar(const char *cmd, const cli_grammar_opts *g, const kvlm_model *model, bool *failed) {
    *failed = false;
    if (!g->n) return NULL;
    const char *file = g->json_schema_file ? g->json_schema_file : g->grammar_file;
    char *text = NULL;
    if (file && !(text = cli_read_file(cmd, file, NULL))) {
        *failed = true;
        return NULL;
    }
    int kind = g->json ? KVLM_GRAMMAR_JSON_OBJECT
               : g->json_schema || g->json_schema_file ? KVLM_GRAMMAR_JSON_SCHEMA
                                                       : KVLM_GRAMMAR_GBNF;
    kvlm_error err = {0};
    kvlm_grammar *gr = kvlm_grammar_build(model, kind, text ? text : g->json_schema ? g->json_schema : g->grammar, &err);
    if (!gr) cli_fail(cmd, "%s%s%s", file ? file : "", file ? ": " : "", err.msg[0] ? err.msg : "out of memory");
    free(text);
    *failed = !gr;
    return gr;
}

char *cli_read_file(const char *cmd, const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) { cli_fail(cmd, "cannot open %s: %s", path, strerror(errno)); return NULL; }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (n + 1 < cap) break;
        char *nb = realloc(buf, cap * 2);
        if (!nb) { free(buf); buf = NULL; break; }
        buf = nb;
        cap *= 2;
    }
    bool err = ferror(f);
    fclose(f);
    if (!buf || err) { free(buf); cli_fail(cmd, "cannot read %s", path); return NULL; }
    buf[n] = 0;
    if (len) *len = n;
    return buf;
}

int cli_parse_size(const char *s, size_t *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0) return -1;
    double mul = 1;
    if (!strcasecmp(end, "") || !strcasecmp(end, "b")) mul = 1;
    else if (!strcasecmp(end, "k") || !strcasecmp(end, "kib")) mul = 1024.0;
    else if (!strcasecmp(end, "m") || !strcasecmp(end, "mib")) mul = 1024.0 * 1024;
    else if (!strcasecmp(end, "g") || !strcasecmp(end, "gib")) mul = 1024.0 * 1024 * 1024;
    else if (!strcasecmp(end, "kb")) mul = 1e3;
    else if (!strcasecmp(end, "mb")) mul = 1e6;
    else if (!strcasecmp(end, "gb")) mul = 1e9;
    else return -1;
    double bytes = v * mul;
    if (bytes > 1e18) return -1;
    *out = (size_t)bytes;
    return 0;
}

kvlm_model *cli_load_draft(const char *cmd, const char *path, const kvlm_model *model, kvlm_ctx_params *cp,
                           bool *shared) {
    kvlm_error err = {0};
    kvlm_model_params dmp = {0};
    kvlm_model *dm = kvlm_model_load(path, &dmp, &err);
    if (!dm) {
        cli_fail(cmd, "draft model %s: %s", path, err.msg);
        return NULL;
    }
    if ((*shared = kvlm_draft_shares_pool(model, dm, cp))) {
        cp->n_seq_draft = cp->n_seq_max > 0 ? cp->n_seq_max : 1;
        cp->draft_model = dm; /* the pool's room for its sequences sized for its cache */
    }
    return dm;
}

int cli_reasoning_format(const char *cmd, const char *s) {
    if (!s || !strcmp(s, "auto") || !strcmp(s, "deepseek")) return KVLM_REASONING_AUTO;
    if (!strcmp(s, "none")) return KVLM_REASONING_NONE;
    cli_fail(cmd, "--reasoning-format '%s': use auto or none", s);
    return -1;
}

kvlm_chat *cli_chat(const char *cmd, const kvlm_model *model, const char *name, const char *file, const char *parser,
                    int reasoning) {
    if (name && file) { cli_fail(cmd, "--chat-template and --chat-template-file: give one"); return NULL; }
    char *text = NULL;
    if (file && !(text = cli_read_file(cmd, file, NULL))) return NULL;
    kvlm_chat_params p = {.template_name = name, .template_text = text, .template_origin = file,
                          .tool_parser = parser, .reasoning_format = reasoning};
    kvlm_error err = {0};
    kvlm_chat *c = kvlm_chat_create(model, &p, &err);
    free(text);
    if (!c) cli_fail(cmd, "%s", err.msg);
    return c;
}
