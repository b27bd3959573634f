// SparseHvdSubtractAt: a resource variable less ``values`` at flat ``positions``, in place
// (sparse_hvd/feedback/local_update.py: the update cut's averages, which arrive only where some
// rank sent an entry, SparseHvdMeanAtPositions in scatter_mean.cc).
//
// TensorFlow's own scatter ops on a resource variable (ResourceScatterSub, ...NdSub) switch
// it to copy-on-read mode for good, after which every read of the weights copies them: on the
// 4.35M-entry MLP that cost more than the dense subtraction it replaced (measured: the top-k
// step at 152 ms against 123 ms). This op takes the variable the way TensorFlow's dense
// training ops do (ResourceApplyGradientDescent):
//
//   1. the variable's lock, exclusive;
//   2. its buffer made its own (copied once only if a read still holds it, as for any dense
//      update; never switched to copy-on-read);
//   3. w[positions[i]] -= values[i], i = 0, 1, ... (one IEEE subtraction each: the bits of
//      subtracting the dense average, which is 0 elsewhere, for distinct positions);
//   4. a position outside the variable is refused, naming it, before anything is written.

#define EIGEN_USE_THREADS  // the helpers' copy of a shared buffer runs on the CPU device

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using CPUDevice = Eigen::ThreadPoolDevice;

REGISTER_OP("SparseHvdSubtractAt")
    .Attr("T: {float, double}")
    .Input("variable: resource")
    .Input("positions: int32")
    .Input("values: T")
    .SetShapeFn(tensorflow::shape_inference::NoOutputs);

template <typename T>
class SubtractAtOp : public OpKernel {
 public:
  explicit SubtractAtOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& positions = context->input(1);
    const Tensor& values = context->input(2);
    OP_REQUIRES(context, positions.dims() == 1 && values.dims() == 1,
                InvalidArgumentError("positions and values must be 1-D"));
    const int64_t count = positions.NumElements();
    OP_REQUIRES(context, values.NumElements() == count,
                InvalidArgumentError(absl::StrCat("got ", count, " positions and ",
                                                  values.NumElements(), " values")));
    // Steps 1-2
    auto lock = tensorflow::MaybeLockVariableInputMutexesInOrder<CPUDevice, T>(
        context, /*do_lock=*/true, /*sparse=*/false, {0});
    Tensor weights;
    OP_REQUIRES_OK(context, tensorflow::GetInputTensorFromVariable<CPUDevice, T>(
                                context, 0, /*lock_held=*/true, /*sparse=*/false, &weights));
    OP_REQUIRES(context, weights.dtype() == tensorflow::DataTypeToEnum<T>::value,
                InvalidArgumentError("the variable's dtype is not the values'"));
    const int64_t size = weights.NumElements();
    const int32_t* at = positions.flat<int32_t>().data();
    for (int64_t i = 0; i < count; ++i) {  // Step 4
      OP_REQUIRES(context, at[i] >= 0 && at[i] < size,
                  InvalidArgumentError(absl::StrCat("positions[", i, "] = ", at[i],
                                                    " is not in [0, ", size, ")")));
    }
    T* w = weights.flat<T>().data();
    const T* subtract = values.flat<T>().data();
    for (int64_t i = 0; i < count; ++i) w[at[i]] -= subtract[i];  // Step 3
  }
};

REGISTER_KERNEL_BUILDER(
    Name("SparseHvdSubtractAt").Device(tensorflow::DEVICE_CPU).TypeConstraint<float>("T"),
    SubtractAtOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("SparseHvdSubtractAt").Device(tensorflow::DEVICE_CPU).TypeConstraint<double>("T"),
    SubtractAtOp<double>);

}  // namespace sparse_hvd
