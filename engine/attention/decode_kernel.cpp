// Decode attention over the paged KV pool, one query token per sequence (engine/attention/decode_kernel.py).
//
// Built at run time by torch inductor's C++ toolchain (the one the compiled model already needs),
// specialised on the model's head sizes and head counts (WQ_D, WQ_DV, WQ_G, WQ_HKV, defined before
// this text) so the inner loops are fixed-length vector code. Per sequence: one pass over its K rows
// computes every head's scores (a row of the pool holds all KV heads of one position, so blocks are
// read front to back), a softmax per head, then one pass over its V rows. Each sequence reads only
// positions [start, len) of its blocks (a sliding window's start, else 0): no padding to the longest
// row, no copy of the context. Soft-capping (tanh(s / cap) * cap) and attention sinks (a logit per
// head in the softmax's denominator) are the variants of paged.py's dense_attention.
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>
#include <vector>

using Vec = at::vec::Vectorized<float>;
constexpr int64_t D = WQ_D, DV = WQ_DV, G = WQ_G, HKV = WQ_HKV, H = HKV * G;
constexpr int64_t VW = Vec::size(), ND = D / VW, NDV = DV / VW;
static_assert(D % VW == 0 && DV % VW == 0, "head sizes must be multiples of the vector width");

static inline float hsum(Vec a) {
    return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, a);
}

static inline float hmax(Vec a) {
    return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, a);
}

// q [B, H, D]; k_pool [blocks, bs, HKV, D]; v_pool [blocks, bs, HKV, DV]; table [B, nbs] block ids;
// lens [B]; starts [B] (read when has_starts); sinks [H] (read when has_sinks); out [B, H, DV].
extern "C" void kernel(const float* q, const float* k_pool, const float* v_pool, const int64_t* table,
                       const int64_t* lens, const int64_t* starts, const float* sinks, float* out,
                       const int64_t batch, const int64_t bs, const int64_t nbs, const int64_t threads,
                       const int64_t has_starts, const int64_t has_sinks, const float scale, const float softcap) {
    #pragma omp parallel num_threads(threads)
    {
        std::vector<float> scores;  // [H, padded length]
        std::vector<float> qs(H * D);
        std::vector<float> acc(H * DV);
        #pragma omp for schedule(dynamic, 4)
        for (int64_t b = 0; b < batch; ++b) {
            const int64_t len = lens[b];
            const int64_t first = has_starts ? starts[b] : 0;
            const int64_t lp = (len + VW - 1) / VW * VW;
            if (static_cast<int64_t>(scores.size()) < lp * H) scores.resize(lp * H);
            float* sc = scores.data();
            const int64_t* blocks = table + b * nbs;
            for (int64_t i = 0; i < H * D; i += VW) (Vec::loadu(q + b * H * D + i) * Vec(scale)).store(qs.data() + i);
            for (int64_t l = first; l < len; ++l) {
                const float* row = k_pool + (blocks[l / bs] * bs + l % bs) * HKV * D;
                for (int64_t h = 0; h < HKV; ++h) {
                    Vec k[ND];
                    for (int64_t i = 0; i < ND; ++i) k[i] = Vec::loadu(row + h * D + i * VW);
                    for (int64_t g = 0; g < G; ++g) {
                        const float* qh = qs.data() + (h * G + g) * D;
                        Vec a = Vec::loadu(qh) * k[0];
                        for (int64_t i = 1; i < ND; ++i) a = at::vec::fmadd(Vec::loadu(qh + i * VW), k[i], a);
                        float s = hsum(a);
                        if (softcap > 0.f) s = std::tanh(s / softcap) * softcap;
                        sc[(h * G + g) * lp + l] = s;
                    }
                }
            }
            float inv[H];
            for (int64_t j = 0; j < H; ++j) {
                float* s = sc + j * lp;
                for (int64_t l = 0; l < first; ++l) s[l] = -INFINITY;
                for (int64_t l = len; l < lp; ++l) s[l] = -INFINITY;
                Vec m(-INFINITY);
                for (int64_t l = 0; l < lp; l += VW) m = at::vec::maximum(m, Vec::loadu(s + l));
                float top = hmax(m);
                if (has_sinks && sinks[j] > top) top = sinks[j];
                const Vec mx(top);
                Vec sum(0.f);
                for (int64_t l = 0; l < lp; l += VW) {
                    const Vec e = (Vec::loadu(s + l) - mx).exp_u20();
                    e.store(s + l);
                    sum = sum + e;
                }
                float total = hsum(sum);
                if (has_sinks) total += std::exp(sinks[j] - top);
                inv[j] = 1.f / total;
            }
            float* a = acc.data();
            for (int64_t i = 0; i < H * DV; i += VW) Vec(0.f).store(a + i);
            for (int64_t l = first; l < len; ++l) {
                const float* row = v_pool + (blocks[l / bs] * bs + l % bs) * HKV * DV;
                for (int64_t h = 0; h < HKV; ++h) {
                    Vec v[NDV];
                    for (int64_t i = 0; i < NDV; ++i) v[i] = Vec::loadu(row + h * DV + i * VW);
                    for (int64_t g = 0; g < G; ++g) {
                        const int64_t j = h * G + g;
                        const Vec p(sc[j * lp + l]);
                        for (int64_t i = 0; i < NDV; ++i)
                            at::vec::fmadd(p, v[i], Vec::loadu(a + j * DV + i * VW)).store(a + j * DV + i * VW);
                    }
                }
            }
            float* o = out + b * H * DV;
            for (int64_t j = 0; j < H; ++j)
                for (int64_t i = 0; i < DV; i += VW) (Vec::loadu(a + j * DV + i) * Vec(inv[j])).store(o + j * DV + i);
        }
    }
}
