// The scalar ``finite`` output of the ops that say whether what they computed is finite
// (compensate_cut.cc, local_step.cc).

#ifndef SPARSE_HVD_KERNELS_FINITE_OUTPUT_H_
#define SPARSE_HVD_KERNELS_FINITE_OUTPUT_H_

#include "tensorflow/core/framework/op_kernel.h"

namespace sparse_hvd {

// ``finite`` into output ``index``, a scalar bool.
inline tsl::Status WriteFinite(tensorflow::OpKernelContext* context, int index, bool finite) {
  tensorflow::Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(context->allocate_output(index, tensorflow::TensorShape({}), &out));
  out->scalar<bool>()() = finite;
  return tsl::OkStatus();
}

}  // namespace sparse_hvd

#endif  // SPARSE_HVD_KERNELS_FINITE_OUTPUT_H_
