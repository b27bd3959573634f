// The entries of a small block that pass a cut, found without a branch per entry
// (compensate_cut.cc, local_sgd_cut.cc).
//
// Those kernels scan each block of 16 entries twice: a vectorised loop computes c and counts
// the entries with |c| >= cut, and only a block with a hit is looked at again for them. A
// branch per entry in that second look (``if (|c| >= cut) ...``) is taken at random, so at a
// warm-up's densities most blocks paid a mispredicted branch per hit and a scalar walk over
// all 16 entries: on 3.3M entries, one thread, the local SGD cut's selection added 4.7 ms to
// its 2.7 ms pass at 5% density (28 ns a selected entry). Here the second look builds a mask
// of the passing entries (one comparison, shift and OR per entry, no branch) and then visits
// only its set bits, in ascending order: the same entries, in the same order.

#ifndef SPARSE_HVD_KERNELS_PASSED_MASK_H_
#define SPARSE_HVD_KERNELS_PASSED_MASK_H_

#include <cmath>
#include <cstdint>

#include "vectorised.h"

namespace sparse_hvd {

constexpr int64_t kPassedMaskBits = 32;  // the most entries one mask holds

// Bit j set where |values[j]| >= cut, for j < length <= kPassedMaskBits (NaN never passes).
template <typename T>
SPARSE_HVD_INLINE uint32_t PassedMask(const T* values, int64_t length, T cut) {
  uint32_t mask = 0;
  for (int64_t j = 0; j < length; ++j) {
    mask |= static_cast<uint32_t>(std::abs(values[j]) >= cut) << j;
  }
  return mask;
}

// The position of the lowest set bit of a non-zero mask.
SPARSE_HVD_INLINE int LowestBit(uint32_t mask) {
#if defined(__GNUC__)
  return __builtin_ctz(mask);
#else
  int j = 0;
  while (!(mask & 1u)) {
    mask >>= 1;
    ++j;
  }
  return j;
#endif
}

// visit(j) for each set bit j of ``mask``, lowest first.
template <typename Visit>
SPARSE_HVD_INLINE void ForEachPassed(uint32_t mask, Visit visit) {
  while (mask != 0) {
    visit(LowestBit(mask));
    mask &= mask - 1;
  }
}

}  // namespace sparse_hvd

#endif  // SPARSE_HVD_KERNELS_PASSED_MASK_H_
