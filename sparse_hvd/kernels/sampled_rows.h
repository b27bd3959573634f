// Which entries of a variable the model-wide cut samples (sparse_hvd/selection/model_budget.py,
// ``sampled_blocks``), for the ops that take the sample: SparseHvdSampledMagnitudes
// (sampled_magnitudes.cc) and SparseHvdSampledLocalSgd (local_sgd_cut.cc).

#ifndef SPARSE_HVD_KERNELS_SAMPLED_ROWS_H_
#define SPARSE_HVD_KERNELS_SAMPLED_ROWS_H_

#include <algorithm>
#include <cstdint>

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

}  // namespace sparse_hvd

#endif  // SPARSE_HVD_KERNELS_SAMPLED_ROWS_H_
