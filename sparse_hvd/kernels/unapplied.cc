// SparseHvdUnapplied: each of ``values`` where its index in ``needles`` is absent from
// ``sorted`` (ascending, distinct), else 0. The sparse allreduce's step 7
// (sparse_hvd/exchanges/sparse_allreduce.py): the entries a rank sent whose sums were not
// applied go back into its residual; an applied one goes back as 0.
//
// TensorFlow's searchsorted, gather and comparison took 4-7 ms a step for the MLP's 43,000
// sent entries at 4 workers on 2 cores; a membership op followed by TensorFlow's select and
// zeros took 7.2 ms a step at 5% density (2.3 of them the membership). Here, in one pass:
//
//   1. ``sorted`` must ascend: checked first (else an error names the place);
//   2. if the needles ascend (a rank's selections are made in index order, variable after
//      variable), one merge walk over both: linear in their lengths;
//   3. otherwise a binary search per needle;
//   4. each output entry is its value or 0, written as the walk passes it.

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

REGISTER_OP("SparseHvdUnapplied")
    .Input("needles: int32")
    .Input("sorted: int32")
    .Input("values: T")
    .Output("owed: T")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      tensorflow::shape_inference::ShapeHandle shape;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(2), &shape));
      c->set_output(0, shape);
      return tsl::OkStatus();
    });

template <typename T>
class UnappliedOp : public OpKernel {
 public:
  explicit UnappliedOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& needles = context->input(0);
    const Tensor& sorted = context->input(1);
    const Tensor& values = context->input(2);
    OP_REQUIRES(context, needles.dims() == 1 && sorted.dims() == 1 && values.dims() == 1,
                InvalidArgumentError("needles, sorted and values must be 1-D"));
    const int64_t count = needles.NumElements();
    OP_REQUIRES(context, values.NumElements() == count,
                InvalidArgumentError(absl::StrCat("values must have one entry per needle: ",
                                                  values.NumElements(), " values, ", count,
                                                  " needles")));
    const int64_t length = sorted.NumElements();
    const int32_t* need = needles.flat<int32_t>().data();
    const int32_t* hay = sorted.flat<int32_t>().data();
    for (int64_t j = 1; j < length; ++j) {
      OP_REQUIRES(context, hay[j - 1] < hay[j],
                  InvalidArgumentError(absl::StrCat("sorted must ascend: sorted[", j - 1,
                                                    "] = ", hay[j - 1], ", sorted[", j,
                                                    "] = ", hay[j])));
    }
    Tensor* owed_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, values.shape(), &owed_tensor));
    const T* given = values.flat<T>().data();
    T* owed = owed_tensor->flat<T>().data();
    const T zero = T(0);
    if (std::is_sorted(need, need + count)) {
      int64_t j = 0;
      for (int64_t i = 0; i < count; ++i) {
        while (j < length && hay[j] < need[i]) ++j;
        owed[i] = (j < length && hay[j] == need[i]) ? zero : given[i];
      }
    } else {
      for (int64_t i = 0; i < count; ++i) {
        owed[i] = std::binary_search(hay, hay + length, need[i]) ? zero : given[i];
      }
    }
  }
};

#define REGISTER(T)                                                                     \
  REGISTER_KERNEL_BUILDER(                                                              \
      Name("SparseHvdUnapplied").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      UnappliedOp<T>)
REGISTER(Eigen::half);
REGISTER(tensorflow::bfloat16);
REGISTER(float);
REGISTER(double);
#undef REGISTER

}  // namespace sparse_hvd
