// SparseHvdSampledMagnitudes: |gradient + residual| at the entries the model-wide budget
// samples from every variable, in one op (sparse_hvd/selection/model_budget.py).
//
// Per variable with TensorFlow ops the sample took about 30 traced operations (two strided
// slices and their reshapes for the gradient and the residual, an add, an absolute value, a
// cast, and the exact branch's own), thousands for a model with a hundred large variables,
// each traced in Python and run by the executor. Here, one op:
//
//   1. variable v has n entries (gradients[v] and residuals[v] are read flat and must have
//      as many); strides[v] = 0 takes every entry; strides[v] = S > 0 takes the first
//      min(block, S) entries of each of the max(n / S, 1) rows of S entries, where a
//      variable shorter than S has one row, its n entries (``model_budget.sampled_blocks``);
//   2. each taken entry's |g + r| in float32 (the same bits as TensorFlow's add and abs), in
//      the variables' order.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "sampled_rows.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

REGISTER_OP("SparseHvdSampledMagnitudes")
    .Attr("N: int >= 1")
    .Attr("block: int >= 1")
    .Input("gradients: N * float")
    .Input("residuals: N * float")
    .Input("strides: int64")
    .Output("magnitudes: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return tsl::OkStatus();
    });

class SampledMagnitudesOp : public OpKernel {
 public:
  explicit SampledMagnitudesOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("N", &variables_));
    OP_REQUIRES_OK(context, context->GetAttr("block", &block_));
  }

  void Compute(OpKernelContext* context) override {
    std::vector<int64_t> lengths(variables_);
    for (int v = 0; v < variables_; ++v) lengths[v] = context->input(v).NumElements();
    std::vector<Rows> rows;
    int64_t total = 0;
    OP_REQUIRES_OK(context, SampledRows(context->input(2 * variables_), lengths, block_, &rows,
                                        &total));
    for (int v = 0; v < variables_; ++v) {
      OP_REQUIRES(context, context->input(variables_ + v).NumElements() == lengths[v],
                  InvalidArgumentError(absl::StrCat(
                      "residuals[", v, "] has ", context->input(variables_ + v).NumElements(),
                      " entries, gradients[", v, "] ", lengths[v])));
    }
    Tensor* out_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({total}), &out_tensor));
    float* out = out_tensor->flat<float>().data();
    for (int v = 0; v < variables_; ++v) {  // step 2
      const float* gradient = context->input(v).flat<float>().data();
      const float* residual = context->input(variables_ + v).flat<float>().data();
      for (int64_t row = 0; row < rows[v].count; ++row) {
        const int64_t start = row * rows[v].every;
        for (int64_t i = start; i < start + rows[v].taken; ++i) {
          *out++ = std::fabs(gradient[i] + residual[i]);
        }
      }
    }
  }

 private:
  int variables_;
  int64_t block_;
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdSampledMagnitudes").Device(tensorflow::DEVICE_CPU),
                        SampledMagnitudesOp);

}  // namespace sparse_hvd
