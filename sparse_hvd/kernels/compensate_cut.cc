// SparseHvdCompensateCut: error feedback's compensate/select/remember for a magnitude cut, in
// one pass over the data.
//
// For flat grad g, flat residual r, cut lambda and a cap:
//   c = g + r; selected = {i : |c_i| >= lambda};
//   remainder = c with the selected entries set to zero;
//   indices, values = the selected positions (ascending) and c at them.
// If more than `cap` entries pass, `rejected` is true and indices/values are empty (the caller
// then takes its exact top-k path, and the remainder output must not be used): the cap bounds
// the memory a too-small lambda could claim.
//
// Work is split into contiguous shards run on TensorFlow's intra-op thread pool; each shard
// keeps its own (index, value) list, concatenated in shard order, so the output is ascending
// and identical for any number of threads. The arithmetic is the same single float addition
// per entry as the TensorFlow ops it replaces, so the results are the same bits.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace sparse_hvd {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using absl::InvalidArgumentError;

// Both ops: (remainder shaped like grad, indices, values, a flag).
tsl::Status SelectionShapes(tensorflow::shape_inference::InferenceContext* c) {
  c->set_output(0, c->input(0));
  c->set_output(1, c->Vector(c->UnknownDim()));
  c->set_output(2, c->Vector(c->UnknownDim()));
  c->set_output(3, c->Scalar());
  return tsl::OkStatus();
}

// Both ops: check grad (input 0) and residual (input 1), and give output 0, the remainder
// (the residual's buffer when it can be reused).
tsl::Status CheckedRemainder(OpKernelContext* context, Tensor** remainder) {
  const Tensor& grad = context->input(0);
  const Tensor& residual = context->input(1);
  if (grad.dims() != 1 || residual.shape() != grad.shape()) {
    return InvalidArgumentError(absl::StrCat("grad and residual must be 1-D of the same length, got ",
                                             grad.shape().DebugString(), " and ",
                                             residual.shape().DebugString()));
  }
  if (grad.NumElements() >= (int64_t{1} << 31)) {
    return InvalidArgumentError("more than 2^31 - 1 entries cannot be indexed with int32");
  }
  return context->forward_input_or_allocate_output({1}, 0, grad.shape(), remainder);
}

constexpr int64_t kShardSize = 1 << 16;

// Both ops: ``body(shard, begin, end)`` for every shard of kShardSize entries of [0, n), the
// shards spread over the CPU thread pool.
template <typename Body>
void ForEachShard(OpKernelContext* context, int64_t n, Body body) {
  const int64_t shards = (n + kShardSize - 1) / kShardSize;
  auto* pool = context->device()->tensorflow_cpu_worker_threads();
  tensorflow::Shard(pool->num_threads, pool->workers, shards, kShardSize * 4,
                    [&](int64_t first, int64_t last) {
                      for (int64_t s = first; s < last; ++s) {
                        body(s, s * kShardSize, std::min(n, (s + 1) * kShardSize));
                      }
                    });
}

REGISTER_OP("SparseHvdCompensateCut")
    .Attr("T: {float, double}")
    .Input("grad: T")
    .Input("residual: T")
    .Input("cut: T")
    .Input("cap: int64")
    .Output("remainder: T")
    .Output("indices: int32")
    .Output("values: T")
    .Output("rejected: bool")
    .SetShapeFn(SelectionShapes);

template <typename T>
class CompensateCutOp : public OpKernel {
 public:
  explicit CompensateCutOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    Tensor* remainder = nullptr;
    OP_REQUIRES_OK(context, CheckedRemainder(context, &remainder));
    const Tensor& grad = context->input(0);
    const Tensor& residual = context->input(1);
    const T cut = context->input(2).scalar<T>()();
    const int64_t cap = context->input(3).scalar<int64_t>()();
    const int64_t n = grad.NumElements();
    const T* g = grad.flat<T>().data();
    const T* r = residual.flat<T>().data();
    T* out = remainder->flat<T>().data();

    // Shards of at least 64 Ki entries; each collects its selected entries.
    const int64_t shards = (n + kShardSize - 1) / kShardSize;
    std::vector<std::vector<int32_t>> shard_indices(shards);
    std::vector<std::vector<T>> shard_values(shards);
    std::atomic<int64_t> total{0};
    ForEachShard(context, n, [&](int64_t s, int64_t begin, int64_t end) {
      auto& idx = shard_indices[s];
      auto& val = shard_values[s];
      // Two loops over the shard: the first vectorises, the second reads it back from cache.
      for (int64_t i = begin; i < end; ++i) out[i] = g[i] + r[i];
      for (int64_t i = begin; i < end; ++i) {
        const T c = out[i];
        if (c >= cut || c <= -cut) {  // never true for NaN
          out[i] = T(0);
          if (static_cast<int64_t>(idx.size()) <= cap) {
            idx.push_back(static_cast<int32_t>(i));
            val.push_back(c);
          }
        }
      }
      total += static_cast<int64_t>(idx.size());
    });

    const bool rejected = total.load() > cap;
    const int64_t count = rejected ? 0 : total.load();
    Tensor* indices = nullptr;
    Tensor* values = nullptr;
    Tensor* rejected_out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({count}), &indices));
    OP_REQUIRES_OK(context, context->allocate_output(2, TensorShape({count}), &values));
    OP_REQUIRES_OK(context, context->allocate_output(3, TensorShape({}), &rejected_out));
    rejected_out->scalar<bool>()() = rejected;
    if (rejected) return;
    int32_t* idx_out = indices->flat<int32_t>().data();
    T* val_out = values->flat<T>().data();
    for (int64_t s = 0; s < shards; ++s) {
      std::copy(shard_indices[s].begin(), shard_indices[s].end(), idx_out);
      std::copy(shard_values[s].begin(), shard_values[s].end(), val_out);
      idx_out += shard_indices[s].size();
      val_out += shard_values[s].size();
    }
  }
};

REGISTER_KERNEL_BUILDER(
    Name("SparseHvdCompensateCut").Device(DEVICE_CPU).TypeConstraint<float>("T"),
    CompensateCutOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("SparseHvdCompensateCut").Device(DEVICE_CPU).TypeConstraint<double>("T"),
    CompensateCutOp<double>);


// SparseHvdCompensateTopK: error feedback's compensate/select/remember for the exact top-k, in
// one pass over the data plus work on the candidates only (sparse_hvd.sparsifiers.TopK):
//
//   1. one pass (sharded): c = grad + residual is written to ``remainder``, and the positions
//      with |c| >= cut (the candidates, in index order) are collected, at most ``cap`` of them;
//   2. if there are fewer than k or more than ``cap`` candidates, ``missed`` is set and the
//      caller sorts the whole of c instead (the sampled cut missed: rare);
//   3. else the k largest candidates by |c| are found with nth_element (ties: the lower index
//      first, as the partial sort's rule), emitted in index order with their values, and their
//      positions in ``remainder`` set to zero. The selection and the remainder are exactly those
//      of a partial sort of the whole of c: every entry of the top k is at or above the k-th
//      largest, which is at or above the cut. NaN never passes the cut, so it never enters the
//      comparisons (a NaN gradient's step is skipped by the optimizer anyway).
REGISTER_OP("SparseHvdCompensateTopK")
    .Attr("T: {float, double}")
    .Input("grad: T")
    .Input("residual: T")
    .Input("cut: T")
    .Input("k: int64")
    .Input("cap: int64")
    .Output("remainder: T")
    .Output("indices: int32")
    .Output("values: T")
    .Output("missed: bool")
    .SetShapeFn(SelectionShapes);

template <typename T>
class CompensateTopKOp : public OpKernel {
 public:
  explicit CompensateTopKOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    Tensor* remainder = nullptr;
    OP_REQUIRES_OK(context, CheckedRemainder(context, &remainder));
    const Tensor& grad = context->input(0);
    const Tensor& residual = context->input(1);
    const T cut = context->input(2).scalar<T>()();
    const int64_t k = context->input(3).scalar<int64_t>()();
    const int64_t cap = context->input(4).scalar<int64_t>()();
    const int64_t n = grad.NumElements();
    const T* g = grad.flat<T>().data();
    const T* r = residual.flat<T>().data();
    T* out = remainder->flat<T>().data();

    // Step 1
    const int64_t shards = (n + kShardSize - 1) / kShardSize;
    std::vector<std::vector<int32_t>> shard_indices(shards);
    std::atomic<int64_t> total{0};
    ForEachShard(context, n, [&](int64_t s, int64_t begin, int64_t end) {
      auto& idx = shard_indices[s];
      for (int64_t i = begin; i < end; ++i) out[i] = g[i] + r[i];  // vectorises
      for (int64_t i = begin; i < end; ++i) {
        const T c = out[i];
        if ((c >= cut || c <= -cut) && static_cast<int64_t>(idx.size()) <= cap) {
          idx.push_back(static_cast<int32_t>(i));
        }
      }
      total += static_cast<int64_t>(idx.size());
    });

    // Step 2
    const int64_t m = total.load();
    const bool missed = m < k || m > cap || k <= 0;
    const int64_t count = missed ? 0 : k;
    Tensor* indices = nullptr;
    Tensor* values = nullptr;
    Tensor* missed_out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({count}), &indices));
    OP_REQUIRES_OK(context, context->allocate_output(2, TensorShape({count}), &values));
    OP_REQUIRES_OK(context, context->allocate_output(3, TensorShape({}), &missed_out));
    missed_out->scalar<bool>()() = missed;
    if (missed) return;

    // Step 3
    std::vector<int32_t> candidates;
    candidates.reserve(m);
    for (const auto& idx : shard_indices) candidates.insert(candidates.end(), idx.begin(), idx.end());
    auto larger = [out](int32_t a, int32_t b) {  // by |c| descending, then index ascending
      const T x = std::abs(out[a]), y = std::abs(out[b]);
      return x > y || (x == y && a < b);
    };
    std::vector<int32_t> order(candidates);
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), larger);
    const int32_t kth = order[k - 1];
    int32_t* idx_out = indices->flat<int32_t>().data();
    T* val_out = values->flat<T>().data();
    int64_t written = 0;
    for (const int32_t i : candidates) {  // index order; the k not after the k-th
      if (i == kth || larger(i, kth)) {
        idx_out[written] = i;
        val_out[written] = out[i];
        ++written;
      }
    }
    for (int64_t e = 0; e < written; ++e) out[idx_out[e]] = T(0);
  }
};

REGISTER_KERNEL_BUILDER(
    Name("SparseHvdCompensateTopK").Device(DEVICE_CPU).TypeConstraint<float>("T"),
    CompensateTopKOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("SparseHvdCompensateTopK").Device(DEVICE_CPU).TypeConstraint<double>("T"),
    CompensateTopKOp<double>);

}  // namespace sparse_hvd
