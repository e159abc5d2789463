/* tests/test_answers: the server's map of generated answers (server/answers.c)
 * on stories260K's tok512 vocabulary and ChatML: an answer recorded after a
 * prompt is taken as its ids when it comes back at its place after exactly
 * that prompt, and only then (edited, another prompt, another model's keys,
 * moved, rewritten by the template: tokenized as text); a stop string's cut
 * (at a token's end: kept; inside one: not), a stream's tail, U+FFFD; n > 1
 * answers; one text after two prompts; the LRU cap; two threads at once. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jansson.h>
#include "helpers/testutil.h"
#include "server/answers.h"

static kvlm_model *g_model;

static int setup(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    if (!path) return 0;
    kvlm_error err = {0};
    if (!(g_model = kvlm_model_load(path, NULL, &err))) fail_msg("%s: %s", path, err.msg);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    kvlm_model_free(g_model);
    return 0;
}

typedef struct {
    const char *role[12], *content[12];
    int n;
} convo;

static void say(convo *c, const char *role, const char *content) {
    c->role[c->n] = role;
    c->content[c->n++] = content;
}

typedef struct {
    int32_t *t;
    int n, reused, reused_tokens;
} toks;

/* The conversation's prompt as the server makes it (kvlm_chat_render, then
 * srv_answers_tokenize_json): through a built-in family (tmpl), or a Jinja
 * template's text (g_jinja, when set) with chat_template_kwargs kw (NULL: none). */
static const char *g_jinja, *g_kwargs;

static toks prompt_of(srv_answers *a, const convo *c, const char *tmpl) {
    char *text = NULL;
    kvlm_error err = {0};
    kvlm_chat_params cp = {.template_name = g_jinja ? NULL : tmpl, .template_text = g_jinja};
    kvlm_chat *chat = kvlm_chat_create(g_model, &cp, &err);
    if (!chat) fail_msg("%s", err.msg);
    json_t *msgs = json_array();
    for (int i = 0; i < c->n; i++) json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", c->role[i], "content", c->content[i]));
    json_t *req = json_pack("{s:O}", "messages", msgs);
    if (g_kwargs) json_object_set_new(req, "chat_template_kwargs", json_loads(g_kwargs, 0, NULL));
    char *rj = json_dumps(req, JSON_COMPACT);
    if (kvlm_chat_render(chat, rj, &text, NULL, &err)) fail_msg("%s", err.msg);
    free(rj);
    json_decref(req);
    kvlm_chat_free(chat);
    toks r = {0};
    r.t = srv_answers_tokenize_json(a, g_model, text, strlen(text), true, msgs, &r.n, &r.reused, &r.reused_tokens, &err);
    json_decref(msgs);
    if (!r.t) fail_msg("srv_answers_tokenize: %s", err.msg);
    /* without answers it is kvlm_tokenize's */
    if (!r.reused) {
        int32_t *w = malloc((size_t)r.n * sizeof *w);
        assert_int_equal(kvlm_tokenize(g_model, text, strlen(text), true, true, w, r.n, &err), r.n);
        assert_memory_equal(w, r.t, (size_t)r.n * sizeof *w);
        free(w);
    }
    free(text);
    return r;
}

/* Ids that spell s as <0xHH> byte tokens (tok512: id 3 + HH): not what s tokenizes to. */
static int32_t *byte_ids(const char *s, int *n) {
    *n = (int)strlen(s);
    int32_t *ids = malloc((size_t)*n * sizeof *ids);
    for (int i = 0; i < *n; i++) ids[i] = 3 + (unsigned char)s[i];
    return ids;
}

/* The text kvlm_detok makes of ids after prev (an answer's), flushed. */
static char *text_of(int32_t prev, const int32_t *ids, int n) {
    char *out = malloc((size_t)n * 16 + 16), piece[1024];
    size_t len = 0;
    kvlm_detok d;
    kvlm_detok_init(&d, g_model);
    d.prev = prev;
    for (int i = 0; i <= n; i++) {
        int k = i < n ? kvlm_detok_push(&d, ids[i], piece, sizeof piece) : kvlm_detok_flush(&d, piece, sizeof piece);
        memcpy(out + len, piece, (size_t)k);
        len += (size_t)k;
    }
    out[len] = 0;
    return out;
}

static void record(srv_answers *a, const toks *prompt, const int32_t *ids, int n, const char *text) {
    srv_answers_record(a, srv_answers_prompt_key(a, prompt->t, prompt->n), prompt->t[prompt->n - 1], false, ids, n, text,
                       strlen(text), 0);
}

static const char *const k_sys = "You tell short stories.", *const k_answer = "Once upon a time, a cat sat.";

/* An answer comes back at its place after the prompt it followed: its ids, and the prompt
 * before it is that prompt; edited, after another prompt, or with another map's keys: text. */
static void test_taken_only_in_place(void **state) {
    (void)state;
    if (!g_model) skip();
    srv_answers *a = srv_answers_create(1 << 20, g_model, "stories260K");
    convo c = {0};
    say(&c, "system", k_sys);
    say(&c, "user", "Tell me a story.");
    toks p1 = prompt_of(a, &c, "chatml");
    int n;
    int32_t *ids = byte_ids(k_answer, &n);
    record(a, &p1, ids, n, k_answer);
    srv_answers_stats st;
    srv_answers_stats_get(a, &st);
    assert_int_equal(st.recorded, 1);
    assert_int_equal(st.entries, 1);
    say(&c, "assistant", k_answer);
    say(&c, "user", "More.");
    toks p2 = prompt_of(a, &c, "chatml");
    assert_int_equal(p2.reused, 1);
    assert_int_equal(p2.reused_tokens, n);
    assert_true(p2.n > p1.n + n);
    assert_memory_equal(p2.t, p1.t, (size_t)p1.n * sizeof *p1.t);
    assert_memory_equal(p2.t + p1.n, ids, (size_t)n * sizeof *ids);
    /* the same answer text edited; the system message edited; another map (another model) */
    char edited[128];
    snprintf(edited, sizeof edited, "%s!", k_answer);
    c.content[2] = edited;
    toks e = prompt_of(a, &c, "chatml");
    assert_int_equal(e.reused, 0);
    c.content[2] = k_answer;
    c.content[0] = "You tell long stories.";
    toks o = prompt_of(a, &c, "chatml");
    assert_int_equal(o.reused, 0);
    c.content[0] = k_sys;
    srv_answers *other = srv_answers_create(1 << 20, g_model, "another-model");
    assert_true(memcmp(&(srv_prompt_key[1]){srv_answers_prompt_key(a, p1.t, p1.n)},
                       &(srv_prompt_key[1]){srv_answers_prompt_key(other, p1.t, p1.n)}, sizeof(srv_prompt_key)));
    toks x = prompt_of(other, &c, "chatml");
    assert_int_equal(x.reused, 0);
    /* the answer's text in a user message before its place is not it */
    convo moved = {0};
    say(&moved, "system", k_sys);
    say(&moved, "user", k_answer);
    toks mv = prompt_of(a, &moved, "chatml");
    assert_int_equal(mv.reused, 0);
    /* no map: kvlm_tokenize */
    toks none = prompt_of(NULL, &c, "chatml");
    assert_int_equal(none.reused, 0);
    srv_answers_count(a, p2.reused, p2.reused_tokens);
    srv_answers_stats_get(a, &st);
    assert_int_equal(st.reused, 1);
    assert_int_equal(st.reused_tokens, n);
    free(p1.t), free(p2.t), free(e.t), free(o.t), free(x.t), free(mv.t), free(none.t), free(ids);
    srv_answers_free(other);
    srv_answers_free(a);
}

/* A template that rewrites the answer (Gemma's trims it) leaves it to the tokenizer. */
static void test_template_rewrites(void **state) {
    (void)state;
    if (!g_model) skip();
    srv_answers *a = srv_answers_create(1 << 20, g_model, "stories260K");
    convo c = {0};
    say(&c, "user", "Tell me a story.");
    toks p1 = prompt_of(a, &c, "gemma");
    const char *spaced = "Once upon a time. ";
    int n;
    int32_t *ids = byte_ids(spaced, &n);
    record(a, &p1, ids, n, spaced);
    say(&c, "assistant", spaced);
    say(&c, "user", "More.");
    toks p2 = prompt_of(a, &c, "gemma");
    assert_int_equal(p2.reused, 0);
    /* untrimmed text is taken */
    int n2;
    int32_t *ids2 = byte_ids(k_answer, &n2);
    record(a, &p1, ids2, n2, k_answer);
    c.content[1] = k_answer;
    toks p3 = prompt_of(a, &c, "gemma");
    assert_int_equal(p3.reused, 1);
    free(p1.t), free(p2.t), free(p3.t), free(ids), free(ids2);
    srv_answers_free(a);
}

/* What the client got decides: a text cut by a stop string where a token ends keeps the
 * ids before it; inside a token, nothing; a stream's tail (the text from an offset on);
 * a text that is not the ids' is not kept; an invalid byte reads as U+FFFD. */
static void test_what_the_client_got(void **state) {
    (void)state;
    if (!g_model) skip();
    srv_answers *a = srv_answers_create(1 << 20, g_model, "stories260K");
    convo c = {0};
    say(&c, "user", "Tell me a story.");
    toks p = prompt_of(a, &c, "chatml");
    int32_t prev = p.t[p.n - 1];
    int n;
    kvlm_error err = {0};
    int32_t canon[64];
    n = kvlm_tokenize(g_model, k_answer, strlen(k_answer), false, false, canon, 64, &err);
    char *full = text_of(prev, canon, n);
    /* at a token's end: the text of the first k tokens, where token k has 2 bytes or more */
    int k = 1;
    char *cut = NULL;
    for (;; k++) {
        assert_true(k < n);
        free(cut);
        cut = text_of(prev, canon, k);
        char *next = text_of(prev, canon, k + 1);
        size_t more = strlen(next) - strlen(cut);
        free(next);
        if (more >= 2) break;
    }
    assert_true(strlen(cut) < strlen(full) && !strncmp(cut, full, strlen(cut)));
    srv_answers_record(a, srv_answers_prompt_key(a, p.t, p.n), prev, false, canon, n, cut, strlen(cut), 0);
    srv_answers_stats st;
    srv_answers_stats_get(a, &st);
    assert_int_equal(st.recorded, 1);
    say(&c, "assistant", cut);
    toks q = prompt_of(a, &c, "chatml");
    assert_int_equal(q.reused, 1);
    assert_int_equal(q.reused_tokens, k);
    assert_memory_equal(q.t + p.n, canon, (size_t)k * sizeof *canon);
    /* inside a token: one byte more than k tokens give */
    char inside[128];
    snprintf(inside, sizeof inside, "%.*s", (int)strlen(cut) + 1, full);
    srv_answers_record(a, srv_answers_prompt_key(a, p.t, p.n), prev, false, canon, n, inside, strlen(inside), 0);
    srv_answers_stats_get(a, &st);
    assert_int_equal(st.unmatched, 1);
    assert_int_equal(st.entries, 1);
    /* a stream's tail: the text from byte 7 on; and one whose tail differs */
    srv_answers *b = srv_answers_create(1 << 20, g_model, "stories260K");
    srv_answers_record(b, srv_answers_prompt_key(b, p.t, p.n), prev, false, canon, n, full + 7, strlen(full) - 7, 7);
    char wrong[128];
    snprintf(wrong, sizeof wrong, "%s", full + 7);
    wrong[3] ^= 1;
    srv_answers_record(b, srv_answers_prompt_key(b, p.t, p.n), prev, false, canon, n, wrong, strlen(wrong), 7);
    srv_answers_stats_get(b, &st);
    assert_int_equal(st.recorded, 1);
    assert_int_equal(st.unmatched, 1);
    c.content[1] = full;
    toks r = prompt_of(b, &c, "chatml");
    assert_int_equal(r.reused, 1);
    assert_int_equal(r.reused_tokens, n);
    /* a lone UTF-8 lead byte at the end: the text ends with U+FFFD */
    int32_t odd[3] = {canon[0], canon[1], 3 + 0xE2};
    char *fffd = text_of(prev, odd, 3);
    assert_non_null(strstr(fffd, "\xEF\xBF\xBD"));
    srv_answers_record(b, srv_answers_prompt_key(b, p.t, p.n), prev, false, odd, 3, fffd, strlen(fffd), 0);
    c.content[1] = fffd;
    toks f = prompt_of(b, &c, "chatml");
    assert_int_equal(f.reused, 1);
    assert_memory_equal(f.t + p.n, odd, sizeof odd);
    /* an empty answer, or ids past the cap, are not kept */
    srv_answers_stats_get(b, &st);
    uint64_t before = st.recorded;
    srv_answers_record(b, srv_answers_prompt_key(b, p.t, p.n), prev, false, canon, 0, "", 0, 0);
    srv_answers_record(b, srv_answers_prompt_key(b, p.t, p.n), prev, false, canon, SRV_ANSWER_MAX_IDS + 1, full, strlen(full), 0);
    srv_answers_stats_get(b, &st);
    assert_int_equal(st.recorded, before);
    free(full), free(cut), free(fffd), free(p.t), free(q.t), free(r.t), free(f.t);
    srv_answers_free(a);
    srv_answers_free(b);
}

/* n > 1: two answers to one prompt, each taken; one text after two prompts with other ids:
 * each prompt's own. */
static void test_several_answers(void **state) {
    (void)state;
    if (!g_model) skip();
    srv_answers *a = srv_answers_create(1 << 20, g_model, "stories260K");
    convo c1 = {0}, c2 = {0};
    say(&c1, "user", "Tell me a story.");
    say(&c2, "user", "Tell me another story.");
    toks p1 = prompt_of(a, &c1, "chatml"), p2 = prompt_of(a, &c2, "chatml");
    const char *t2 = "The dog ran home.";
    int n1, n2, nc;
    int32_t *b1 = byte_ids(k_answer, &n1), *b2 = byte_ids(t2, &n2), canon[64];
    kvlm_error err = {0};
    nc = kvlm_tokenize(g_model, k_answer, strlen(k_answer), false, false, canon, 64, &err);
    assert_true(nc < n1);
    record(a, &p1, b1, n1, k_answer);
    record(a, &p1, b2, n2, t2);
    /* the same text after the second prompt, with its canonical ids (the space SentencePiece
     * puts first spells it: the prompt's last token is not BOS) */
    char *spelled = text_of(p2.t[p2.n - 1], canon, nc);
    assert_string_equal(spelled + 1, k_answer);
    record(a, &p2, canon + 0, nc, spelled);
    free(spelled);
    spelled = text_of(p2.t[p2.n - 1], b1, n1);
    assert_string_equal(spelled, k_answer);
    free(spelled);
    record(a, &p2, b1 + 0, 0, k_answer); /* (empty: ignored) */
    /* both of the first prompt's answers */
    for (int i = 0; i < 2; i++) {
        convo c = c1;
        say(&c, "assistant", i ? t2 : k_answer);
        say(&c, "user", "More.");
        toks q = prompt_of(a, &c, "chatml");
        assert_int_equal(q.reused, 1);
        assert_memory_equal(q.t + p1.n, i ? b2 : b1, (size_t)(i ? n2 : n1) * sizeof *b1);
        free(q.t);
    }
    /* k_answer after the second prompt, with the ids recorded after the first too: the newest
     * with that text is tried first, the one recorded after this prompt is taken */
    record(a, &p2, b1, n1, k_answer);
    record(a, &p1, b1, n1, k_answer); /* the newest now: the first prompt's */
    convo c = c2;
    say(&c, "assistant", k_answer);
    toks q = prompt_of(a, &c, "chatml");
    assert_int_equal(q.reused, 1);
    assert_memory_equal(q.t + p2.n, b1, (size_t)n1 * sizeof *b1);
    free(q.t), free(p1.t), free(p2.t), free(b1), free(b2);
    srv_answers_free(a);
}

/* A candidate whose ids do not spell its text where it is (ids kept after BOS: SentencePiece's
 * first space dropped) is not taken, and the count is the taken ones' alone. */
static void test_count_after_untaken(void **state) {
    (void)state;
    if (!g_model) skip();
    srv_answers *a = srv_answers_create(1 << 20, g_model, "stories260K");
    int32_t bos = kvlm_token_bos(g_model), canon[64];
    kvlm_error err = {0};
    int nc = kvlm_tokenize(g_model, "Once upon a time", 16, false, false, canon, 64, &err);
    char *after_bos = text_of(bos, canon, nc);
    assert_string_equal(after_bos, "Once upon a time");
    toks p0 = {&bos, 1, 0, 0};
    record(a, &p0, canon, nc, after_bos);
    convo c = {0};
    say(&c, "user", "Tell me a story.");
    toks p1 = prompt_of(a, &c, "chatml");
    int n;
    int32_t *ids = byte_ids(k_answer, &n);
    record(a, &p1, ids, n, k_answer);
    say(&c, "assistant", k_answer);
    say(&c, "user", "More.");
    toks p2 = prompt_of(a, &c, "chatml");
    int n2;
    int32_t *ids2 = byte_ids("The end.", &n2);
    record(a, &p2, ids2, n2, "The end.");
    /* the first answer's place holds the text kept after BOS: not taken; the next two are */
    convo d = {0};
    say(&d, "user", "Tell me a story.");
    say(&d, "assistant", after_bos);
    say(&d, "user", "More.");
    toks q = prompt_of(a, &d, "chatml");
    assert_int_equal(q.reused, 0);
    /* an answer after that prompt: taken after the untaken one, and counted alone */
    int n3;
    int32_t *ids3 = byte_ids("Bye, bye.", &n3);
    record(a, &q, ids3, n3, "Bye, bye.");
    convo d2 = d;
    say(&d2, "assistant", "Bye, bye.");
    toks q2 = prompt_of(a, &d2, "chatml");
    assert_int_equal(q2.reused, 1);
    assert_int_equal(q2.reused_tokens, n3);
    assert_memory_equal(q2.t + q.n, ids3, (size_t)n3 * sizeof *ids3);
    free(ids3), free(q2.t);
    say(&c, "assistant", "The end.");
    toks r = prompt_of(a, &c, "chatml");
    assert_int_equal(r.reused, 2);
    assert_int_equal(r.reused_tokens, n + n2);
    convo e = c;
    e.content[1] = after_bos; /* an untaken candidate first, then answers after another prompt: none */
    toks x = prompt_of(a, &e, "chatml");
    assert_int_equal(x.reused, 0);
    free(after_bos), free(ids), free(ids2), free(p1.t), free(p2.t), free(q.t), free(r.t), free(x.t);
    srv_answers_free(a);
}

/* Through a model's own Jinja template (Qwen3's, from ../shared/chat-templates): an answer is
 * taken; one whose reasoning the template drops from earlier turns is not (its text is not in
 * the prompt as it was); with enable_thinking false the generation prompt held an empty
 * "<think>" block that the turn in the history does not: not taken (the tokens before it are
 * not the prompt it followed). */
static void test_jinja_template(void **state) {
    (void)state;
    if (!g_model) skip();
    const char *dir = getenv("KVLM_TEMPLATES"), *models = tu_model_path("stories260K.gguf");
    char path[4096];
    if (dir) snprintf(path, sizeof path, "%s/Qwen-Qwen3-0.6B.jinja", dir);
    else snprintf(path, sizeof path, "%.*s/../chat-templates/Qwen-Qwen3-0.6B.jinja",
                  (int)(strrchr(models, '/') ? strrchr(models, '/') - models : 1), strrchr(models, '/') ? models : ".");
    size_t len;
    char *jinja = tu_read_file(path, &len);
    if (!jinja) {
        print_message("SKIP: %s not found (set KVLM_TEMPLATES)\n", path);
        skip();
    }
    g_jinja = jinja;
    srv_answers *a = srv_answers_create(1 << 20, g_model, "stories260K");
    convo c = {0};
    say(&c, "user", "Tell me a story.");
    toks p1 = prompt_of(a, &c, NULL);
    const char *reasoned = "<think>\nA cat.\n</think>\n\nThe cat sat.";
    int n1, n2;
    int32_t *b1 = byte_ids(k_answer, &n1), *b2 = byte_ids(reasoned, &n2);
    record(a, &p1, b1, n1, k_answer);
    record(a, &p1, b2, n2, reasoned);
    for (int r = 0; r < 2; r++) {
        convo u = c;
        say(&u, "assistant", r ? reasoned : k_answer);
        say(&u, "user", "More.");
        toks q = prompt_of(a, &u, NULL);
        assert_int_equal(q.reused, !r);
        if (!r) assert_memory_equal(q.t + p1.n, b1, (size_t)n1 * sizeof *b1);
        free(q.t);
    }
    g_kwargs = "{\"enable_thinking\": false}";
    srv_answers *b = srv_answers_create(1 << 20, g_model, "stories260K");
    toks p2 = prompt_of(b, &c, NULL);
    assert_true(p2.n > p1.n);
    record(b, &p2, b1, n1, k_answer);
    convo u = c;
    say(&u, "assistant", k_answer);
    say(&u, "user", "More.");
    toks q = prompt_of(b, &u, NULL);
    assert_int_equal(q.reused, 0);
    srv_answers_free(b);
    g_kwargs = NULL;
    g_jinja = NULL;
    free(q.t), free(p1.t), free(p2.t), free(b1), free(b2), free(jinja);
    srv_answers_free(a);
}

/* The cap: the least recently recorded or used answers go first; bytes stay under it; an
 * answer larger than it is not kept. */
static void test_cap(void **state) {
    (void)state;
    if (!g_model) skip();
    convo c = {0};
    say(&c, "user", "Tell me a story.");
    toks p = prompt_of(NULL, &c, "chatml");
    srv_answers *probe = srv_answers_create(1 << 20, g_model, "m");
    int n;
    int32_t *ids = byte_ids("Answer 0.", &n);
    record(probe, &p, ids, n, "Answer 0.");
    srv_answers_stats st;
    srv_answers_stats_get(probe, &st);
    size_t one = st.bytes;
    srv_answers_free(probe);
    srv_answers *a = srv_answers_create(3 * one + one / 2, g_model, "m");
    char texts[10][16];
    for (int i = 0; i < 10; i++) {
        snprintf(texts[i], sizeof texts[i], "Answer %d.", i);
        free(ids);
        ids = byte_ids(texts[i], &n);
        record(a, &p, ids, n, texts[i]);
        if (i == 7) { /* 5, 6, 7 kept; 5 used: 6 goes next */
            convo u = c;
            say(&u, "assistant", texts[5]);
            toks q = prompt_of(a, &u, "chatml");
            assert_int_equal(q.reused, 1);
            free(q.t);
        }
    }
    srv_answers_stats_get(a, &st);
    assert_int_equal(st.entries, 3);
    assert_int_equal(st.recorded, 10);
    assert_int_equal(st.evicted, 7);
    assert_true(st.bytes <= st.cap);
    const int kept[] = {5, 8, 9}, gone[] = {0, 6, 7};
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < 2; k++) {
            convo u = c;
            say(&u, "assistant", texts[k ? gone[i] : kept[i]]);
            toks q = prompt_of(a, &u, "chatml");
            assert_int_equal(q.reused, !k);
            free(q.t);
        }
    char big[4096];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = 0;
    free(ids);
    ids = byte_ids(big, &n);
    record(a, &p, ids, n, big);
    srv_answers_stats_get(a, &st);
    assert_int_equal(st.entries, 3);
    free(ids);
    free(p.t);
    srv_answers_free(a);
}

/* The engine thread records while the HTTP thread tokenizes (one lock between them). */
typedef struct {
    srv_answers *a;
    toks *p;
    int rounds;
} race;

static void *recorder(void *arg) {
    race *r = arg;
    for (int i = 0; i < r->rounds; i++) {
        char t[32];
        snprintf(t, sizeof t, "Answer %d.", i % 50);
        int n;
        int32_t *ids = byte_ids(t, &n);
        record(r->a, r->p, ids, n, t);
        free(ids);
    }
    return NULL;
}

static void test_threads(void **state) {
    (void)state;
    if (!g_model) skip();
    srv_answers *a = srv_answers_create(20 * 200, g_model, "m"); /* about 20 answers: evictions too */
    convo c = {0};
    say(&c, "user", "Tell me a story.");
    toks p = prompt_of(NULL, &c, "chatml");
    race r = {a, &p, tu_quick() ? 300 : 3000};
    pthread_t th;
    pthread_create(&th, NULL, recorder, &r);
    int taken = 0;
    for (int i = 0; i < r.rounds / 10; i++) {
        char t[32];
        snprintf(t, sizeof t, "Answer %d.", i % 50);
        convo u = c;
        say(&u, "assistant", t);
        say(&u, "user", "More.");
        toks q = prompt_of(a, &u, "chatml");
        taken += q.reused;
        if (q.reused) assert_memory_equal(q.t, p.t, (size_t)p.n * sizeof *p.t);
        free(q.t);
    }
    pthread_join(th, NULL);
    srv_answers_stats st;
    srv_answers_stats_get(a, &st);
    assert_int_equal(st.recorded - st.evicted, st.entries);
    assert_true(st.bytes <= st.cap);
    print_message("%d of %d lookups took an answer while %d were recorded\n", taken, r.rounds / 10, r.rounds);
    free(p.t);
    srv_answers_free(a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_taken_only_in_place),
        cmocka_unit_test(test_template_rewrites),
        cmocka_unit_test(test_what_the_client_got),
        cmocka_unit_test(test_several_answers),
        cmocka_unit_test(test_count_after_untaken),
        cmocka_unit_test(test_jinja_template),
        cmocka_unit_test(test_cap),
        cmocka_unit_test(test_threads),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
