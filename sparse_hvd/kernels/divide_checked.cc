// SparseHvdDivideChecked: the dense allreduce's sums turned into averages, and whether every
// average is finite, in one pass (sparse_hvd/exchanges/dense.py).
//
// Horovod's ``op=Average`` scales its fused buffer in a pass of its own, and the step then
// read every average again for its NaN guard. With ``op=Sum`` and this op, each entry is read
// and written once:
//
//   1. each sum tensor's buffer is reused for its average when nothing else holds it (else a
//      new one is allocated);
//   2. in shards of 64K entries on the CPU worker threads: average = sum / divisor (IEEE
//      division, correctly rounded: the same bits as ``tf.math.divide_no_nan`` for a divisor
//      of 1 or more; a product with the exact reciprocal of a power of two is the same),
//      counting the averages that are NaN or infinite;
//   3. ``finite`` is true iff none was.
//
// Every rank divides the same sums by the same divisor, so every rank holds the same bits
// and takes the same decision from ``finite``.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

REGISTER_OP("SparseHvdDivideChecked")
    .Attr("T: {float, double}")
    .Attr("N: int >= 1")
    .Input("sums: N * T")
    .Input("divisor: T")
    .Output("averages: N * T")
    .Output("finite: bool")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      const int n = c->num_outputs() - 1;
      for (int i = 0; i < n; ++i) c->set_output(i, c->input(i));
      c->set_output(n, c->Scalar());
      return tsl::OkStatus();
    });

constexpr int64_t kShard = 1 << 16;

// out[i] = sum[i] / divisor over [begin, end); returns how many are NaN or infinite. With
// ``reciprocal`` (the divisor a power of two, so 1 / divisor is exact) it multiplies: the
// exact quotient rounded once, the same bits as the division, at a fraction of its cost.
template <typename T>
int64_t DivideAndCount(const T* sum, T* out, int64_t begin, int64_t end, T divisor,
                       bool reciprocal) {
  constexpr T kLargest = std::numeric_limits<T>::max();
  int64_t bad = 0;
  if (reciprocal) {
    const T factor = T(1) / divisor;
    for (int64_t i = begin; i < end; ++i) {
      const T average = sum[i] * factor;
      out[i] = average;
      bad += !(std::abs(average) <= kLargest);  // NaN and infinities
    }
  } else {
    for (int64_t i = begin; i < end; ++i) {
      const T average = sum[i] / divisor;
      out[i] = average;
      bad += !(std::abs(average) <= kLargest);
    }
  }
  return bad;
}

// Whether ``divisor`` is a power of two (1, 2, 4, ...).
template <typename T>
bool IsPowerOfTwo(T divisor) {
  int exponent = 0;
  return std::frexp(divisor, &exponent) == T(0.5);
}

template <typename T>
class DivideCheckedOp : public OpKernel {
 public:
  explicit DivideCheckedOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const int n = context->num_inputs() - 1;
    const Tensor& divisor_tensor = context->input(n);
    OP_REQUIRES(context, divisor_tensor.dims() == 0,
                InvalidArgumentError("divisor must be a scalar"));
    const T divisor = divisor_tensor.scalar<T>()();
    OP_REQUIRES(context, divisor >= T(1),
                InvalidArgumentError(absl::StrCat("divisor must be 1 or more, got ",
                                                  static_cast<double>(divisor))));
    const bool reciprocal = IsPowerOfTwo(divisor);
    auto* pool = context->device()->tensorflow_cpu_worker_threads();
    std::atomic<int64_t> nonfinite{0};
    for (int i = 0; i < n; ++i) {
      const Tensor& sums = context->input(i);
      Tensor* averages = nullptr;
      OP_REQUIRES_OK(context, context->forward_input_or_allocate_output({i}, i, sums.shape(),
                                                                        &averages));
      const int64_t size = sums.NumElements();
      const T* in = sums.flat<T>().data();
      T* out = averages->flat<T>().data();
      const int64_t shards = (size + kShard - 1) / kShard;
      tensorflow::Shard(pool->num_threads, pool->workers, shards, kShard * 2,
                        [&](int64_t first, int64_t last) {
                          int64_t bad = 0;
                          for (int64_t s = first; s < last; ++s) {
                            bad += DivideAndCount(in, out, s * kShard,
                                                  std::min(size, (s + 1) * kShard), divisor,
                                                  reciprocal);
                          }
                          nonfinite += bad;
                        });
    }
    Tensor* finite = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(n, TensorShape({}), &finite));
    finite->scalar<bool>()() = nonfinite.load() == 0;
  }
};

#define REGISTER(T)                                                                         \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name("SparseHvdDivideChecked").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      DivideCheckedOp<T>)
REGISTER(float);
REGISTER(double);
#undef REGISTER

}  // namespace sparse_hvd
