// The update cut's local step (``sparsify="update"``) for a plain Keras optimizer, one
// variable in one pass (sparse_hvd/feedback/fused_step.py). Keras' own step, traced as
// TensorFlow operations, takes several passes over the variable (about a dozen for Adam), and
// the update cut three more around it (a copy of the weights, the difference, the weights
// written back): 22 ms a step with Adam for the 4.35M-parameter MLP at 2 workers. Here each
// input is read once and each output written once; the weights are not written. The float32
// operations are Keras' own in Keras' order, so both give the same bits.
//
// SparseHvdLocalAdam (``keras.optimizers.Adam``/``AdamW``), per entry:
//
//   1. m' = m + (g - m) * (1 - beta_1);  v' = v + (g * g - v) * (1 - beta_2) (adam_entry.h);
//   2. w1 = w - (w * weight_decay) * learning_rate where the decoupled decay applies
//      (Keras' ``_apply_weight_decay``, before the moments' step), else w;
//   3. w2 = w1 - (m' * alpha) / (sqrt(v') + epsilon) (alpha = lr sqrt(1 - beta_2^t) /
//      (1 - beta_1^t), computed by the caller as Keras does; adam_entry.h);
//   4. the update u = w - w2 (what the weights would have lost: the update cut sends it);
//   5. with ``correct`` (``second_moment="noise_estimate"``): the noise estimate's steps of
//      noise_estimate.cc on u, m', v' and q, writing q' and the corrected u.
//
// SparseHvdLocalSgd (``keras.optimizers.SGD``), per entry: step 2 as above, then with momentum
// m' = m * momentum - g * lr and w2 = w1 + m' (Nesterov: w1 + (m' * momentum - g * lr)),
// without it w2 = w1 - g * lr; and u = w - w2 (``SgdUpdate``, sgd_entry.h).
//
// Both also say whether every u is finite (``finite``), counted in the same pass: a NaN or
// an infinity in g reaches u through every formula above (g * lr, g - m and g * g are
// non-finite, and no later operation makes them finite again), so a finite u means a finite
// g, and a u that overflowed is caught too. The caller writes the state only when it is
// finite everywhere (``feedback.local_update``): a separate reduction over the gradient
// before the step took 4.3 ms of a 131 ms step (the 4.35M MLP at 2 workers, profile_step.py).

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "adam_entry.h"
#include "finite_output.h"
#include "sgd_entry.h"
#include "vectorised.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

REGISTER_OP("SparseHvdLocalAdam")
    .Attr("correct: bool")  // step 5: second_moment="noise_estimate"
    .Input("gradient: float")  // this worker's gradient, flat
    .Input("m: float")         // Adam's first moment before the step
    .Input("v: float")         // Adam's second moment before the step
    .Input("weights: float")   // the weights before the step
    .Input("q: float")         // the beta_2 average of m_hat^2 before the step (correct), or
                               // no entries
    .Input("coefficients: float")  // see Coefficients
    .Output("update: float")
    .Output("m_out: float")
    .Output("v_out: float")
    .Output("q_out: float")  // q' (correct), or no entries
    .Output("finite: bool")  // whether every entry of update is finite
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 0; i < 3; ++i) c->set_output(i, c->input(0));
      c->set_output(3, c->input(4));
      c->set_output(4, c->Scalar());
      return tsl::OkStatus();
    });

constexpr int64_t kShard = 1 << 15;


// In the order of the op's ``coefficients``: Adam's, then the decay's (``decayed`` 1: step 2
// applies; ``kept_out`` 1: the correction leaves the decay unscaled, as
// second_moment.Decay.kept_out), then the noise estimate's (noise_estimate.cc).
struct Coefficients {
  float one_minus_beta_1, one_minus_beta_2, alpha, epsilon;
  float decayed, weight_decay, learning_rate, kept_out;
  float inv_first, stationary, shrink, workers;
};
constexpr int kCoefficients = 12;

// Steps 1-5 for entries [begin, end), the choices as template arguments (a branch in the loop
// would keep the compiler from vectorising it). The pointers do not alias (the outputs are
// fresh tensors).
template <bool kCorrect, bool kDecayed, bool kKeptOut>
SPARSE_HVD_INLINE int AdamRange(const float* __restrict g, const float* __restrict m,
                                const float* __restrict v, const float* __restrict w,
                                const float* __restrict q, float* __restrict u,
                                float* __restrict m_out, float* __restrict v_out,
                                float* __restrict q_out, int64_t begin, int64_t end,
                                const Coefficients k) {
  int not_finite = 0;
  for (int64_t i = begin; i < end; ++i) {
    float first, second;                                                       // step 1
    AdamMoments(g[i], m[i], v[i], k.one_minus_beta_1, k.one_minus_beta_2, &first, &second);
    const float decay = (w[i] * k.weight_decay) * k.learning_rate;             // step 2
    const float w1 = kDecayed ? w[i] - decay : w[i];
    const float w2 = AdamWeights(w1, first, second, k.alpha, k.epsilon);       // step 3
    float update = w[i] - w2;                                                  // step 4
    if (kCorrect) {                                                            // step 5
      const float m_hat = first * k.inv_first;
      const float e = q[i] + (m_hat * m_hat - q[i]) * k.one_minus_beta_2;
      const float s = std::max(second - e, 0.0f) * k.stationary;
      const float v_mean = std::max(second - s * k.shrink, second / k.workers);
      const float factor = (std::sqrt(second) + k.epsilon) / (std::sqrt(v_mean) + k.epsilon);
      update = kKeptOut ? (update - decay) * factor + decay : update * factor;
      q_out[i] = e;
    }
    u[i] = update;
    not_finite |= NotFinite(update);
    m_out[i] = first;
    v_out[i] = second;
  }
  return not_finite;
}

// One function per choice, each compiled for AVX2 and for the baseline.
#define SPARSE_HVD_ADAM_STEP(Name, kCorrect, kDecayed, kKeptOut)                               \
  SPARSE_HVD_VECTORISED                                                                       \
  int Name(const float* __restrict g, const float* __restrict m, const float* __restrict v,   \
            const float* __restrict w, const float* __restrict q, float* __restrict u,        \
            float* __restrict m_out, float* __restrict v_out, float* __restrict q_out,        \
            int64_t begin, int64_t end, const Coefficients k) {                               \
    return AdamRange<kCorrect, kDecayed, kKeptOut>(g, m, v, w, q, u, m_out, v_out, q_out,     \
                                                   begin, end, k);                            \
  }
SPARSE_HVD_ADAM_STEP(AdamStep, false, false, false)
SPARSE_HVD_ADAM_STEP(AdamStepDecayed, false, true, false)
SPARSE_HVD_ADAM_STEP(AdamStepCorrected, true, false, false)
SPARSE_HVD_ADAM_STEP(AdamStepCorrectedDecayed, true, true, false)
SPARSE_HVD_ADAM_STEP(AdamStepCorrectedKeptOut, true, true, true)
#undef SPARSE_HVD_ADAM_STEP

using AdamStepFunction = int (*)(const float*, const float*, const float*, const float*,
                                 const float*, float*, float*, float*, float*, int64_t,
                                 int64_t, const Coefficients);

// The function for the choices (the decay kept out of the correction only where it applies).
AdamStepFunction ChosenStep(bool correct, bool decayed, bool kept_out) {
  if (!correct) return decayed ? AdamStepDecayed : AdamStep;
  if (!decayed) return AdamStepCorrected;
  return kept_out ? AdamStepCorrectedKeptOut : AdamStepCorrectedDecayed;
}

class LocalAdamOp : public OpKernel {
 public:
  explicit LocalAdamOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("correct", &correct_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& gradient = context->input(0);
    const Tensor& m = context->input(1);
    const Tensor& v = context->input(2);
    const Tensor& weights = context->input(3);
    const Tensor& q = context->input(4);
    const Tensor& coefficients = context->input(5);
    const int64_t n = gradient.NumElements();
    OP_REQUIRES(context, gradient.dims() == 1,
                InvalidArgumentError("gradient must be 1-D (flat)"));
    OP_REQUIRES(context,
                m.NumElements() == n && v.NumElements() == n && weights.NumElements() == n,
                InvalidArgumentError("gradient, m, v and weights must have as many entries"));
    OP_REQUIRES(context, q.NumElements() == (correct_ ? n : 0),
                InvalidArgumentError(correct_ ? "q must have as many entries as gradient"
                                              : "q must be empty without correct"));
    OP_REQUIRES(context, coefficients.NumElements() == kCoefficients,
                InvalidArgumentError("coefficients must hold 12 values"));
    Tensor* outputs[4] = {nullptr, nullptr, nullptr, nullptr};
    for (int i = 0; i < 3; ++i) {
      OP_REQUIRES_OK(context, context->allocate_output(i, gradient.shape(), &outputs[i]));
    }
    OP_REQUIRES_OK(context, context->allocate_output(3, q.shape(), &outputs[3]));
    const float* c = coefficients.flat<float>().data();
    const Coefficients k{c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10],
                         c[11]};
    const float* g = gradient.flat<float>().data();
    const float* first = m.flat<float>().data();
    const float* second = v.flat<float>().data();
    const float* w = weights.flat<float>().data();
    const float* average = correct_ ? q.flat<float>().data() : nullptr;
    float* u = outputs[0]->flat<float>().data();
    float* m_out = outputs[1]->flat<float>().data();
    float* v_out = outputs[2]->flat<float>().data();
    float* q_out = correct_ ? outputs[3]->flat<float>().data() : nullptr;
    const AdamStepFunction step =
        ChosenStep(correct_, k.decayed != 0.0f, correct_ && k.kept_out != 0.0f);
    auto* pool = context->device()->tensorflow_cpu_worker_threads();
    const int64_t shards = (n + kShard - 1) / kShard;
    std::atomic<int> not_finite{0};
    tensorflow::Shard(pool->num_threads, pool->workers, shards, kShard * 40,
                      [&](int64_t begin, int64_t end) {
                        if (step(g, first, second, w, average, u, m_out, v_out, q_out,
                                 begin * kShard, std::min(n, end * kShard), k)) {
                          not_finite.store(1, std::memory_order_relaxed);
                        }
                      });
    OP_REQUIRES_OK(context, WriteFinite(context, 4, not_finite.load() == 0));
  }

 private:
  bool correct_ = false;
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdLocalAdam").Device(tensorflow::DEVICE_CPU),
                        LocalAdamOp);

REGISTER_OP("SparseHvdLocalSgd")
    .Attr("nesterov: bool")
    .Input("gradient: float")  // this worker's gradient, flat
    .Input("m: float")         // the momentum's velocity before the step, or no entries (none)
    .Input("weights: float")   // the weights before the step
    .Input("coefficients: float")  // [learning_rate, momentum, decayed, weight_decay]
    .Output("update: float")
    .Output("m_out: float")  // the velocity after the step, or no entries
    .Output("finite: bool")  // whether every entry of update is finite
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(1));
      c->set_output(2, c->Scalar());
      return tsl::OkStatus();
    });

template <bool kMomentum, bool kNesterov, bool kDecayed>
SPARSE_HVD_INLINE int SgdRange(const float* __restrict g, const float* __restrict m,
                               const float* __restrict w, float* __restrict u,
                               float* __restrict m_out, int64_t begin, int64_t end,
                               const SgdCoefficients k) {
  int not_finite = 0;
  for (int64_t i = begin; i < end; ++i) {
    float velocity = 0.0f;
    u[i] = SgdUpdate<kMomentum, kNesterov, kDecayed>(g[i], kMomentum ? m[i] : 0.0f, w[i], k,
                                                     &velocity);
    if (kMomentum) m_out[i] = velocity;
    not_finite |= NotFinite(u[i]);
  }
  return not_finite;
}

#define SPARSE_HVD_SGD_STEP(Name, kMomentum, kNesterov, kDecayed)                              \
  SPARSE_HVD_VECTORISED                                                                       \
  int Name(const float* __restrict g, const float* __restrict m, const float* __restrict w,   \
            float* __restrict u, float* __restrict m_out, int64_t begin, int64_t end,         \
            const SgdCoefficients k) {                                                        \
    return SgdRange<kMomentum, kNesterov, kDecayed>(g, m, w, u, m_out, begin, end, k);        \
  }
SPARSE_HVD_SGD_STEP(SgdStep, false, false, false)
SPARSE_HVD_SGD_STEP(SgdStepDecayed, false, false, true)
SPARSE_HVD_SGD_STEP(SgdStepMomentum, true, false, false)
SPARSE_HVD_SGD_STEP(SgdStepMomentumDecayed, true, false, true)
SPARSE_HVD_SGD_STEP(SgdStepNesterov, true, true, false)
SPARSE_HVD_SGD_STEP(SgdStepNesterovDecayed, true, true, true)
#undef SPARSE_HVD_SGD_STEP

using SgdStepFunction = int (*)(const float*, const float*, const float*, float*, float*,
                                int64_t, int64_t, const SgdCoefficients);

SgdStepFunction ChosenSgdStep(bool momentum, bool nesterov, bool decayed) {
  if (!momentum) return decayed ? SgdStepDecayed : SgdStep;
  if (!nesterov) return decayed ? SgdStepMomentumDecayed : SgdStepMomentum;
  return decayed ? SgdStepNesterovDecayed : SgdStepNesterov;
}

class LocalSgdOp : public OpKernel {
 public:
  explicit LocalSgdOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("nesterov", &nesterov_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& gradient = context->input(0);
    const Tensor& m = context->input(1);
    const Tensor& weights = context->input(2);
    const Tensor& coefficients = context->input(3);
    const int64_t n = gradient.NumElements();
    OP_REQUIRES_OK(context, CheckSgdInputs(gradient, m, coefficients));
    OP_REQUIRES(context, weights.NumElements() == n,
                InvalidArgumentError("gradient and weights must have as many entries"));
    const bool momentum = m.NumElements() > 0;
    Tensor* update = nullptr;
    Tensor* velocity = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, gradient.shape(), &update));
    OP_REQUIRES_OK(context, context->allocate_output(1, m.shape(), &velocity));
    const SgdCoefficients k = SgdCoefficientsAt(coefficients.flat<float>().data());
    const SgdStepFunction step = ChosenSgdStep(momentum, nesterov_, k.decayed != 0.0f);
    const float* g = gradient.flat<float>().data();
    const float* first = momentum ? m.flat<float>().data() : nullptr;
    const float* w = weights.flat<float>().data();
    float* u = update->flat<float>().data();
    float* m_out = momentum ? velocity->flat<float>().data() : nullptr;
    auto* pool = context->device()->tensorflow_cpu_worker_threads();
    const int64_t shards = (n + kShard - 1) / kShard;
    std::atomic<int> not_finite{0};
    tensorflow::Shard(pool->num_threads, pool->workers, shards, kShard * 16,
                      [&](int64_t begin, int64_t end) {
                        if (step(g, first, w, u, m_out, begin * kShard,
                                 std::min(n, end * kShard), k)) {
                          not_finite.store(1, std::memory_order_relaxed);
                        }
                      });
    OP_REQUIRES_OK(context, WriteFinite(context, 2, not_finite.load() == 0));
  }

 private:
  bool nesterov_ = false;
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdLocalSgd").Device(tensorflow::DEVICE_CPU), LocalSgdOp);

}  // namespace sparse_hvd
