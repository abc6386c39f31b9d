// Runs the gradient norm's CUDA kernel (crates/model/kernels/sum_squares.cuh) on the CPU, as
// lora_gemm_host.cpp runs the LoRA kernels: each block's threads on CPU threads with a barrier
// for __syncthreads, and checks the result bit for bit against a sequential loop in the
// kernel's own order of f32 operations (per thread, then the block's tree, then the blocks in
// order), and that the ticket is left at zero. Tensors of mixed sizes, empty ones, one
// element, more elements than threads in the grid.
//
//   g++ -std=c++20 -O2 -pthread tests/cuda_host/sum_squares_host.cpp -o /tmp/sq && /tmp/sq
// (tests/tests/cuda_ops.rs runs it; exit 0 and "ok" when every case agrees)
#include "emulate.h"
#include "../../crates/model/kernels/sum_squares.cuh"

static int failures = 0;

// The kernel's order: thread t of block b sums e = b 256 + t + k 256 blocks; the block's tree;
// the blocks in order.
static float reference(const std::vector<std::vector<float>> &ts, unsigned blocks) {
    std::vector<float> flat;
    for (auto &t : ts) flat.insert(flat.end(), t.begin(), t.end());
    float sum = 0.0f;
    for (unsigned b = 0; b < blocks; ++b) {
        float red[256];
        for (unsigned t = 0; t < 256; ++t) {
            float acc = 0.0f;
            for (size_t e = (size_t)b * 256 + t; e < flat.size(); e += (size_t)blocks * 256)
                acc = std::fma(flat[e], flat[e], acc);
            red[t] = acc;
        }
        for (unsigned s = 128; s > 0; s >>= 1)
            for (unsigned t = 0; t < s; ++t) red[t] = red[t] + red[t + s];
        sum = sum + red[0];
    }
    return sum;
}

int main() {
    std::mt19937 rng(11);
    std::normal_distribution<float> d(0.0f, 1.0f);
    const std::vector<std::vector<size_t>> cases = {
        {5}, {1}, {300, 0, 17, 1024, 3}, {70000, 12, 0, 9000}, {0, 0, 40}};
    for (unsigned blocks : {1u, 3u, 7u}) {
        for (auto &sizes : cases) {
            std::vector<std::vector<float>> ts;
            TallowSqTable tab{};
            size_t total = 0;
            for (size_t j = 0; j < sizes.size(); ++j) {
                ts.emplace_back(sizes[j]);
                for (auto &v : ts.back()) v = d(rng);
                tab.start[j] = total;
                total += sizes[j];
            }
            for (size_t j = 0; j < sizes.size(); ++j) tab.t[j] = ts[j].data();
            tab.start[sizes.size()] = total;
            tab.count = sizes.size();
            std::vector<float> partials(blocks, NAN);
            unsigned ticket = 0;
            float out = NAN;
            launch(Dim{blocks, 1, 1}, 256, [&] {
                tallow_sum_squares_f32(tab, partials.data(), &ticket, &out);
            });
            const float want = reference(ts, blocks);
            const bool ok = out == want && ticket == 0;
            if (!ok) ++failures;
            std::printf("%zu tensors, %zu elements, %u blocks: %s (%.9g vs %.9g)\n", sizes.size(),
                        total, blocks, ok ? "ok" : "FAILED", out, want);
        }
    }
    if (failures) {
        std::printf("%d failures\n", failures);
        return 1;
    }
    std::printf("ok\n");
    return 0;
}
