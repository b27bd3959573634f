// SparseHvdNoiseEstimate: ``second_moment="noise_estimate"`` for one variable after each
// worker's own Adam step (sparse_hvd/feedback/second_moment.py), in one pass: per entry,
//
//   1. m_hat = m * inv_first (inv_first = 1 / (1 - beta_1^t));
//   2. q' = q + (m_hat^2 - q) * one_minus_beta_2 (the beta_2 average of m_hat^2);
//   3. s = max(v - q', 0) * stationary (the noise variance, stationary = (1 + b1) / (2 b1));
//   4. v_mean = max(v - s * shrink, v / workers) (shrink = 1 - 1 / workers);
//   5. corrected = update * (sqrt(v) + eps) / (sqrt(v_mean) + eps);
//
// and writes q' and the corrected update. With AdamW's decoupled weight decay (``weights``
// not empty) the update holds the decay d = (w * weight_decay) * learning_rate, which Keras
// took from the weights w before the moments' step: step 5 is then
// corrected = (update - d) * factor + d, so that only the moments' step is scaled (the
// decay as TensorFlow operations around the pass cost three more passes: 7.2 against 4.3 ms
// for 4.2M entries on one thread). The TensorFlow path takes about fifteen passes over the
// variable (25 ms a step for the 4.35M-parameter MLP at 2 workers); each entry's arithmetic
// is the same float32 operations in the same order, so both give the same bits.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "vectorised.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

REGISTER_OP("SparseHvdNoiseEstimate")
    .Input("update: float")  // the worker's Adam step, flat
    .Input("m: float")       // Adam's first moment after the step
    .Input("v: float")       // Adam's second moment after the step
    .Input("q: float")       // the beta_2 average of m_hat^2 before the step
    .Input("weights: float")  // the weights before the step (AdamW), or no entries
    .Input("coefficients: float")  // [inv_first, one_minus_beta_2, stationary, shrink,
                                   //  workers, epsilon, weight_decay, learning_rate]
    .Output("corrected: float")
    .Output("explained: float")  // q'
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(0));
      return tsl::OkStatus();
    });

constexpr int64_t kShard = 1 << 15;

struct Coefficients {
  float inv_first, one_minus_beta_2, stationary, shrink, workers, epsilon, weight_decay,
      learning_rate;
};

// Steps 1-5 for entries [begin, end); ``kDecayed``: the update holds AdamW's decay of the
// weights w. The pointers do not alias (the outputs are fresh tensors): said so, the loop is
// vectorised.
template <bool kDecayed>
SPARSE_HVD_INLINE void EstimateRange(const float* __restrict u, const float* __restrict first,
                   const float* __restrict second, const float* __restrict average,
                   const float* __restrict w, float* __restrict out, float* __restrict kept,
                   int64_t begin, int64_t end, const Coefficients k) {
  for (int64_t i = begin; i < end; ++i) {
    const float m_hat = first[i] * k.inv_first;                                    // step 1
    const float e = average[i] + (m_hat * m_hat - average[i]) * k.one_minus_beta_2;  // 2
    const float s = std::max(second[i] - e, 0.0f) * k.stationary;                  // step 3
    const float v_mean = std::max(second[i] - s * k.shrink, second[i] / k.workers);  // 4
    const float factor =
        (std::sqrt(second[i]) + k.epsilon) / (std::sqrt(v_mean) + k.epsilon);     // step 5
    if (kDecayed) {
      const float d = (w[i] * k.weight_decay) * k.learning_rate;  // as Keras computes it
      out[i] = (u[i] - d) * factor + d;
    } else {
      out[i] = u[i] * factor;
    }
    kept[i] = e;
  }
}

// EstimateRange for Adam and for AdamW, each compiled for AVX2 and for the baseline.
SPARSE_HVD_VECTORISED
void Estimate(const float* __restrict u, const float* __restrict first,
              const float* __restrict second, const float* __restrict average,
              float* __restrict out, float* __restrict kept, int64_t begin, int64_t end,
              const Coefficients k) {
  EstimateRange<false>(u, first, second, average, nullptr, out, kept, begin, end, k);
}

SPARSE_HVD_VECTORISED
void EstimateDecayed(const float* __restrict u, const float* __restrict first,
                     const float* __restrict second, const float* __restrict average,
                     const float* __restrict w, float* __restrict out, float* __restrict kept,
                     int64_t begin, int64_t end, const Coefficients k) {
  EstimateRange<true>(u, first, second, average, w, out, kept, begin, end, k);
}

class NoiseEstimateOp : public OpKernel {
 public:
  explicit NoiseEstimateOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& update = context->input(0);
    const Tensor& m = context->input(1);
    const Tensor& v = context->input(2);
    const Tensor& q = context->input(3);
    const Tensor& weights = context->input(4);
    const Tensor& coefficients = context->input(5);
    const int64_t n = update.NumElements();
    OP_REQUIRES(context,
                m.NumElements() == n && v.NumElements() == n && q.NumElements() == n,
                InvalidArgumentError("update, m, v and q must have as many entries"));
    const bool decayed = weights.NumElements() > 0;
    OP_REQUIRES(context, !decayed || weights.NumElements() == n,
                InvalidArgumentError("weights must be empty or have as many entries"));
    OP_REQUIRES(context, coefficients.NumElements() == 8,
                InvalidArgumentError("coefficients must hold 8 values"));
    Tensor* corrected = nullptr;
    Tensor* explained = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, update.shape(), &corrected));
    OP_REQUIRES_OK(context, context->allocate_output(1, update.shape(), &explained));
    const float* c = coefficients.flat<float>().data();
    const Coefficients k{c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]};
    const float* u = update.flat<float>().data();
    const float* first = m.flat<float>().data();
    const float* second = v.flat<float>().data();
    const float* average = q.flat<float>().data();
    const float* w = decayed ? weights.flat<float>().data() : nullptr;
    float* out = corrected->flat<float>().data();
    float* kept = explained->flat<float>().data();
    auto* pool = context->device()->tensorflow_cpu_worker_threads();
    const int64_t shards = (n + kShard - 1) / kShard;
    tensorflow::Shard(pool->num_threads, pool->workers, shards, kShard * 12,
                      [&](int64_t begin, int64_t end) {
                        const int64_t from = begin * kShard, to = std::min(n, end * kShard);
                        if (decayed) {
                          EstimateDecayed(u, first, second, average, w, out, kept, from, to,
                                          k);
                        } else {
                          Estimate(u, first, second, average, out, kept, from, to, k);
                        }
                      });
  }
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdNoiseEstimate").Device(tensorflow::DEVICE_CPU),
                        NoiseEstimateOp);

}  // namespace sparse_hvd
