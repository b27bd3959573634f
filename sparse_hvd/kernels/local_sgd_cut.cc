// The update cut's local SGD step, error feedback and the model-wide cut in one pass over each
// variable (sparse_hvd/feedback/fused_cut.py), for ``budget="model"`` with a plain Keras SGD.
//
// Unfused, a step reads and writes each large variable's entries in three ops:
// ``SparseHvdLocalSgd`` (g, m, w in; the update u and the velocity out), the sample of
// ``SparseHvdSampledMagnitudes`` (|u + r| at a sixteenth of the blocks), and
// ``SparseHvdCompensateCut`` (u, r in; the remainder out): eight passes over memory a step,
// two of them only to hand u from the first op to the last. Here:
//
//   1. ``SparseHvdSampledLocalSgd``: u at the sampled entries only (model_budget's blocks,
//      as SparseHvdSampledMagnitudes takes them), and |u + r| there, every variable in one op:
//      the sample the model-wide cut is read from;
//   2. ``SparseHvdLocalSgdCut``, per variable: u = the local step of each entry (the velocity
//      written), c = u + r, the remainder c (zero where |c| >= cut) and the selected positions
//      (ascending) with c at them, and whether every u and every c is finite; six passes.
//
// Every float operation is the unfused ops' own, in their order (``SgdUpdate``, sgd_entry.h,
// then one addition), so the sample, the cut, the selection, the remainder and the velocity
// are the same bits; tests/test_fused_cut.py checks it step after step.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "finite_output.h"
#include "passed_mask.h"
#include "sampled_rows.h"
#include "sgd_entry.h"
#include "vectorised.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

namespace {

// An entry that passed the cut, with its position.
struct Passed {
  float c;
  int32_t i;
};

constexpr int64_t kShardSize = 1 << 16;  // entries per shard: a list of passed entries each
constexpr int64_t kBlock = 16;           // entries scanned before looking for passed ones
static_assert(kBlock <= kPassedMaskBits, "a block's passing entries fit one mask");

struct NonFinite {
  int64_t updates = 0, compensated = 0;
};

// Step 2 for entries [begin, end). Per block, a first loop computes (it vectorises); only in
// blocks where an entry passed are the passed ones found (passed_mask.h), recorded and zeroed.
template <bool kMomentum, bool kNesterov, bool kDecayed>
SPARSE_HVD_INLINE NonFinite CutRange(const float* __restrict g, const float* __restrict m,
                                     const float* __restrict w, const float* __restrict r,
                                     float* __restrict m_out, float* __restrict out,
                                     int64_t begin, int64_t end, const SgdCoefficients k,
                                     float cut, std::vector<Passed>* passed) {
  NonFinite counts;
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t stop = std::min(end, b + kBlock);
    int hits = 0, bad_updates = 0, bad = 0;
    for (int64_t i = b; i < stop; ++i) {
      float velocity = 0.0f;
      const float u = SgdUpdate<kMomentum, kNesterov, kDecayed>(
          g[i], kMomentum ? m[i] : 0.0f, w[i], k, &velocity);
      if (kMomentum) m_out[i] = velocity;
      const float c = u + r[i];
      out[i] = c;
      bad_updates += NotFinite(u);
      hits += std::fabs(c) >= cut;  // never true for NaN
      bad += NotFinite(c);
    }
    counts.updates += bad_updates;
    counts.compensated += bad;
    if (hits == 0) continue;
    ForEachPassed(PassedMask(out + b, stop - b, cut), [&](int j) {
      passed->push_back({out[b + j], static_cast<int32_t>(b + j)});
      out[b + j] = 0.0f;
    });
  }
  return counts;
}

#define SPARSE_HVD_CUT_RANGE(Name, kMomentum, kNesterov, kDecayed)                              \
  SPARSE_HVD_VECTORISED                                                                        \
  NonFinite Name(const float* __restrict g, const float* __restrict m,                         \
                 const float* __restrict w, const float* __restrict r, float* __restrict m_out, \
                 float* __restrict out, int64_t begin, int64_t end, const SgdCoefficients k,   \
                 float cut, std::vector<Passed>* passed) {                                     \
    return CutRange<kMomentum, kNesterov, kDecayed>(g, m, w, r, m_out, out, begin, end, k,    \
                                                    cut, passed);                              \
  }
SPARSE_HVD_CUT_RANGE(CutPlain, false, false, false)
SPARSE_HVD_CUT_RANGE(CutDecayed, false, false, true)
SPARSE_HVD_CUT_RANGE(CutMomentum, true, false, false)
SPARSE_HVD_CUT_RANGE(CutMomentumDecayed, true, false, true)
SPARSE_HVD_CUT_RANGE(CutNesterov, true, true, false)
SPARSE_HVD_CUT_RANGE(CutNesterovDecayed, true, true, true)
#undef SPARSE_HVD_CUT_RANGE

using CutFunction = NonFinite (*)(const float*, const float*, const float*, const float*,
                                  float*, float*, int64_t, int64_t, const SgdCoefficients,
                                  float, std::vector<Passed>*);

CutFunction ChosenCut(bool momentum, bool nesterov, bool decayed) {
  if (!momentum) return decayed ? CutDecayed : CutPlain;
  if (!nesterov) return decayed ? CutMomentumDecayed : CutMomentum;
  return decayed ? CutNesterovDecayed : CutNesterov;
}

// Step 1's |u + r| of entries [begin, end), into ``out``.
template <bool kMomentum, bool kNesterov, bool kDecayed>
void SampledMagnitudes(const float* __restrict g, const float* __restrict m,
                       const float* __restrict w, const float* __restrict r, int64_t begin,
                       int64_t end, const SgdCoefficients& k, float* __restrict out) {
  for (int64_t i = begin; i < end; ++i) {
    float velocity = 0.0f;
    const float u = SgdUpdate<kMomentum, kNesterov, kDecayed>(g[i], kMomentum ? m[i] : 0.0f,
                                                              w[i], k, &velocity);
    *out++ = std::fabs(u + r[i]);
  }
}

using SampleFunction = void (*)(const float*, const float*, const float*, const float*,
                                int64_t, int64_t, const SgdCoefficients&, float*);

SampleFunction ChosenSample(bool momentum, bool nesterov, bool decayed) {
  if (!momentum) {
    return decayed ? SampledMagnitudes<false, false, true> : SampledMagnitudes<false, false, false>;
  }
  if (!nesterov) {
    return decayed ? SampledMagnitudes<true, false, true> : SampledMagnitudes<true, false, false>;
  }
  return decayed ? SampledMagnitudes<true, true, true> : SampledMagnitudes<true, true, false>;
}

}  // namespace

REGISTER_OP("SparseHvdLocalSgdCut")
    .Attr("nesterov: bool")
    .Input("gradient: float")      // this worker's gradient, flat
    .Input("m: float")             // the velocity before the step, or no entries (no momentum)
    .Input("weights: float")       // the weights before the step, flat
    .Input("residual: float")      // error feedback's residual, flat
    .Input("coefficients: float")  // [learning_rate, momentum, decayed, weight_decay]
    .Input("cut: float")           // the model-wide cut
    .Output("m_out: float")        // the velocity after the step, or no entries
    .Output("remainder: float")    // c with the passed entries zeroed
    .Output("indices: int32")      // the passed positions, ascending
    .Output("values: float")       // c at them
    .Output("update_finite: bool")  // whether every u is finite
    .Output("finite: bool")         // whether every c is finite
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->input(0));
      c->set_output(2, c->Vector(c->UnknownDim()));
      c->set_output(3, c->Vector(c->UnknownDim()));
      c->set_output(4, c->Scalar());
      c->set_output(5, c->Scalar());
      return tsl::OkStatus();
    });

class LocalSgdCutOp : public OpKernel {
 public:
  explicit LocalSgdCutOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("nesterov", &nesterov_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& gradient = context->input(0);
    const Tensor& m = context->input(1);
    const Tensor& weights = context->input(2);
    const Tensor& residual = context->input(3);
    const Tensor& coefficients = context->input(4);
    const int64_t n = gradient.NumElements();
    OP_REQUIRES_OK(context, CheckSgdInputs(gradient, m, coefficients));
    OP_REQUIRES(context, weights.NumElements() == n && residual.NumElements() == n,
                InvalidArgumentError("gradient, weights and residual must have as many entries"));
    OP_REQUIRES(context, n < (int64_t{1} << 31),
                InvalidArgumentError("more than 2^31 - 1 entries cannot be indexed with int32"));
    const bool momentum = m.NumElements() > 0;
    Tensor* velocity = nullptr;
    Tensor* remainder = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, m.shape(), &velocity));
    OP_REQUIRES_OK(context,
                   context->forward_input_or_allocate_output({3}, 1, gradient.shape(), &remainder));
    const SgdCoefficients k = SgdCoefficientsAt(coefficients.flat<float>().data());
    const float cut = context->input(5).scalar<float>()();
    const CutFunction scan = ChosenCut(momentum, nesterov_, k.decayed != 0.0f);
    const float* g = gradient.flat<float>().data();
    const float* first = momentum ? m.flat<float>().data() : nullptr;
    const float* w = weights.flat<float>().data();
    const float* r = residual.flat<float>().data();
    float* m_out = momentum ? velocity->flat<float>().data() : nullptr;
    float* out = remainder->flat<float>().data();

    std::vector<std::vector<Passed>> shards((n + kShardSize - 1) / kShardSize);
    std::atomic<int64_t> bad_updates{0}, bad{0};
    auto* pool = context->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(pool->num_threads, pool->workers, static_cast<int64_t>(shards.size()),
                      kShardSize * 8, [&](int64_t first_shard, int64_t last_shard) {
                        for (int64_t s = first_shard; s < last_shard; ++s) {
                          const NonFinite counts =
                              scan(g, first, w, r, m_out, out, s * kShardSize,
                                   std::min(n, (s + 1) * kShardSize), k, cut, &shards[s]);
                          bad_updates += counts.updates;
                          bad += counts.compensated;
                        }
                      });
    int64_t count = 0;
    for (const auto& shard : shards) count += static_cast<int64_t>(shard.size());
    Tensor* indices = nullptr;
    Tensor* values = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(2, TensorShape({count}), &indices));
    OP_REQUIRES_OK(context, context->allocate_output(3, TensorShape({count}), &values));
    int32_t* index_out = indices->flat<int32_t>().data();
    float* value_out = values->flat<float>().data();
    for (const auto& shard : shards) {
      for (const Passed& entry : shard) {
        *index_out++ = entry.i;
        *value_out++ = entry.c;
      }
    }
    OP_REQUIRES_OK(context, WriteFinite(context, 4, bad_updates.load() == 0));
    OP_REQUIRES_OK(context, WriteFinite(context, 5, bad.load() == 0));
  }

 private:
  bool nesterov_ = false;
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdLocalSgdCut").Device(tensorflow::DEVICE_CPU),
                        LocalSgdCutOp);

REGISTER_OP("SparseHvdSampledLocalSgd")
    .Attr("N: int >= 1")
    .Attr("block: int >= 1")
    .Attr("nesterov: bool")
    .Input("gradients: N * float")
    .Input("momenta: N * float")      // each the variable's velocity, or all without entries
    .Input("weights: N * float")
    .Input("residuals: N * float")
    .Input("coefficients: float")     // N x 4: each variable's, as SparseHvdLocalSgdCut's
    .Input("strides: int64")          // as SparseHvdSampledMagnitudes' strides
    .Output("magnitudes: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return tsl::OkStatus();
    });

class SampledLocalSgdOp : public OpKernel {
 public:
  explicit SampledLocalSgdOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("N", &variables_));
    OP_REQUIRES_OK(context, context->GetAttr("block", &block_));
    OP_REQUIRES_OK(context, context->GetAttr("nesterov", &nesterov_));
  }

  void Compute(OpKernelContext* context) override {
    const int v_count = variables_;
    const Tensor& coefficients = context->input(4 * v_count);
    OP_REQUIRES(context, coefficients.NumElements() == kSgdCoefficients * v_count,
                InvalidArgumentError(absl::StrCat("coefficients must hold 4 values for each of ",
                                                  v_count, " variables")));
    std::vector<int64_t> lengths(v_count);
    for (int v = 0; v < v_count; ++v) lengths[v] = context->input(v).NumElements();
    std::vector<Rows> rows;
    int64_t total = 0;
    OP_REQUIRES_OK(context, SampledRows(context->input(4 * v_count + 1), lengths, block_,
                                        &rows, &total));
    const bool momentum = context->input(v_count).NumElements() > 0;
    for (int v = 0; v < v_count; ++v) {
      for (int part = 1; part < 4; ++part) {
        const int64_t want = (part == 1 && !momentum) ? 0 : lengths[v];
        const int64_t have = context->input(part * v_count + v).NumElements();
        OP_REQUIRES(context, have == want,
                    InvalidArgumentError(absl::StrCat(
                        "variable ", v, ": ", have, " entries in input group ", part,
                        " where ", want, " are needed (gradients, momenta, weights, residuals; "
                        "momenta all empty or all full)")));
      }
    }
    Tensor* out_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({total}), &out_tensor));
    float* out = out_tensor->flat<float>().data();
    const float* c = coefficients.flat<float>().data();
    for (int v = 0; v < v_count; ++v) {
      const SgdCoefficients k = SgdCoefficientsAt(c + kSgdCoefficients * v);
      const SampleFunction sample = ChosenSample(momentum, nesterov_, k.decayed != 0.0f);
      const float* g = context->input(v).flat<float>().data();
      const float* m = momentum ? context->input(v_count + v).flat<float>().data() : nullptr;
      const float* w = context->input(2 * v_count + v).flat<float>().data();
      const float* r = context->input(3 * v_count + v).flat<float>().data();
      for (int64_t row = 0; row < rows[v].count; ++row) {
        const int64_t start = row * rows[v].every;
        sample(g, m, w, r, start, start + rows[v].taken, k, out);
        out += rows[v].taken;
      }
    }
  }

 private:
  int variables_;
  int64_t block_;
  bool nesterov_ = false;
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdSampledLocalSgd").Device(tensorflow::DEVICE_CPU),
                        SampledLocalSgdOp);

}  // namespace sparse_hvd
