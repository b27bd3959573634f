// SparseHvdSignsOfRest: the second stage of ``exchange="topk_sign"``
// (sparse_hvd/exchanges/topk_sign.py, steps 2-3) for one variable, in two passes:
//
//   1. the sum of |remainder| in double, in eight lanes (entry i in lane i % 8, the lanes
//      added in a fixed order at the end; the selected entries are zero); with ``group`` 2
//      (``exchange="topk_sign_pairs"``) the sum of |r[2j] + r[2j+1]| over the pairs j (pair j
//      in lane j % 8; a last odd entry is a pair of its own);
//   2. scale = that sum over the n - selected entries not selected, rounded to float;
//      signs = -scale where remainder < 0 (group 2: where its pair's sum is), else scale;
//      residual = remainder - signs, written
//      over the remainder when nothing else holds it (the error feedback's remainder is a
//      temporary: a fresh buffer of the variable's size costs more than this pass, in page
//      faults, under TensorFlow's default CPU allocator).
//
// The TensorFlow path takes about four passes and sums in float32, which may differ in the
// last bit of the scale: each rank sends its own scale, so replicas stay identical either way.
// Both compiled versions of the passes give the same bits (``vectorised.h``).

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "vectorised.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

REGISTER_OP("SparseHvdSignsOfRest")
    .Input("remainder: float")  // [n]: the compensated tensor, the selected entries zeroed
    .Input("selected: int32")   // the number of selected entries
    .Attr("group: int = 1")     // 1: each entry's own sign; 2: the sign of its pair's sum
    .Output("signs: float")     // [n]: +-scale
    .Output("residual: float")  // [n]: remainder - signs
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(0));
      return tsl::OkStatus();
    });

namespace {

// Pass 1: eight lanes the compiler can add at once, where one running sum would wait on each
// addition; a double holds a sum of float magnitudes nearly exactly, so the order barely
// matters, and it is fixed in the source.
SPARSE_HVD_VECTORISED
double AbsoluteSum(const float* __restrict r, int64_t n) {
  double lanes[8] = {0.0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] += std::fabs(static_cast<double>(r[i + l]));
  }
  for (; i < n; ++i) lanes[i & 7] += std::fabs(static_cast<double>(r[i]));
  return SumOfEightLanes(lanes);
}

// Pass 1 for pairs: the pair sums are taken in float, as the TensorFlow path takes them.
SPARSE_HVD_VECTORISED
double PairSumsAbsoluteSum(const float* __restrict r, int64_t n) {
  double lanes[8] = {0.0};
  const int64_t pairs = n / 2;
  int64_t j = 0;
  for (; j + 8 <= pairs; j += 8) {
    for (int l = 0; l < 8; ++l) {
      lanes[l] += std::fabs(static_cast<double>(r[2 * (j + l)] + r[2 * (j + l) + 1]));
    }
  }
  for (; j < pairs; ++j) lanes[j & 7] += std::fabs(static_cast<double>(r[2 * j] + r[2 * j + 1]));
  if (n % 2) lanes[pairs & 7] += std::fabs(static_cast<double>(r[n - 1]));
  return SumOfEightLanes(lanes);
}

// Pass 2; ``out`` may be ``r`` itself (the remainder's buffer forwarded).
SPARSE_HVD_VECTORISED
void Signed(const float* r, float scale, int64_t n, float* __restrict s, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float sign = r[i] < 0.0f ? -scale : scale;
    s[i] = sign;
    out[i] = r[i] - sign;
  }
}

// Pass 2 for pairs: both entries of a pair take the sign of its sum.
SPARSE_HVD_VECTORISED
void PairSigned(const float* r, float scale, int64_t n, float* __restrict s, float* out) {
  const int64_t pairs = n / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    const float a = r[2 * j], b = r[2 * j + 1];
    const float sign = a + b < 0.0f ? -scale : scale;
    s[2 * j] = sign;
    s[2 * j + 1] = sign;
    out[2 * j] = a - sign;
    out[2 * j + 1] = b - sign;
  }
  if (n % 2) {
    const float sign = r[n - 1] < 0.0f ? -scale : scale;
    s[n - 1] = sign;
    out[n - 1] = r[n - 1] - sign;
  }
}

}  // namespace

class SignsOfRestOp : public OpKernel {
 public:
  explicit SignsOfRestOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("group", &group_));
    OP_REQUIRES(context, group_ == 1 || group_ == 2, InvalidArgumentError("group must be 1 or 2"));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& remainder = context->input(0);
    const Tensor& selected = context->input(1);
    OP_REQUIRES(context, remainder.dims() == 1, InvalidArgumentError("remainder must be 1-D"));
    OP_REQUIRES(context, selected.dims() == 0, InvalidArgumentError("selected must be a scalar"));
    const int64_t n = remainder.dim_size(0);
    Tensor* signs = nullptr;
    Tensor* residual = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, remainder.shape(), &signs));
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output({0}, 1, remainder.shape(),
                                                                      &residual));
    const float* r = remainder.flat<float>().data();
    const int64_t rest = std::max<int64_t>(n - selected.scalar<int32_t>()(), 1);
    const double total = group_ == 1 ? AbsoluteSum(r, n) : PairSumsAbsoluteSum(r, n);
    const float scale = static_cast<float>(total / static_cast<double>(rest));
    float* s = signs->flat<float>().data();
    float* out = residual->flat<float>().data();
    if (group_ == 1) {
      Signed(r, scale, n, s, out);
    } else {
      PairSigned(r, scale, n, s, out);
    }
  }

 private:
  int group_ = 1;
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdSignsOfRest").Device(tensorflow::DEVICE_CPU),
                        SignsOfRestOp);

}  // namespace sparse_hvd
