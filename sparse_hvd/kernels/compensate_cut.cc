// SparseHvdCompensateCut: error feedback's compensate/select/remember for a magnitude cut, in
// one pass over the data.
//
// For flat grad g, flat residual r, cut lambda and a cap:
//   c = g + r; selected = {i : |c_i| >= lambda};
//   remainder = c with the selected entries set to zero;
//   indices, values = the selected positions (ascending) and c at them.
// If more than `cap` entries pass, `rejected` is true and indices/values are empty (the caller
// then takes its exact top-k path, and the remainder output must not be used): the cap bounds
// the memory a too-small lambda could claim. `finite` says whether every c_i is finite (both
// ops): the rank's "all finite" check of its gradient, in the same pass (a NaN or an infinity
// in g makes c non-finite), instead of a pass of its own.
//
// Work is split into contiguous shards run on TensorFlow's intra-op thread pool; each shard
// keeps its own (index, value) list, concatenated in shard order, so the output is ascending
// and identical for any number of threads. The arithmetic is the same single float addition
// per entry as the TensorFlow ops it replaces, so the results are the same bits.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "finite_output.h"
#include "passed_mask.h"

namespace sparse_hvd {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using absl::InvalidArgumentError;

// Both ops: (remainder shaped like grad, indices, values, then scalars).
tsl::Status SelectionShapes(tensorflow::shape_inference::InferenceContext* c) {
  c->set_output(0, c->input(0));
  c->set_output(1, c->Vector(c->UnknownDim()));
  c->set_output(2, c->Vector(c->UnknownDim()));
  for (int i = 3; i < c->num_outputs(); ++i) c->set_output(i, c->Scalar());
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

// Both ops: out[i] = g[i] + r[i] for i in [begin, end), and hit(i, c) for each i with
// |c| >= cut, in index order. Per block of kBlock entries, a first loop adds, counts the hits
// and the non-finite entries (it vectorises); only blocks with a hit are looked at again, for
// their passing entries (passed_mask.h): at a density of 1% most blocks have none, so most of
// the data is touched by vector instructions only. Returns the number of non-finite c.
constexpr int64_t kBlock = 16;
static_assert(kBlock <= kPassedMaskBits, "a block's passing entries fit one mask");

template <typename T, typename Hit>
int64_t CompensateAndScan(const T* g, const T* r, T* out, int64_t begin, int64_t end, T cut,
                          Hit hit) {
  constexpr T kLargest = std::numeric_limits<T>::max();
  int64_t nonfinite = 0;
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t stop = std::min(end, b + kBlock);
    int hits = 0, bad = 0;
    for (int64_t i = b; i < stop; ++i) {
      const T c = g[i] + r[i];
      out[i] = c;
      hits += std::abs(c) >= cut;  // never true for NaN
      bad += !(std::abs(c) <= kLargest);  // NaN and infinities
    }
    nonfinite += bad;
    if (hits == 0) continue;
    ForEachPassed(PassedMask(out + b, stop - b, cut), [&](int j) { hit(b + j, out[b + j]); });
  }
  return nonfinite;
}

// An entry of c that passed the cut, with its position.
template <typename T>
struct Candidate {
  T c;
  int32_t i;
};

// Both ops, the pass over the data: c = g + r into ``out``, and per shard, in index order, the
// entries with |c| >= cut, at most cap + 1 of them (enough to tell "more than cap"), with their
// values so later work reads contiguous memory. ``zero_passed``: also zero every passing entry
// in ``out``. Returns the shards' lists (their concatenation is ascending), their total and
// whether every c was finite.
template <typename T>
std::vector<std::vector<Candidate<T>>> CollectCandidates(OpKernelContext* context, const T* g,
                                                         const T* r, T* out, int64_t n, T cut,
                                                         int64_t cap, bool zero_passed,
                                                         int64_t* total, bool* finite) {
  std::vector<std::vector<Candidate<T>>> shard_candidates((n + kShardSize - 1) / kShardSize);
  std::atomic<int64_t> count{0}, nonfinite{0};
  ForEachShard(context, n, [&](int64_t s, int64_t begin, int64_t end) {
    auto& found = shard_candidates[s];
    nonfinite += CompensateAndScan(g, r, out, begin, end, cut, [&](int64_t i, T c) {
      if (zero_passed) out[i] = T(0);
      if (static_cast<int64_t>(found.size()) <= cap) found.push_back({c, static_cast<int32_t>(i)});
    });
    count += static_cast<int64_t>(found.size());
  });
  *total = count.load();
  *finite = nonfinite.load() == 0;
  return shard_candidates;
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
    .Output("finite: bool")
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

    int64_t total = 0;
    bool finite = true;
    const auto selected = CollectCandidates(context, g, r, out, n, cut, cap, true, &total,
                                            &finite);
    OP_REQUIRES_OK(context, WriteFinite(context, 4, finite));
    const bool rejected = total > cap;
    const int64_t count = rejected ? 0 : total;
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
    for (const auto& shard : selected) {
      for (const Candidate<T>& e : shard) {
        *idx_out++ = e.i;
        *val_out++ = e.c;
      }
    }
  }
};

REGISTER_KERNEL_BUILDER(
    Name("SparseHvdCompensateCut").Device(DEVICE_CPU).TypeConstraint<float>("T"),
    CompensateCutOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("SparseHvdCompensateCut").Device(DEVICE_CPU).TypeConstraint<double>("T"),
    CompensateCutOp<double>);


// SparseHvdCompensateTopK: error feedback's compensate/select/remember for "the k largest of
// the entries at or above a cut", in one pass over the data plus work on the candidates only
// (sparse_hvd.sparsifiers.TopK, and Threshold when its cap is hit):
//
//   1. one pass (sharded): c = grad + residual is written to ``remainder``, and the positions
//      with |c| >= cut (the candidates, in index order) are collected, at most ``cap`` of them;
//   2. if there are fewer than ``low`` or more than ``cap`` candidates, ``missed`` is set and the
//      caller takes its exact slow path instead (a sampled cut missed: rare);
//   3. if there are at most k candidates, all are selected; else the k largest by |c| are found
//      with nth_element (ties: the lower index first, as the partial sort's rule). The selected
//      entries are emitted in index order with their values, and their positions in
//      ``remainder`` set to zero. ``candidates`` is the number of candidates (exact when not
//      missed), so the caller knows whether k cut the selection short.
//
// With low = k this is the exact top-k of c, the same selection and remainder as a partial sort
// of the whole of c: every entry of the top k is at or above the k-th largest, which is at or
// above the cut. With cut = lambda and low = 0 it is a hard threshold whose cap k is applied
// exactly. NaN never passes the cut, so it never enters the comparisons (a NaN gradient's step
// is skipped by the optimizer anyway).
// The selection order: |c| descending, then the lower index first (the partial sort's rule).
template <typename T>
bool Larger(const Candidate<T>& a, const Candidate<T>& b) {
  const T x = std::abs(a.c), y = std::abs(b.c);
  return x > y || (x == y && a.i < b.i);
}

// The bits of |c|: for non-negative, non-NaN floats their order is the order of the numbers.
inline uint32_t MagnitudeKey(float c) {
  uint32_t bits;
  std::memcpy(&bits, &c, sizeof bits);
  return bits & 0x7fffffffu;
}
inline uint64_t MagnitudeKey(double c) {
  uint64_t bits;
  std::memcpy(&bits, &c, sizeof bits);
  return bits & 0x7fffffffffffffffull;
}

// The k-th of ``candidates`` (1 <= k <= size) in the order of Larger, by a radix step instead
// of a comparison sort of all of them (branchy, several passes):
//   1. the range [lo, hi] of the magnitude keys, one pass;
//   2. a histogram of (key - lo) >> shift over at most kBuckets buckets, one pass;
//   3. from the largest bucket down, the bucket where the count reaches k: every candidate in
//      a higher bucket is before the k-th, every one in a lower bucket after it;
//   4. nth_element (with Larger, so ties are exact) among that bucket's candidates only.
template <typename T>
Candidate<T> KthLargest(const std::vector<Candidate<T>>& candidates, int64_t k) {
  using Key = decltype(MagnitudeKey(T(0)));
  constexpr int kBuckets = 4096;
  Key lo = MagnitudeKey(candidates[0].c), hi = lo;
  for (const auto& e : candidates) {
    const Key key = MagnitudeKey(e.c);
    lo = std::min(lo, key);
    hi = std::max(hi, key);
  }
  int shift = 0;
  while (((hi - lo) >> shift) >= static_cast<Key>(kBuckets)) ++shift;
  std::vector<int64_t> histogram(kBuckets, 0);
  for (const auto& e : candidates) ++histogram[(MagnitudeKey(e.c) - lo) >> shift];
  int64_t before = 0;  // candidates in buckets above the current one
  int bucket = kBuckets - 1;
  while (before + histogram[bucket] < k) before += histogram[bucket--];
  std::vector<Candidate<T>> tied;
  tied.reserve(histogram[bucket]);
  for (const auto& e : candidates) {
    if (static_cast<int>((MagnitudeKey(e.c) - lo) >> shift) == bucket) tied.push_back(e);
  }
  const int64_t rank = k - before;  // 1-based within the bucket
  std::nth_element(tied.begin(), tied.begin() + (rank - 1), tied.end(), Larger<T>);
  return tied[rank - 1];
}

REGISTER_OP("SparseHvdCompensateTopK")
    .Attr("T: {float, double}")
    .Input("grad: T")
    .Input("residual: T")
    .Input("cut: T")
    .Input("k: int64")
    .Input("low: int64")
    .Input("cap: int64")
    .Output("remainder: T")
    .Output("indices: int32")
    .Output("values: T")
    .Output("missed: bool")
    .Output("candidates: int64")
    .Output("finite: bool")
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
    const int64_t low = context->input(4).scalar<int64_t>()();
    const int64_t cap = context->input(5).scalar<int64_t>()();
    const int64_t n = grad.NumElements();
    const T* g = grad.flat<T>().data();
    const T* r = residual.flat<T>().data();
    T* out = remainder->flat<T>().data();

    // Step 1: each candidate with its value, so that step 3 reads contiguous memory instead
    // of c at scattered positions of a large tensor.
    int64_t m = 0;
    bool finite = true;
    const auto shard_candidates = CollectCandidates(context, g, r, out, n, cut, cap, false, &m,
                                                    &finite);
    OP_REQUIRES_OK(context, WriteFinite(context, 5, finite));

    // Step 2
    const bool missed = m < low || m > cap || k <= 0;
    const int64_t count = missed ? 0 : std::min(m, k);
    Tensor* indices = nullptr;
    Tensor* values = nullptr;
    Tensor* missed_out = nullptr;
    Tensor* candidates_out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({count}), &indices));
    OP_REQUIRES_OK(context, context->allocate_output(2, TensorShape({count}), &values));
    OP_REQUIRES_OK(context, context->allocate_output(3, TensorShape({}), &missed_out));
    OP_REQUIRES_OK(context, context->allocate_output(4, TensorShape({}), &candidates_out));
    missed_out->scalar<bool>()() = missed;
    candidates_out->scalar<int64_t>()() = m;
    if (missed) return;

    // Step 3
    std::vector<Candidate<T>> candidates;
    candidates.reserve(m);
    for (const auto& found : shard_candidates) {
      candidates.insert(candidates.end(), found.begin(), found.end());
    }
    const bool keep_all = m <= k;
    const Candidate<T> kth = keep_all ? Candidate<T>{} : KthLargest(candidates, k);
    int32_t* idx_out = indices->flat<int32_t>().data();
    T* val_out = values->flat<T>().data();
    int64_t written = 0;
    for (const Candidate<T>& e : candidates) {  // index order; all, or the k not after the k-th
      if (keep_all || e.i == kth.i || Larger(e, kth)) {
        idx_out[written] = e.i;
        val_out[written] = e.c;
        out[e.i] = T(0);
        ++written;
      }
    }
  }
};

REGISTER_KERNEL_BUILDER(
    Name("SparseHvdCompensateTopK").Device(DEVICE_CPU).TypeConstraint<float>("T"),
    CompensateTopKOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("SparseHvdCompensateTopK").Device(DEVICE_CPU).TypeConstraint<double>("T"),
    CompensateTopKOp<double>);

}  // namespace sparse_hvd
