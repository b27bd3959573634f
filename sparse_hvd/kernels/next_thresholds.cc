// SparseHvdNextThresholds: the sparse allreduce's step 6 forecast
// (sparse_hvd/exchanges/global_threshold.py, steps 1-4 there) for every variable in one op: the
// cut of this step's kept sums, the next threshold and the next forecast state.
//
// As TensorFlow ops it was about 45 small float64 ops a step (wheres, divisions, gathers of the
// levels), each traced in Python and run by the executor, on vectors of one entry with the
// model-wide budget; at 4 and 8 ranks on 2 cores every op's fixed cost is paid by every rank.
// Per variable v (or, with ``whole``, once over all the kept sums: the model-wide budget, the
// state taken from slot 0, the level counts and budgets summed, every slot given the result):
//
//   1. k = max(budgets[v], 1); with at least k kept sums (``enough``) the cut is their k-th
//      largest magnitude (kth_select.h), else 0;
//   2. the growth: cut / last cut within [1 / max_growth, max_growth] where both are known,
//      else the last growth;
//   3. with too few kept, theta lowered to where about k sums were (``LoweredFactor``);
//   4. the miss of this step's forecast theta x miss^2: against the cut, or the lowered theta;
//      held as the larger of it and sqrt(miss) where a forecast was judged (theta and the last
//      growth both above 0), else the last miss;
//   5. the next theta: the cut (or the lowered theta) times the growth (1 before one is
//      known), over the new miss squared.
//
// Each operation is the one the TensorFlow ops do, in their order (a quotient by 0 is 0, as
// tf.math.divide_no_nan; a clip is min then max), in double, without fused multiply-adds
// (build.py's -ffp-contract=off): every rank, and the TensorFlow path, gets the same bits.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "kth_select.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

REGISTER_OP("SparseHvdNextThresholds")
    .Attr("max_growth: float")
    .Attr("whole: bool = false")
    .Input("thetas: double")
    .Input("last_cut: double")
    .Input("growth: double")
    .Input("miss: double")
    .Input("magnitudes: double")
    .Input("cuts: int32")
    .Input("level_counts: int32")
    .Input("budgets: int32")
    .Input("levels: double")
    .Output("cut: double")
    .Output("next_theta: double")
    .Output("next_last_cut: double")
    .Output("next_growth: double")
    .Output("next_miss: double")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 0; i < 5; ++i) c->set_output(i, c->input(0));
      return tsl::OkStatus();
    });

namespace {

// tf.math.divide_no_nan
inline double DivideNoNan(double x, double y) { return y == 0.0 ? 0.0 : x / y; }
// tf.maximum and tf.minimum as Eigen computes them
inline double Max(double a, double b) { return a < b ? b : a; }
inline double Min(double a, double b) { return b < a ? b : a; }

// Step 3: the factor of theta at which about k sums would have been kept: between the first
// level below 1 that k sums reached and the level above it, where a straight line through
// their counts reaches k; the lowest level if none did.
double LoweredFactor(const int64_t* counts, const double* levels, int64_t size, int64_t k) {
  int64_t below = size - 1;
  for (int64_t j = 1; j < size; ++j) {
    if (counts[j] >= k) {
      below = j;
      break;
    }
  }
  const double upper = levels[below - 1], lower = levels[below];
  const double fewer = static_cast<double>(counts[below - 1]);
  const double more = static_cast<double>(counts[below]);
  const double budget = static_cast<double>(k);
  const double share = DivideNoNan(budget - fewer, more - fewer);
  return more >= budget ? upper - (upper - lower) * share : lower;
}

struct State {
  double theta, last_cut, growth, miss;
};

struct Next {
  double cut, theta, last_cut, growth, miss;
};

// Steps 1-5 for one variable whose kept magnitudes are values[0, size).
Next Forecast(const State& state, const double* values, int64_t size, const int64_t* counts,
              const double* levels, int64_t level_count, int64_t k, double max_growth,
              std::vector<double>* scratch) {
  const bool enough = size >= k;
  Next next;
  next.cut = enough ? KthLargestOf(values, size, k, scratch) : 0.0;
  const bool known = enough && state.last_cut > 0.0;
  const double ratio = DivideNoNan(next.cut, state.last_cut);
  next.growth = known ? Max(Min(ratio, max_growth), 1.0 / max_growth) : state.growth;
  const double lowered = state.theta * LoweredFactor(counts, levels, level_count, k);
  const double base = enough ? next.cut : lowered;
  const double predicted = state.theta * state.miss * state.miss;
  const double missed =
      enough ? Max(DivideNoNan(next.cut, predicted), DivideNoNan(predicted, next.cut))
             : DivideNoNan(predicted, lowered);
  const bool judged = state.theta > 0.0 && state.growth > 0.0;
  next.miss = judged ? Max(missed, std::sqrt(state.miss)) : state.miss;
  const double step_growth = next.growth > 0.0 ? next.growth : 1.0;
  next.theta = base * step_growth / (next.miss * next.miss);
  next.last_cut = enough ? next.cut : 0.0;
  return next;
}

}  // namespace

class NextThresholdsOp : public OpKernel {
 public:
  explicit NextThresholdsOp(OpKernelConstruction* context) : OpKernel(context) {
    float max_growth;
    OP_REQUIRES_OK(context, context->GetAttr("max_growth", &max_growth));
    OP_REQUIRES(context, max_growth >= 1.0f,
                InvalidArgumentError(absl::StrCat("max_growth must be at least 1, got ",
                                                  max_growth)));
    max_growth_ = max_growth;
    OP_REQUIRES_OK(context, context->GetAttr("whole", &whole_));
  }

  void Compute(OpKernelContext* context) override {
    const int64_t variables = context->input(0).NumElements();
    for (int i = 0; i < 4; ++i) {
      OP_REQUIRES(context, context->input(i).dims() == 1 &&
                               context->input(i).NumElements() == variables,
                  InvalidArgumentError(absl::StrCat(
                      "thetas, last_cut, growth and miss must be 1-D of one length (",
                      variables, "); input ", i, " has shape ",
                      context->input(i).shape().DebugString())));
    }
    const Tensor& levels_tensor = context->input(8);
    const int64_t level_count = levels_tensor.NumElements();
    OP_REQUIRES(context, levels_tensor.dims() == 1 && level_count >= 2,
                InvalidArgumentError("levels must be 1-D with at least 2 entries"));
    const Tensor& counts_tensor = context->input(6);
    OP_REQUIRES(context, counts_tensor.dims() == 2 && counts_tensor.dim_size(0) == variables &&
                             counts_tensor.dim_size(1) == level_count,
                InvalidArgumentError(absl::StrCat(
                    "level_counts must be [", variables, ", ", level_count, "], got ",
                    counts_tensor.shape().DebugString())));
    const Tensor& budgets_tensor = context->input(7);
    OP_REQUIRES(context, budgets_tensor.dims() == 1 && budgets_tensor.NumElements() == variables,
                InvalidArgumentError(absl::StrCat("budgets must have ", variables,
                                                  " entries, got ",
                                                  budgets_tensor.NumElements())));
    const Tensor& magnitudes_tensor = context->input(4);
    const Tensor& cuts_tensor = context->input(5);
    OP_REQUIRES(context, magnitudes_tensor.dims() == 1 && cuts_tensor.dims() == 1,
                InvalidArgumentError("magnitudes and cuts must be 1-D"));
    const int64_t length = magnitudes_tensor.NumElements();
    const int32_t* cuts = cuts_tensor.flat<int32_t>().data();
    if (!whole_) {
      OP_REQUIRES_OK(context, CheckCuts(cuts, cuts_tensor.NumElements(), variables, length,
                                        "the variables"));
    }
    Tensor* outputs[5];
    for (int i = 0; i < 5; ++i) {
      OP_REQUIRES_OK(context,
                     context->allocate_output(i, context->input(0).shape(), &outputs[i]));
    }
    if (variables == 0) return;

    auto state_of = [&](int64_t v) {
      return State{context->input(0).flat<double>()(v), context->input(1).flat<double>()(v),
                   context->input(2).flat<double>()(v), context->input(3).flat<double>()(v)};
    };
    const double* magnitudes = magnitudes_tensor.flat<double>().data();
    const double* levels = levels_tensor.flat<double>().data();
    const int32_t* counts = counts_tensor.flat<int32_t>().data();
    const int32_t* budgets = budgets_tensor.flat<int32_t>().data();
    std::vector<double> scratch;
    std::vector<int64_t> level_counts(level_count);
    auto write = [&](int64_t v, const Next& next) {
      const double fields[5] = {next.cut, next.theta, next.last_cut, next.growth, next.miss};
      for (int i = 0; i < 5; ++i) outputs[i]->flat<double>()(v) = fields[i];
    };
    if (whole_) {
      // the model as one variable: the counts and budgets summed (each sum is at most the
      // index space's size, under 2^31)
      int64_t budget = 0;
      std::fill(level_counts.begin(), level_counts.end(), 0);
      for (int64_t v = 0; v < variables; ++v) {
        budget += budgets[v];
        for (int64_t j = 0; j < level_count; ++j) {
          level_counts[j] += counts[v * level_count + j];
        }
      }
      const Next next = Forecast(state_of(0), magnitudes, length, level_counts.data(), levels,
                                 level_count, std::max<int64_t>(budget, 1), max_growth_,
                                 &scratch);
      for (int64_t v = 0; v < variables; ++v) write(v, next);
      return;
    }
    for (int64_t v = 0; v < variables; ++v) {
      for (int64_t j = 0; j < level_count; ++j) level_counts[j] = counts[v * level_count + j];
      write(v, Forecast(state_of(v), magnitudes + cuts[v], cuts[v + 1] - cuts[v],
                        level_counts.data(), levels, level_count,
                        std::max<int32_t>(budgets[v], 1), max_growth_, &scratch));
    }
  }

 private:
  double max_growth_;
  bool whole_;
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdNextThresholds").Device(tensorflow::DEVICE_CPU),
                        NextThresholdsOp);

}  // namespace sparse_hvd
