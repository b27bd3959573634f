// The k-th largest of a run of values by selection, shared by kth_largest.cc (per segment)
// and next_thresholds.cc (the sparse allreduce's cut inside its forecast). NaN orders above
// every number, so a non-finite step (whose results are discarded) still gets a well-defined
// order.

#ifndef SPARSE_HVD_KERNELS_KTH_SELECT_H_
#define SPARSE_HVD_KERNELS_KTH_SELECT_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace sparse_hvd {

// a > b in an order where NaN is above every number (a strict weak order, as
// std::nth_element needs)
template <typename T>
bool Above(T a, T b) {
  if (std::isnan(b)) return false;
  if (std::isnan(a)) return true;
  return a > b;
}

// a before b in ascending order, NaN last: Above reversed
template <typename T>
bool Below(T a, T b) {
  return Above(b, a);
}

constexpr int64_t kStride = 16;             // SampleSelect reads every 16th entry for the bound
constexpr int64_t kSmallestSampled = 16384;  // shorter runs: nth_element on all of them

// The k-th of values[0, size) (1 <= k <= size) in the order ``Before`` (Above: the k-th
// largest; Below: the k-th smallest), or false when the sample's bound kept fewer than k
// entries (the caller then selects among all):
//   1. the bound b: the j-th of every kStride-th entry, j the number of those expected before
//      the k-th (k / kStride) plus three standard deviations and 8, so b lies after the k-th
//      all but rarely;
//   2. ``kept``: the entries not after b, in one pass;
//   3. with at least k kept, the k-th of all is among them (every entry left out is after b,
//      so after k kept ones): their k-th.
template <typename T, bool (*Before)(T, T)>
bool SampleSelect(const T* values, int64_t size, int64_t k, std::vector<T>* kept, T* kth) {
  std::vector<T> sample;
  sample.reserve(size / kStride + 1);
  for (int64_t i = 0; i < size; i += kStride) sample.push_back(values[i]);
  const double expected = static_cast<double>(k) / kStride;
  const int64_t j = std::min<int64_t>(
      static_cast<int64_t>(sample.size()),
      static_cast<int64_t>(expected + 3.0 * std::sqrt(expected)) + 8);
  std::nth_element(sample.begin(), sample.begin() + (j - 1), sample.end(), Before);
  const T bound = sample[j - 1];
  kept->clear();
  for (int64_t i = 0; i < size; ++i) {
    if (!Before(bound, values[i])) kept->push_back(values[i]);
  }
  if (static_cast<int64_t>(kept->size()) < k) return false;
  std::nth_element(kept->begin(), kept->begin() + (k - 1), kept->end(), Before);
  *kth = (*kept)[k - 1];
  return true;
}

// The k-th largest of values[0, size) (1 <= k <= size). Where k, or its place from the
// bottom (size - k + 1), is a small share of a long run, selected among the entries on that
// side of a sampled bound (SampleSelect): the sparse allreduce's cut is the K-th largest of
// about 1.02-1.07 K kept sums, so from the bottom the 2,000th of 45,000 (the 4.35M MLP at 1%),
// where std::nth_element on all of them took about 0.4 ms. Else std::nth_element on a copy of
// all of them. ``scratch`` is reused between calls.
template <typename T>
T KthLargestOf(const T* values, int64_t size, int64_t k, std::vector<T>* scratch) {
  T kth;
  if (size >= kSmallestSampled) {
    if (k <= size / kStride && SampleSelect<T, Above<T>>(values, size, k, scratch, &kth)) {
      return kth;
    }
    const int64_t from_bottom = size - k + 1;
    if (from_bottom <= size / kStride &&
        SampleSelect<T, Below<T>>(values, size, from_bottom, scratch, &kth)) {
      return kth;
    }
  }
  scratch->assign(values, values + size);
  auto at = scratch->begin() + (k - 1);
  std::nth_element(scratch->begin(), at, scratch->end(), Above<T>);
  return *at;
}

}  // namespace sparse_hvd

#endif  // SPARSE_HVD_KERNELS_KTH_SELECT_H_
