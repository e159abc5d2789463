/* ops/swiglu_oai: gpt-oss's gated FFN activation (llama.cpp's
 * ggml_swiglu_oai, the gpt-oss reference's swiglu): the gate clamped to at
 * most limit, the up projection to [-limit, limit], then
 * gate · sigmoid(alpha · gate) · (up + 1). As silu(alpha · gate) / alpha ·
 * (up + 1), through op_swiglu's SIMD kernel: the clamps and scales are
 * loops the compiler vectorizes (a scalar expf per element took about a
 * quarter of a gpt-oss prefill). */
#include "ops/ops.h"

void op_swiglu_oai(float *gate, float *up, int n, float alpha, float limit) {
    for (int i = 0; i < n; i++) {
        float g = gate[i] < limit ? gate[i] : limit, u = up[i] < -limit ? -limit : up[i] > limit ? limit : up[i];
        gate[i] = alpha * g;
        up[i] = u + 1.0f;
    }
    op_swiglu(gate, up, n);
    const float inv = 1.0f / alpha;
    for (int i = 0; i < n; i++) gate[i] *= inv;
}
