/* ops/swiglu_oai: gpt-oss's gated FFN activation (llama.cpp's
 * ggml_swiglu_oai, the gpt-oss reference's swiglu): the gate clamped to at
 * most limit, the up projection to [-limit, limit], then
 * gate · sigmoid(alpha · gate) · (up + 1). Scalar: a small part of a layer's time. */
#include <math.h>
#include "ops/ops.h"

void op_swiglu_oai(float *gate, const float *up, int n, float alpha, float limit) {
    for (int i = 0; i < n; i++) {
        float g = gate[i] < limit ? gate[i] : limit, u = up[i] < -limit ? -limit : up[i] > limit ? limit : up[i];
        gate[i] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
    }
}
