// SparseHvdApplyAdam: Keras' Adam step of one variable from its averaged gradient, written
// into the weights and the moments in place (sparse_hvd/feedback/fused_apply.py: every dense
// step of ``exchange="dense"``, or of an ``"auto"`` that chose dense, under a plain Adam or
// AdamW).
//
// Keras' own step is about a dozen TensorFlow operations, each a pass over the variable. Its
// first replacement here, ``SparseHvdLocalAdam`` asked for the new weights, made it one pass
// but wrote three new tensors a step (m, v and the weights, then assigned): measured with
// scripts/benchmarks/probe_first_steps.py (4 ranks, the wide CNN under Adam), a job's first
// ~8 dense steps then page-faulted 3,000-14,000 times a step while the allocator's pool grew,
// and took 0.3-1.5 s against 0.1 s. TensorFlow's own ResourceApplyAdam works in place but
// computes 1 - beta_1 in float32 from beta_1, where Keras rounds the double 1 - beta_1 to
// float32 (0.100000001 against 0.100000024 for 0.9): not Keras' bits. This op:
//
//   1. takes the three variables' locks, exclusive, in TensorFlow's order (as its dense
//      training ops do, so it cannot deadlock against them);
//   2. makes each buffer its own (copied once only if a read still holds it);
//   3. per entry, m, v and w from one read each, written back where they were (adam_entry.h:
//      Keras' float32 operations in Keras' order; no decay, which the caller runs as Keras'
//      own ops: fused_apply.py).
//
// The gradient's finiteness is not checked here: the caller's averages were checked before.

#define EIGEN_USE_THREADS  // the helpers' copy of a shared buffer runs on the CPU device

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tensorflow/core/util/work_sharder.h"
#include "adam_entry.h"
#include "vectorised.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using CPUDevice = Eigen::ThreadPoolDevice;

REGISTER_OP("SparseHvdApplyAdam")
    .Input("variable: resource")  // the weights, float32
    .Input("m: resource")         // Adam's first moment
    .Input("v: resource")         // Adam's second moment
    .Input("gradient: float")     // the averaged gradient, as many entries (any shape)
    .Input("coefficients: float")  // [1 - beta_1, 1 - beta_2, alpha, epsilon]
    .SetShapeFn(tensorflow::shape_inference::NoOutputs);

namespace {

constexpr int64_t kShard = 1 << 15;

// Step 3 for entries [begin, end). Each entry is read before it is written, one at a time, so
// the in-place loop vectorises lane by lane like the out-of-place one.
SPARSE_HVD_VECTORISED
void AdamInPlace(const float* __restrict g, float* __restrict m, float* __restrict v,
                 float* __restrict w, int64_t begin, int64_t end, const float* k) {
  const float one_minus_beta_1 = k[0], one_minus_beta_2 = k[1], alpha = k[2], epsilon = k[3];
  for (int64_t i = begin; i < end; ++i) {
    float first, second;
    AdamMoments(g[i], m[i], v[i], one_minus_beta_1, one_minus_beta_2, &first, &second);
    w[i] = AdamWeights(w[i], first, second, alpha, epsilon);
    m[i] = first;
    v[i] = second;
  }
}

}  // namespace

class ApplyAdamOp : public OpKernel {
 public:
  explicit ApplyAdamOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& gradient = context->input(3);
    const Tensor& coefficients = context->input(4);
    OP_REQUIRES(context, coefficients.NumElements() == 4,
                InvalidArgumentError("coefficients must hold 4 values"));
    Tensor state[3];  // the weights, m, v
    static const char* const kNames[3] = {"variable", "m", "v"};
    const int64_t n = gradient.NumElements();
    for (int i = 0; i < 3; ++i) {  // before the helpers, which copy a shared buffer as float32
      tensorflow::core::RefCountPtr<tensorflow::Var> variable;
      OP_REQUIRES_OK(context, tensorflow::LookupResource(
                                  context, tensorflow::HandleFromInput(context, i), &variable));
      OP_REQUIRES(context, variable->tensor()->dtype() == tensorflow::DT_FLOAT,
                  InvalidArgumentError(absl::StrCat(kNames[i], " must be float32")));
    }
    auto lock = tensorflow::MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(  // Step 1
        context, /*do_lock=*/true, /*sparse=*/false, {0, 1, 2});
    for (int i = 0; i < 3; ++i) {  // Step 2
      OP_REQUIRES_OK(context, tensorflow::GetInputTensorFromVariable<CPUDevice, float>(
                                  context, i, /*lock_held=*/true, /*sparse=*/false, &state[i]));
      OP_REQUIRES(context, state[i].NumElements() == n,
                  InvalidArgumentError(absl::StrCat(kNames[i], " has ", state[i].NumElements(),
                                                    " entries, the gradient ", n)));
    }
    const float* g = gradient.flat<float>().data();
    float* w = state[0].flat<float>().data();
    float* m = state[1].flat<float>().data();
    float* v = state[2].flat<float>().data();
    const float* k = coefficients.flat<float>().data();
    auto* pool = context->device()->tensorflow_cpu_worker_threads();
    const int64_t shards = (n + kShard - 1) / kShard;
    tensorflow::Shard(pool->num_threads, pool->workers, shards, kShard * 30,  // Step 3
                      [&](int64_t begin, int64_t end) {
                        AdamInPlace(g, m, v, w, begin * kShard, std::min(n, end * kShard), k);
                      });
  }
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdApplyAdam").Device(tensorflow::DEVICE_CPU),
                        ApplyAdamOp);

}  // namespace sparse_hvd
