/* tests/test_completion_text: a completion's text as the server sends it
 * (server/completion_text.c): stop strings found across token boundaries,
 * the end that could begin one held back and released at the end, UTF-8
 * characters split over tokens, several stops (the first to complete wins,
 * the earliest at a tie), a stop at the very start, an echoed prompt and
 * min_tokens not searched, include_stop_str_in_output, and a long stream
 * dropping what it sent. Then random texts, cuts and stops against a
 * brute-force reference: after each token the whole text searched for every
 * stop; what a stream sends is always a prefix of the final text and, at
 * the end, all of it. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "server/completion_text.h"

/* A stream's client: what it got, and the server's side. */
typedef struct {
    srv_ctext t;
    srv_stops st;
    char got[65536];
    size_t n_got;
    int which; /* the stop that ended it, or -1 */
} stream;

static void stream_init(stream *s, const char *const *stops, int n, bool include) {
    memset(s, 0, sizeof *s);
    for (int i = 0; i < n; i++) assert_true(srv_stops_add(&s->st, stops[i], strlen(stops[i])));
    s->st.include = include;
    s->which = -1;
}

/* Sends what may be sent (as the server's emit does), then drops what it can. */
static void send_ready(stream *s, bool final) {
    size_t end = srv_ctext_ready(&s->t, &s->st, final);
    if (end > s->t.sent) {
        assert_true(s->n_got + end - s->t.sent < sizeof s->got);
        memcpy(s->got + s->n_got, s->t.text + s->t.sent, end - s->t.sent);
        s->n_got += end - s->t.sent;
        s->t.sent = end;
    }
    srv_ctext_compact(&s->t, &s->st, SIZE_MAX);
}

static void push(stream *s, const char *piece, size_t n, bool before_min) {
    int w = srv_ctext_push(&s->t, &s->st, piece, n, before_min);
    if (w >= 0) {
        assert_int_equal(s->which, -1);
        s->which = w;
    }
    send_ready(s, false);
}

static void finish(stream *s) {
    srv_ctext_end(&s->t, "", 0);
    send_ready(s, true);
}

static void stream_free(stream *s) {
    srv_ctext_free(&s->t);
    srv_stops_free(&s->st);
}

/* The client got exactly want, the text is want, and stop `which` ended it. */
static void check(stream *s, const char *want, int which) {
    assert_int_equal(s->n_got, strlen(want));
    assert_memory_equal(s->got, want, s->n_got);
    assert_int_equal(s->t.off + s->t.len, strlen(want));
    assert_memory_equal(s->t.text, want + s->t.off, s->t.len);
    assert_int_equal(s->which, which);
    assert_int_equal(s->t.stopped, which >= 0);
}

static void test_stop_across_tokens(void **state) {
    (void)state;
    stream s;
    const char *stops[] = {"END"};
    stream_init(&s, stops, 1, false);
    srv_ctext_start(&s.t, NULL, 0);
    push(&s, "Hello E", 7, false);
    assert_int_equal(s.n_got, 6); /* "E" may begin "END": held back */
    assert_int_equal(srv_ctext_holdback(&s.t, &s.st), 1);
    push(&s, "N", 1, false);
    assert_int_equal(s.n_got, 6);
    assert_int_equal(srv_ctext_holdback(&s.t, &s.st), 2);
    push(&s, "D and more", 10, false);
    push(&s, " never seen", 11, false); /* after the stop: nothing is added */
    finish(&s);
    check(&s, "Hello ", 0);
    stream_free(&s);

    /* the same split three ways, with include_stop_str_in_output */
    stream_init(&s, stops, 1, true);
    srv_ctext_start(&s.t, NULL, 0);
    push(&s, "xE", 2, false);
    push(&s, "ND", 2, false);
    finish(&s);
    check(&s, "xEND", 0);
    stream_free(&s);
}

static void test_holdback_released_at_end(void **state) {
    (void)state;
    stream s;
    const char *stops[] = {"END"};
    stream_init(&s, stops, 1, false);
    srv_ctext_start(&s.t, NULL, 0);
    push(&s, "abc E", 5, false);
    push(&s, "N", 1, false);
    assert_int_equal(s.n_got, 4); /* "abc " sent, "EN" held */
    finish(&s);                   /* no D came: "EN" is text after all */
    check(&s, "abc EN", -1);
    stream_free(&s);

    /* a held-back start that the next token rules out goes out with it */
    stream_init(&s, stops, 1, false);
    srv_ctext_start(&s.t, NULL, 0);
    push(&s, "E", 1, false);
    assert_int_equal(s.n_got, 0);
    push(&s, "x", 1, false);
    assert_int_equal(s.n_got, 2);
    finish(&s);
    check(&s, "Ex", -1);
    stream_free(&s);
}

static void test_utf8_split(void **state) {
    (void)state;
    /* "é" (C3 A9) as a stop, its two bytes in two tokens' texts */
    stream s;
    const char *stops[] = {"\xC3\xA9"};
    stream_init(&s, stops, 1, false);
    srv_ctext_start(&s.t, NULL, 0);
    push(&s, "caf\xC3", 4, false);
    assert_int_equal(s.n_got, 3); /* the lead byte is held: never half a character of a stop */
    push(&s, "\xA9!", 2, false);
    finish(&s);
    check(&s, "caf", 0);
    stream_free(&s);

    /* "日本" as the stop: "日" arrives alone, then another character; the held bytes go out whole */
    const char *stops2[] = {"\xE6\x97\xA5\xE6\x9C\xAC"};
    stream_init(&s, stops2, 1, false);
    srv_ctext_start(&s.t, NULL, 0);
    push(&s, "a\xE6\x97", 3, false);
    assert_int_equal(s.n_got, 1);
    push(&s, "\xA5", 1, false);
    assert_int_equal(s.n_got, 1);
    push(&s, "\xE8\xAA\x9E", 3, false);
    finish(&s);
    check(&s, "a\xE6\x97\xA5\xE8\xAA\x9E", -1);
    stream_free(&s);
}

static void test_several_stops(void **state) {
    (void)state;
    stream s;
    /* both in one token: the earliest wins, whatever their order */
    const char *stops[] = {"xyz", "yz", "\n\n"};
    stream_init(&s, stops, 3, false);
    srv_ctext_start(&s.t, NULL, 0);
    push(&s, "ab\n\nc yz xyz", 12, false);
    finish(&s);
    check(&s, "ab", 2);
    stream_free(&s);

    /* a tie at one place: the first listed */
    const char *tie[] = {"ab", "abc"};
    stream_init(&s, tie, 2, true);
    srv_ctext_start(&s.t, NULL, 0);
    push(&s, "-abc", 4, false);
    finish(&s);
    check(&s, "-ab", 0);
    stream_free(&s);

    /* the first to complete wins over one that began earlier but ends later */
    const char *nest[] = {"abcd", "bc"};
    stream_init(&s, nest, 2, false);
    srv_ctext_start(&s.t, NULL, 0);
    push(&s, "abc", 3, false);
    push(&s, "d", 1, false);
    finish(&s);
    check(&s, "a", 1);
    stream_free(&s);
}

static void test_stop_at_start(void **state) {
    (void)state;
    stream s;
    const char *stops[] = {"STOP"};
    stream_init(&s, stops, 1, false);
    srv_ctext_start(&s.t, NULL, 0);
    push(&s, "ST", 2, false);
    assert_int_equal(s.n_got, 0);
    push(&s, "OP now", 6, false);
    finish(&s);
    check(&s, "", 0);
    stream_free(&s);
}

static void test_prefix_and_min_tokens(void **state) {
    (void)state;
    /* an echoed prompt holding the stop is neither searched nor held back */
    stream s;
    const char *stops[] = {"##"};
    stream_init(&s, stops, 1, false);
    srv_ctext_start(&s.t, "q ## #", 6);
    send_ready(&s, false);
    assert_int_equal(s.n_got, 6);
    push(&s, "# a", 3, false); /* "#" + "#" across the echo's edge: not a stop */
    push(&s, " #", 2, false);
    assert_int_equal(s.n_got, 10);
    push(&s, "# b", 3, false);
    finish(&s);
    check(&s, "q ## ## a ", 0);
    stream_free(&s);

    /* within min_tokens a stop string does not count, nor does it begin one after */
    stream_init(&s, stops, 1, false);
    srv_ctext_start(&s.t, NULL, 0);
    push(&s, "##", 2, true);
    push(&s, "#", 1, true);
    push(&s, "#x", 2, false);
    push(&s, "##y", 3, false);
    finish(&s);
    check(&s, "####x", 0);
    stream_free(&s);
}

static void test_long_stream_drops_sent(void **state) {
    (void)state;
    stream s;
    const char *stops[] = {"<end>"};
    stream_init(&s, stops, 1, false);
    srv_ctext_start(&s.t, NULL, 0);
    char want[20000];
    size_t n = 0;
    for (int i = 0; i < 3000; i++) {
        char p[8];
        int k = snprintf(p, sizeof p, "%c<e%d", 'a' + i % 26, i % 7);
        push(&s, p, (size_t)k, false);
        memcpy(want + n, p, (size_t)k);
        n += (size_t)k;
    }
    want[n] = 0;
    assert_true(s.t.off > 0);                 /* the sent part went */
    assert_true(s.t.len < 4096 + s.st.max + 8); /* what stays is bounded */
    push(&s, "<en", 3, false);
    push(&s, "d>tail", 6, false);
    finish(&s);
    check(&s, want, 0);
    stream_free(&s);
}

/* ---- random texts against a brute-force reference ---- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static unsigned rnd(unsigned n) {
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (unsigned)(g_rng % n);
}

/* The earliest start, at or after from, of any stop in text[0, len) (the first listed at a tie); -1: none. */
static long ref_find(const char *text, size_t len, size_t from, const srv_stops *st, int *which) {
    for (size_t p = from; p < len; p++)
        for (int s = 0; s < st->n; s++) {
            size_t k = strlen(st->s[s]);
            if (p + k <= len && !memcmp(text + p, st->s[s], k)) return *which = s, (long)p;
        }
    return -1;
}

static void test_random_against_reference(void **state) {
    (void)state;
    static const char *const alpha[] = {"a", "b", "ab", "ba", "\xC3\xA9", "\xC3", "\xA9", " ", "aab"};
    int rounds = getenv("KVLM_TEST_QUICK") ? 300 : 3000;
    for (int r = 0; r < rounds; r++) {
        stream s;
        memset(&s, 0, sizeof s);
        s.which = -1;
        int ns = 1 + (int)rnd(SRV_MAX_STOP);
        for (int i = 0; i < ns; i++) {
            char stop[8];
            int k = 1 + (int)rnd(4), l = 0;
            for (int j = 0; j < k && l < 4; j++) {
                const char *a = alpha[rnd(5)];
                size_t al = strlen(a);
                if (l + (int)al > 6) break;
                memcpy(stop + l, a, al);
                l += (int)al;
            }
            assert_true(srv_stops_add(&s.st, stop, (size_t)l));
        }
        s.st.include = rnd(2);
        size_t echo_n = rnd(3);
        const char *echo = "abab";
        srv_ctext_start(&s.t, echo_n ? echo : NULL, echo_n);
        send_ready(&s, false);
        /* the reference: the whole text, searched after each token */
        char ref[4096];
        size_t rl = echo_n, from = echo_n;
        memcpy(ref, echo, echo_n);
        int rwhich = -1, min_tokens = (int)rnd(3), n_tok = 1 + (int)rnd(40);
        for (int i = 1; i <= n_tok; i++) {
            char piece[16];
            size_t pn = 0;
            for (int k = (int)rnd(3); k >= 0; k--) {
                const char *a = alpha[rnd(sizeof alpha / sizeof *alpha)];
                memcpy(piece + pn, a, strlen(a));
                pn += strlen(a);
            }
            if (rwhich < 0) {
                memcpy(ref + rl, piece, pn);
                rl += pn;
                if (i <= min_tokens) from = rl;
                int w;
                long at = ref_find(ref, rl, from, &s.st, &w);
                if (at >= 0) {
                    rwhich = w;
                    rl = (size_t)at + (s.st.include ? strlen(s.st.s[w]) : 0);
                }
            }
            push(&s, piece, pn, i <= min_tokens);
            /* what was sent is never taken back */
            assert_true(s.n_got <= rl);
            assert_memory_equal(s.got, ref, s.n_got);
        }
        finish(&s);
        ref[rl] = 0;
        check(&s, ref, rwhich);
        stream_free(&s);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stop_across_tokens),
        cmocka_unit_test(test_holdback_released_at_end),
        cmocka_unit_test(test_utf8_split),
        cmocka_unit_test(test_several_stops),
        cmocka_unit_test(test_stop_at_start),
        cmocka_unit_test(test_prefix_and_min_tokens),
        cmocka_unit_test(test_long_stream_drops_sent),
        cmocka_unit_test(test_random_against_reference),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
