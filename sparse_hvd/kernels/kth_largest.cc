// SparseHvdKthLargest: the k-th largest value of each segment of a flat tensor. The sparse
// allreduce's step 6 (sparse_hvd/exchanges/sparse_allreduce.py): per variable, the k-th
// largest of the kept sums' magnitudes, which is the cut of the exact global top-k.
//
// Done per variable with TensorFlow ops (a slice, a top_k and a minimum each, plus the
// threshold rule's twenty small ops) it cost a few hundred ops a step for the MLP and a few
// thousand for ResNet-50, each traced in Python and run by the executor. Here, one op:
//
//   1. segment v is values[cuts[v], cuts[v + 1]); ``cuts`` must not decrease and must lie
//      within the values (else an error names the place);
//   2. if 1 <= k[v] <= its length, its k[v]-th largest by selection (std::nth_element on a
//      copy of the segment: linear on average), else 0; where k is a small share of a long
//      segment, the selection runs on the few entries not below a bound found on every
//      kStride-th entry (kth_select.h's SampleSelect), which is the same value: the
//      model-wide cut's 2,050th largest of 205,000 sampled magnitudes took 2.2-2.7 ms of the
//      4.35M MLP's step at 2 ranks as tf.math.top_k with one thread (std::nth_element alone:
//      2.7 ms), 0.4-0.5 ms this way;
//   3. NaN orders above every number, so a non-finite step (whose results are discarded)
//      still gets a well-defined order.

#include <cstdint>
#include <vector>

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

REGISTER_OP("SparseHvdKthLargest")
    .Attr("T: {float, double}")
    .Input("values: T")
    .Input("cuts: int32")
    .Input("k: int32")
    .Output("kth: T")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(2));
      return tsl::OkStatus();
    });

template <typename T>
class KthLargestOp : public OpKernel {
 public:
  explicit KthLargestOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& values_tensor = context->input(0);
    const Tensor& cuts_tensor = context->input(1);
    const Tensor& k_tensor = context->input(2);
    OP_REQUIRES(context, values_tensor.dims() == 1 && cuts_tensor.dims() == 1 &&
                             k_tensor.dims() == 1,
                InvalidArgumentError("values, cuts and k must be 1-D"));
    const int64_t segments = k_tensor.NumElements();
    const int64_t length = values_tensor.NumElements();
    const T* values = values_tensor.flat<T>().data();
    const int32_t* cuts = cuts_tensor.flat<int32_t>().data();
    const int32_t* k = k_tensor.flat<int32_t>().data();
    OP_REQUIRES_OK(context,
                   CheckCuts(cuts, cuts_tensor.NumElements(), segments, length, "k"));
    Tensor* kth_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, k_tensor.shape(), &kth_tensor));
    T* kth = kth_tensor->flat<T>().data();
    std::vector<T> segment;
    for (int64_t v = 0; v < segments; ++v) {
      const int64_t size = cuts[v + 1] - cuts[v];
      if (k[v] < 1 || k[v] > size) {
        kth[v] = T(0);
        continue;
      }
      kth[v] = KthLargestOf(values + cuts[v], size, k[v], &segment);
    }
  }
};

#define REGISTER(T)                                                                      \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("SparseHvdKthLargest").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      KthLargestOp<T>)
REGISTER(float);
REGISTER(double);
#undef REGISTER

}  // namespace sparse_hvd
