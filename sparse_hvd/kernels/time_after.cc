// SparseHvdTimeAfter: the time (seconds since the epoch, TensorFlow's ``tf.timestamp`` clock)
// once its input exists, as an op TensorFlow does not count as stateful.
//
// Inside a ``tf.function`` automatic control dependencies run every stateful op that takes no
// resource in the order the trace made it. ``tf.timestamp`` is one, so each gradient's
// timestamp waited for the one made before it (in the variables' order, for the first
// variable's gradient, backprop's last: ``AdaptiveDensity``'s backward windows read about
// zero), and the layer-wise exchange's collectives, behind the stall watchdog's bracket made
// after the stamps, waited for the whole backward pass (runtime/stamps.py). This op is ordered
// by its input alone:
//
//   1. it takes the tensor to stamp (a CPU kernel: the library uses its native kernels only
//      where no GPU is visible), so it runs once that tensor exists;
//   2. it writes the clock, reading none of its input.
//
// Not stateful, so TensorFlow may merge two of them on the same tensor (the same time) and
// would fold one whose input is a constant while it optimizes the graph (a stamp of nothing
// that is computed in the step).

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tsl/platform/env_time.h"

namespace sparse_hvd {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

REGISTER_OP("SparseHvdTimeAfter")
    .Attr("T: type")
    .Input("after: T")
    .Output("seconds: double")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return tsl::OkStatus();
    });

class TimeAfterOp : public OpKernel {
 public:
  explicit TimeAfterOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({}), &out));
    out->scalar<double>()() = static_cast<double>(tsl::EnvTime::NowMicros()) / 1.0e6;
  }
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdTimeAfter").Device(tensorflow::DEVICE_CPU), TimeAfterOp);

}  // namespace sparse_hvd
