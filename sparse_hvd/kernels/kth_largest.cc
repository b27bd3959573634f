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
//      kStride-th entry (SampleSelect), which is the same value: the model-wide cut's 2,050th
//      largest of 205,000 sampled magnitudes took 2.2-2.7 ms of the 4.35M MLP's step at 2
//      ranks as tf.math.top_k with one thread (std::nth_element alone: 2.7 ms), 0.4-0.5 ms
//      this way;
//   3. NaN orders above every number, so a non-finite step (whose results are discarded)
//      still gets a well-defined order.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

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

// a > b in an order where NaN is above every number (a strict weak order, as
// std::nth_element needs)
template <typename T>
bool Above(T a, T b) {
  if (std::isnan(b)) return false;
  if (std::isnan(a)) return true;
  return a > b;
}

constexpr int64_t kStride = 16;             // SampleSelect reads every 16th entry for the bound
constexpr int64_t kSmallestSampled = 16384;  // shorter segments: nth_element on all of them

// The k-th largest of values[0, size) (1 <= k <= size) in the order of Above, or false when
// the sample's bound kept fewer than k entries (the caller then selects among all):
//   1. the bound b: the j-th largest of every kStride-th entry, j the number of those expected
//      at or above the k-th largest (k / kStride) plus three standard deviations and 8, so b
//      lies below the k-th largest all but rarely;
//   2. ``kept``: the entries not below b (NaN is never below), in one pass;
//   3. with at least k kept, the k-th largest of all is among them (every entry left out is
//      below b, so below k kept ones): their k-th largest.
template <typename T>
bool SampleSelect(const T* values, int64_t size, int64_t k, std::vector<T>* kept, T* kth) {
  std::vector<T> sample;
  sample.reserve(size / kStride + 1);
  for (int64_t i = 0; i < size; i += kStride) sample.push_back(values[i]);
  const double expected = static_cast<double>(k) / kStride;
  const int64_t j = std::min<int64_t>(
      static_cast<int64_t>(sample.size()),
      static_cast<int64_t>(expected + 3.0 * std::sqrt(expected)) + 8);
  std::nth_element(sample.begin(), sample.begin() + (j - 1), sample.end(), Above<T>);
  const T bound = sample[j - 1];
  kept->clear();
  for (int64_t i = 0; i < size; ++i) {
    if (!(values[i] < bound)) kept->push_back(values[i]);
  }
  if (static_cast<int64_t>(kept->size()) < k) return false;
  std::nth_element(kept->begin(), kept->begin() + (k - 1), kept->end(), Above<T>);
  *kth = (*kept)[k - 1];
  return true;
}

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
    OP_REQUIRES(context, cuts_tensor.NumElements() == segments + 1,
                InvalidArgumentError(absl::StrCat("cuts must have one more entry than k (",
                                                  segments + 1, "), got ",
                                                  cuts_tensor.NumElements())));
    const int64_t length = values_tensor.NumElements();
    const T* values = values_tensor.flat<T>().data();
    const int32_t* cuts = cuts_tensor.flat<int32_t>().data();
    const int32_t* k = k_tensor.flat<int32_t>().data();
    for (int64_t v = 0; v <= segments; ++v) {
      OP_REQUIRES(context, cuts[v] >= 0 && cuts[v] <= length,
                  InvalidArgumentError(absl::StrCat("cuts[", v, "] = ", cuts[v],
                                                    " is not in [0, ", length, "]")));
      OP_REQUIRES(context, v == 0 || cuts[v - 1] <= cuts[v],
                  InvalidArgumentError(absl::StrCat("cuts must not decrease: cuts[", v - 1,
                                                    "] = ", cuts[v - 1], ", cuts[", v,
                                                    "] = ", cuts[v])));
    }
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
      if (size >= kSmallestSampled && k[v] <= size / kStride &&
          SampleSelect(values + cuts[v], size, k[v], &segment, &kth[v])) {
        continue;
      }
      segment.assign(values + cuts[v], values + cuts[v + 1]);
      auto at = segment.begin() + (k[v] - 1);
      std::nth_element(segment.begin(), at, segment.end(), Above<T>);
      kth[v] = *at;
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
