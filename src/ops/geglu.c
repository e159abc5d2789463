/* ops/geglu: Gemma's gated FFN activation, GELU (tanh approximation, as
 * llama.cpp's ggml_gelu and Hugging Face's gelu_pytorch_tanh) of the gate
 * times the up projection. Scalar: a small part of a layer's time. */
#include <math.h>
#include "ops/ops.h"

void op_geglu(float *gate, const float *up, int n) {
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (int i = 0; i < n; i++) {
        float g = gate[i];
        gate[i] = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g))) * up[i];
    }
}

void op_softcap(float *x, int n, float cap) {
    for (int i = 0; i < n; i++) x[i] = cap * tanhf(x[i] / cap);
}
