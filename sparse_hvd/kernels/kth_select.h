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

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace sparse_hvd {

// ``entries`` cuts of a run of ``length`` values into ``segments`` segments (segment v is
// [cuts[v], cuts[v + 1])): one more cut than segments (``per`` names what they count), each
// within the run, none below the one before; else an error that names the place.
inline absl::Status CheckCuts(const int32_t* cuts, int64_t entries, int64_t segments,
                              int64_t length, absl::string_view per) {
  if (entries != segments + 1)
    return absl::InvalidArgumentError(absl::StrCat("cuts must have one more entry than ", per,
                                                   " (", segments + 1, "), got ", entries));
  for (int64_t v = 0; v < entries; ++v) {
    if (cuts[v] < 0 || cuts[v] > length)
      return absl::InvalidArgumentError(
          absl::StrCat("cuts[", v, "] = ", cuts[v], " is not in [0, ", length, "]"));
    if (v > 0 && cuts[v - 1] > cuts[v])
      return absl::InvalidArgumentError(absl::StrCat("cuts must not decrease: cuts[", v - 1,
                                                     "] = ", cuts[v - 1], ", cuts[", v,
                                                     "] = ", cuts[v]));
  }
  return absl::OkStatus();
}

// a > b in an order where NaN is above every number (a strict weak order, as
// std::nth_element needs)
template <typename T>
bool Above(T a, T b) {
  if (std::isnan(b)) return false;
  if (std::isnan(a)) return true;
  return a > b;
}

constexpr int64_t kStride = 16;             // SampleSelect reads every 16th entry for the bound
constexpr int64_t kSmallestSampled = 16384;  // shorter runs: nth_element on all of them

// The k-th largest of values[0, size) (1 <= k <= size) in the order of Above, or false when
// the sample's bound kept fewer than k entries (the caller then selects among all):
//   1. the bound b: the j-th largest of every kStride-th entry, j the number of those expected
//      at or above the k-th largest (k / kStride) plus three standard deviations and 8, so b
//      lies below the k-th largest all but rarely;
//   2. ``kept``: the entries not below b (NaN is never below), in one pass;
//   3. with at least k kept, the k-th largest of all is among them (every entry left out is
//      below b, so below k kept ones): their k-th largest.
template <typename T>
bool SampleSelect(const T* values, int64_t size, int64_t k, std::vector<T>* kept, T* kth) {
  std::vector<T> sample;
  sample.reserve(size / kStride + 1);
  for (int64_t i = 0; i < size; i += kStride) sample.push_back(values[i]);
  const double expected = static_cast<double>(k) / kStride;
  const int64_t j = std::min<int64_t>(
      static_cast<int64_t>(sample.size()),
      static_cast<int64_t>(expected + 3.0 * std::sqrt(expected)) + 8);
  std::nth_element(sample.begin(), sample.begin() + (j - 1), sample.end(), Above<T>);
  const T bound = sample[j - 1];
  kept->clear();
  for (int64_t i = 0; i < size; ++i) {
    if (!(values[i] < bound)) kept->push_back(values[i]);
  }
  if (static_cast<int64_t>(kept->size()) < k) return false;
  std::nth_element(kept->begin(), kept->begin() + (k - 1), kept->end(), Above<T>);
  *kth = (*kept)[k - 1];
  return true;
}

// The k-th largest of values[0, size) (1 <= k <= size): among the entries above a sampled
// bound where k is a small share of a long run (SampleSelect), else std::nth_element on a copy
// of all of them (a k near the run's end is as quick that way: 0.11 ms for the 43,500th of
// 45,700, against 0.36 ms for the 20,000th). ``scratch`` is reused between calls.
template <typename T>
T KthLargestOf(const T* values, int64_t size, int64_t k, std::vector<T>* scratch) {
  T kth;
  if (size >= kSmallestSampled && k <= size / kStride &&
      SampleSelect(values, size, k, scratch, &kth)) {
    return kth;
  }
  scratch->assign(values, values + size);
  auto at = scratch->begin() + (k - 1);
  std::nth_element(scratch->begin(), at, scratch->end(), Above<T>);
  return *at;
}

}  // namespace sparse_hvd

#endif  // SPARSE_HVD_KERNELS_KTH_SELECT_H_
