// SparseHvdWatchEnter and SparseHvdWatchLeave: the stall watchdog's brackets around a traced
// step's collectives (sparse_hvd/runtime/watchdog.py), as native ops.
//
// As ``tf.numpy_function`` ops each bracket took the GIL and a call into Python: about 0.25 ms
// each, twice a step on the step's critical path (TensorFlow's profiler, the 4.35M MLP at 2
// workers). Here:
//
//   1. Enter records (steady-clock time, the collective's name id, the training step) under a
//      new token in a table of this process and returns the token. A wait of the same name
//      still in the table is dropped first: it belongs to an earlier run of the same traced
//      step that ended with an error before its Leave ran (a failed collective, the step
//      check's mismatch; a rank never waits twice at once for one collective name), and kept
//      it would end a job that caught the error and went on;
//   2. Leave removes the token's entry;
//   3. the watchdog's Python thread asks ``sparse_hvd_oldest_wait`` (a C function, read through
//      ctypes) for the oldest entry's age, name id and step; the ids index the names the
//      Python side registered when it traced the brackets.
//
// The ops are stateful, so TensorFlow neither folds nor prunes nor reorders them past their
// control edges.

#include <chrono>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace sparse_hvd {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

namespace {

struct Wait {
  int64_t start_ns;
  int64_t name_id;
  int64_t step;
};

std::mutex table_mutex;
std::map<int64_t, Wait> table;  // token -> wait; tokens ascend, so begin() is the oldest
int64_t next_token = 1;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

tsl::Status ScalarOutput(tensorflow::shape_inference::InferenceContext* c) {
  c->set_output(0, c->Scalar());
  return tsl::OkStatus();
}

}  // namespace

REGISTER_OP("SparseHvdWatchEnter")
    .Attr("name_id: int")
    .Input("step: int64")
    .Output("token: int64")
    .SetIsStateful()
    .SetShapeFn(ScalarOutput);

REGISTER_OP("SparseHvdWatchLeave")
    .Input("token: int64")
    .Output("left: int64")
    .SetIsStateful()
    .SetShapeFn(ScalarOutput);

class WatchEnterOp : public OpKernel {
 public:
  explicit WatchEnterOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("name_id", &name_id_));
  }

  void Compute(OpKernelContext* context) override {
    const int64_t step = context->input(0).scalar<int64_t>()();
    int64_t token;
    {
      std::lock_guard<std::mutex> lock(table_mutex);
      for (auto it = table.begin(); it != table.end();) {
        it = it->second.name_id == name_id_ ? table.erase(it) : std::next(it);
      }
      token = next_token++;
      table[token] = Wait{NowNs(), name_id_, step};
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = token;
  }

 private:
  int64_t name_id_;
};

class WatchLeaveOp : public OpKernel {
 public:
  explicit WatchLeaveOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const int64_t token = context->input(0).scalar<int64_t>()();
    {
      std::lock_guard<std::mutex> lock(table_mutex);
      table.erase(token);
    }
    context->set_output(0, context->input(0));
  }
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdWatchEnter").Device(tensorflow::DEVICE_CPU), WatchEnterOp);
REGISTER_KERNEL_BUILDER(Name("SparseHvdWatchLeave").Device(tensorflow::DEVICE_CPU), WatchLeaveOp);

}  // namespace sparse_hvd

// The oldest wait: 1 and its age (ns), name id and step; 0 when nothing is waited for.
extern "C" int sparse_hvd_oldest_wait(int64_t* age_ns, int64_t* name_id, int64_t* step) {
  std::lock_guard<std::mutex> lock(sparse_hvd::table_mutex);
  if (sparse_hvd::table.empty()) return 0;
  const sparse_hvd::Wait& oldest = sparse_hvd::table.begin()->second;
  *age_ns = sparse_hvd::NowNs() - oldest.start_ns;
  *name_id = oldest.name_id;
  *step = oldest.step;
  return 1;
}

// How many waits are open (tests: every bracket left).
extern "C" int64_t sparse_hvd_open_waits() {
  std::lock_guard<std::mutex> lock(sparse_hvd::table_mutex);
  return static_cast<int64_t>(sparse_hvd::table.size());
}
