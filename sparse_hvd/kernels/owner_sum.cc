// SparseHvdOwnerSum: what an owner of the sparse allreduce received, summed and thresholded in
// one pass (sparse_hvd/exchanges/sparse_allreduce.py, steps 3-4).
//
// Inputs: the received global ``indices`` (int32) and ``values`` (T), rank by rank in rank
// order (a rank sends an index at most once); ``starts`` (int32 [V], ascending): where each
// variable begins in the index space; ``thresholds`` (float64 [V]): each variable's theta;
// ``levels`` (float64 [L]): the factors of theta to count at (the first is 1: the kept set).
//
//   1. the entries are visited by (index, position), so equal indices come together in rank
//      order: at most two ascending runs (an owner of two ranks receives two blocks, each in
//      index order) by one merge walk; else a radix sort of as many 11-bit passes as the
//      indices' span needs;
//   2. each index's sum starts from zero and adds its entries in that order: the additions of
//      TensorFlow's segment sum on CPU, so the same bits;
//   3. per sum: its variable (the last start at or below it), its magnitude in float64, the
//      levels it reaches (|sum| >= theta x level) counted per variable, and whether it is kept
//      (|sum| >= theta); without a branch on the magnitude (which way it goes is as good as
//      random).
//
// Outputs: the kept indices (ascending) and sums, and the counts [V, L].

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
using tensorflow::TensorShape;

REGISTER_OP("SparseHvdOwnerSum")
    .Attr("T: {float, double}")
    .Input("indices: int32")
    .Input("values: T")
    .Input("starts: int32")
    .Input("thresholds: double")
    .Input("levels: double")
    .Output("kept_indices: int32")
    .Output("kept_sums: T")
    .Output("counts: int32")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(c->UnknownDim()));
      c->set_output(2, c->Matrix(c->Dim(c->input(2), 0), c->Dim(c->input(4), 0)));
      return tsl::OkStatus();
    });

// Steps 1-2 for entries that are at most two ascending runs, [0, middle) and [middle,
// entries) (two ranks' blocks, each in index order): one merge walk; an index in both is
// summed first run first. (Two runs of 43,500 entries over 4.35M, one process, the op alone:
// 1.18 ms; 1.75 ms with branches on which run leads and on each sum's magnitude.)
template <typename T, typename Account>
void MergeTwoRuns(const int32_t* index, const T* value, int64_t middle, int64_t entries,
                  Account& account) {
  int64_t i = 0, j = middle;
  // While both runs have entries: the next index and its sum chosen without a branch (which
  // run leads is as good as random).
  while (i < middle && j < entries) {
    const int32_t a = index[i], b = index[j];
    const bool from_first = a <= b, from_second = b <= a;
    const T first = T(0) + (from_first ? value[i] : value[j]);
    const T both = first + value[j];
    account(from_first ? a : b, from_first && from_second ? both : first);
    i += from_first;
    j += from_second;
  }
  for (; i < middle; ++i) account(index[i], T(0) + value[i]);
  for (; j < entries; ++j) account(index[j], T(0) + value[j]);
}

// Steps 1-2 for entries in any order: (index less ``lowest``, position) in one 64-bit key,
// sorted by the index with a stable radix sort (the positions of one index stay in ascending
// order) of as many 11-bit passes as the span up to ``highest`` needs (an owner's region of
// up to 2^22 entries: two), then each index's entries summed in position order. (4 ranks'
// 216,000 entries over 1.09M: 2.85 ms; a merge of the 4 runs, taking the least of their heads
// at each step, took 3.84 ms.)
template <typename T, typename Account>
void SortAndSum(const int32_t* index, const T* value, int64_t entries, int32_t lowest,
                int32_t highest, Account& account) {
  std::vector<uint64_t> keys(entries), scratch(entries);
  for (int64_t e = 0; e < entries; ++e) {
    keys[e] = (static_cast<uint64_t>(index[e] - lowest) << 32) | static_cast<uint64_t>(e);
  }
  const uint64_t span = static_cast<uint64_t>(highest - lowest);
  int end_shift = 32;  // the first bit above the span's
  while (end_shift < 64 && (span >> (end_shift - 32)) != 0) end_shift += 11;
  for (int shift = 32; shift < end_shift; shift += 11) {
    std::vector<int64_t> bucket(2049, 0);
    for (uint64_t key : keys) ++bucket[((key >> shift) & 2047) + 1];
    for (int b = 0; b < 2048; ++b) bucket[b + 1] += bucket[b];
    for (uint64_t key : keys) scratch[bucket[(key >> shift) & 2047]++] = key;
    keys.swap(scratch);
  }
  for (int64_t e = 0; e < entries;) {
    const uint64_t at = keys[e] >> 32;
    T sum = T(0);
    for (; e < entries && (keys[e] >> 32) == at; ++e) sum += value[keys[e] & 0xffffffffu];
    account(static_cast<int32_t>(at) + lowest, sum);
  }
}

template <typename T>
class OwnerSumOp : public OpKernel {
 public:
  explicit OwnerSumOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& indices = context->input(0);
    const Tensor& values = context->input(1);
    const auto starts = context->input(2).flat<int32_t>();
    const auto thresholds = context->input(3).flat<double>();
    const auto levels = context->input(4).flat<double>();
    const int64_t entries = indices.NumElements();
    const int64_t variables = starts.size();
    const int64_t count_levels = levels.size();
    OP_REQUIRES(context, values.NumElements() == entries,
                InvalidArgumentError(absl::StrCat(entries, " indices but ",
                                                  values.NumElements(), " values")));
    OP_REQUIRES(context, thresholds.size() == variables && variables > 0,
                InvalidArgumentError("thresholds and starts must have one entry per variable"));
    const int32_t* index = indices.flat<int32_t>().data();
    const T* value = values.flat<T>().data();

    // Step 1's first pass: the indices checked, their span, and where a second ascending
    // run starts (``runs`` counts up to 3).
    int32_t lowest = entries > 0 ? index[0] : 0, highest = lowest;
    int64_t runs = entries > 0 ? 1 : 0, middle = entries;
    for (int64_t e = 0; e < entries; ++e) {
      OP_REQUIRES(context, index[e] >= 0,
                  InvalidArgumentError(absl::StrCat("a negative index arrived: ", index[e])));
      lowest = std::min(lowest, index[e]);
      highest = std::max(highest, index[e]);
      if (e > 0 && index[e] <= index[e - 1] && runs < 3 && ++runs == 2) middle = e;
    }

    Tensor* counts_out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(
                                2, TensorShape({variables, count_levels}), &counts_out));
    auto counts = counts_out->matrix<int32_t>();
    counts.setZero();
    // Sized for every entry kept; written without a branch (the slot after the last kept
    // one is overwritten by the next sum), the kept count advanced by the comparison.
    std::vector<int32_t> kept_index(entries + 1);
    std::vector<T> kept_sum(entries + 1);
    int64_t kept = 0;
    int64_t variable = 0;
    std::vector<double> cuts(count_levels);  // theta x each level, for ``variable``
    std::vector<int64_t> reached(count_levels, 0);  // its sums at or above each cut
    double theta = 0.0;
    auto enter = [&](int64_t v) {
      for (int64_t l = 0; l < count_levels; ++l) {
        counts(variable, l) = static_cast<int32_t>(reached[l]);
        reached[l] = 0;
      }
      variable = v;
      theta = thresholds(variable);
      for (int64_t l = 0; l < count_levels; ++l) cuts[l] = theta * levels(l);
    };
    enter(0);
    // Step 3 for one index's sum, in ascending index order.
    auto account = [&](int32_t at, T sum) {
      if (variable + 1 < variables && starts(variable + 1) <= at) {
        int64_t next = variable + 1;
        while (next + 1 < variables && starts(next + 1) <= at) ++next;
        enter(next);
      }
      const double magnitude = std::fabs(static_cast<double>(sum));
      for (int64_t l = 0; l < count_levels; ++l) reached[l] += magnitude >= cuts[l];
      kept_index[kept] = at;
      kept_sum[kept] = sum;
      kept += magnitude >= theta;
    };
    if (runs <= 2) {
      MergeTwoRuns(index, value, middle, entries, account);
    } else {
      SortAndSum(index, value, entries, lowest, highest, account);
    }
    enter(variable);  // the last variable's counts written

    Tensor* out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({kept}), &out));
    std::copy(kept_index.begin(), kept_index.begin() + kept, out->flat<int32_t>().data());
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({kept}), &out));
    std::copy(kept_sum.begin(), kept_sum.begin() + kept, out->flat<T>().data());
  }
};

REGISTER_KERNEL_BUILDER(
    Name("SparseHvdOwnerSum").Device(tensorflow::DEVICE_CPU).TypeConstraint<float>("T"),
    OwnerSumOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("SparseHvdOwnerSum").Device(tensorflow::DEVICE_CPU).TypeConstraint<double>("T"),
    OwnerSumOp<double>);

}  // namespace sparse_hvd
