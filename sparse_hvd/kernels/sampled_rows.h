// Which entries of a variable the model-wide cut samples (sparse_hvd/selection/model_budget.py,
// ``sampled_blocks``), for the ops that take the sample: SparseHvdSampledMagnitudes
// (sampled_magnitudes.cc) and SparseHvdSampledLocalSgd (local_sgd_cut.cc).

#ifndef SPARSE_HVD_KERNELS_SAMPLED_ROWS_H_
#define SPARSE_HVD_KERNELS_SAMPLED_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/tensor.h"

namespace sparse_hvd {

// The rows of a variable and the entries taken from each.
struct Rows {
  int64_t count;  // rows
  int64_t every;  // entries from one row start to the next
  int64_t taken;  // entries taken at the start of each row
};

// A stride of 0 takes every entry; S > 0 the first min(block, S) entries of each of the
// max(n / S, 1) rows of S entries (a variable shorter than S: one row, its first entries).
inline Rows RowsOf(int64_t n, int64_t stride, int64_t block) {
  if (stride == 0) return {1, n, n};
  if (n < stride) return {1, n, std::min(block, n)};
  return {n / stride, stride, std::min(block, stride)};
}

// Both ops: ``strides`` checked (a vector of one stride per variable, none negative) and each
// variable's rows for its length in ``lengths``, with the sample's size in ``total``.
inline tsl::Status SampledRows(const tensorflow::Tensor& strides,
                               const std::vector<int64_t>& lengths, int64_t block,
                               std::vector<Rows>* rows, int64_t* total) {
  const int64_t count = static_cast<int64_t>(lengths.size());
  if (strides.dims() != 1 || strides.NumElements() != count) {
    return absl::InvalidArgumentError(absl::StrCat("strides must be a vector of ", count,
                                                   " entries, one per variable"));
  }
  const int64_t* stride = strides.flat<int64_t>().data();
  rows->resize(count);
  *total = 0;
  for (int64_t v = 0; v < count; ++v) {
    if (stride[v] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("strides[", v, "] = ", stride[v],
                                                     " is negative"));
    }
    (*rows)[v] = RowsOf(lengths[v], stride[v], block);
    *total += (*rows)[v].count * (*rows)[v].taken;
  }
  return tsl::OkStatus();
}

}  // namespace sparse_hvd

#endif  // SPARSE_HVD_KERNELS_SAMPLED_ROWS_H_
