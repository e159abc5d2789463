/* tests/test_kv_events: the KV-events payload byte for byte against what
 * Python's msgpack writes for vLLM's array_like KVEventBatch (a chain of
 * stored blocks merged into one BlockStored, a second one with a parent,
 * removals merged, AllBlocksCleared), and the 64-bit form of block keys.
 * The end-to-end subscriber test is tests/cli_serve_kv_events.sh. */
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "server/kv_events.h"

static void key(uint8_t *k, int first) {
    for (int i = 0; i < 16; i++) k[i] = (uint8_t)(first + i);
}

static void test_hash64(void **state) {
    (void)state;
    uint8_t k[16];
    key(k, 0xf0);
    assert_true(srv_kv_hash64(k) == 0xf8f9fafbfcfdfeffULL); /* the last 8 bytes, big-endian */
}

/* msgpack.packb([1.5, [["BlockStored", [h(0), h(16)], None, [1..7, 70000], 4, None, "CPU", None],
 *   ["BlockStored", [h(0xf0)], h(0x20), [9, 10, 11, 12], 4, None, "CPU", None],
 *   ["BlockRemoved", [h(0), h(0xf0)], "CPU"], ["AllBlocksCleared"]], 0])
 * with h(a) = int.from_bytes(bytes(range(a, a + 16))[8:], "big") (python3-msgpack 1.0) */
static const uint8_t k_golden[] = {
        0x93, 0xcb, 0x3f, 0xf8, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x94, 0x98, 0xab, 0x42, 0x6c, 0x6f,
        0x63, 0x6b, 0x53, 0x74, 0x6f, 0x72, 0x65, 0x64, 0x92, 0xcf, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d,
        0x0e, 0x0f, 0xcf, 0x18, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f, 0xc0, 0x98, 0x01, 0x02, 0x03,
        0x04, 0x05, 0x06, 0x07, 0xce, 0x00, 0x01, 0x11, 0x70, 0x04, 0xc0, 0xa3, 0x43, 0x50, 0x55, 0xc0,
        0x98, 0xab, 0x42, 0x6c, 0x6f, 0x63, 0x6b, 0x53, 0x74, 0x6f, 0x72, 0x65, 0x64, 0x91, 0xcf, 0xf8,
        0xf9, 0xfa, 0xfb, 0xfc, 0xfd, 0xfe, 0xff, 0xcf, 0x28, 0x29, 0x2a, 0x2b, 0x2c, 0x2d, 0x2e, 0x2f,
        0x94, 0x09, 0x0a, 0x0b, 0x0c, 0x04, 0xc0, 0xa3, 0x43, 0x50, 0x55, 0xc0, 0x93, 0xac, 0x42, 0x6c,
        0x6f, 0x63, 0x6b, 0x52, 0x65, 0x6d, 0x6f, 0x76, 0x65, 0x64, 0x92, 0xcf, 0x08, 0x09, 0x0a, 0x0b,
        0x0c, 0x0d, 0x0e, 0x0f, 0xcf, 0xf8, 0xf9, 0xfa, 0xfb, 0xfc, 0xfd, 0xfe, 0xff, 0xa3, 0x43, 0x50,
        0x55, 0x91, 0xb0, 0x41, 0x6c, 0x6c, 0x42, 0x6c, 0x6f, 0x63, 0x6b, 0x73, 0x43, 0x6c, 0x65, 0x61,
        0x72, 0x65, 0x64, 0x00
};

static void test_encode_golden(void **state) {
    (void)state;
    int32_t t1[4] = {1, 2, 3, 4}, t2[4] = {5, 6, 7, 70000}, t3[4] = {9, 10, 11, 12};
    kvlm_kv_event ev[6];
    memset(ev, 0, sizeof ev);
    ev[0].kind = KVLM_KV_EVENT_STORED; key(ev[0].hash, 0); ev[0].tokens = t1; ev[0].n_tokens = 4;
    ev[1].kind = KVLM_KV_EVENT_STORED; key(ev[1].hash, 16); key(ev[1].parent, 0); ev[1].has_parent = true;
    ev[1].tokens = t2; ev[1].n_tokens = 4;
    /* its parent is not the previous block: a BlockStored of its own */
    ev[2].kind = KVLM_KV_EVENT_STORED; key(ev[2].hash, 0xf0); key(ev[2].parent, 0x20); ev[2].has_parent = true;
    ev[2].tokens = t3; ev[2].n_tokens = 4;
    ev[3].kind = KVLM_KV_EVENT_REMOVED; key(ev[3].hash, 0);
    ev[4].kind = KVLM_KV_EVENT_REMOVED; key(ev[4].hash, 0xf0);
    ev[5].kind = 0; /* AllBlocksCleared */
    size_t len = 0;
    uint8_t *p = srv_kv_events_encode(ev, 6, 1.5, 4, "CPU", &len);
    assert_non_null(p);
    assert_int_equal(len, sizeof k_golden);
    for (size_t i = 0; i < len; i++)
        if (p[i] != k_golden[i]) fail_msg("byte %zu: 0x%02x, Python's msgpack wrote 0x%02x", i, p[i], k_golden[i]);
    free(p);
    /* an empty batch is still a well-formed one: [ts, [], 0] */
    p = srv_kv_events_encode(NULL, 0, 1.5, 4, "CPU", &len);
    assert_non_null(p);
    static const uint8_t empty[] = {0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x90, 0x00};
    assert_int_equal(len, sizeof empty);
    assert_memory_equal(p, empty, sizeof empty);
    free(p);
}

static void test_bad_endpoint(void **state) {
    (void)state;
    kvlm_error err = {0};
    assert_null(srv_kv_events_start("nonsense", NULL, "CPU", 16, &err));
    assert_true(err.code != 0 && strstr(err.msg, "--kv-events nonsense"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hash64),
        cmocka_unit_test(test_encode_golden),
        cmocka_unit_test(test_bad_endpoint),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
