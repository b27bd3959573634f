// One entry of Keras' SGD step as an update (the update cut's local step), shared by the ops
// that compute it: ``SparseHvdLocalSgd`` (local_step.cc) writes it out, the fused
// ``SparseHvdLocalSgdCut`` and ``SparseHvdSampledLocalSgd`` (local_sgd_cut.cc) use it where
// they need it. One definition keeps their float32 operations, and so their bits, the same.
//
// Per entry: w1 = w - (w * weight_decay) * lr where the decoupled decay applies, else w; with
// momentum v' = m * momentum - g * lr and w2 = w1 + v' (Nesterov: w1 + (v' * momentum - g *
// lr)), without it w2 = w1 - g * lr; the update is u = w - w2 (what the weights would lose).

#ifndef SPARSE_HVD_KERNELS_SGD_ENTRY_H_
#define SPARSE_HVD_KERNELS_SGD_ENTRY_H_

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "tensorflow/core/framework/tensor.h"
#include "vectorised.h"

namespace sparse_hvd {

// In the order of the ops' ``coefficients``.
struct SgdCoefficients {
  float learning_rate, momentum, decayed, weight_decay;
};
constexpr int kSgdCoefficients = 4;

// The coefficients at ``c`` (kSgdCoefficients floats, in the order above).
inline SgdCoefficients SgdCoefficientsAt(const float* c) { return {c[0], c[1], c[2], c[3]}; }

// 1 where ``x`` is NaN or infinite, else 0, without a branch (so the loops stay vectorised).
SPARSE_HVD_INLINE int NotFinite(float x) { return !(std::fabs(x) <= FLT_MAX); }

// The update of one entry; with momentum the velocity after the step goes to ``velocity``.
template <bool kMomentum, bool kNesterov, bool kDecayed>
SPARSE_HVD_INLINE float SgdUpdate(float g, float m, float w, const SgdCoefficients& k,
                                  float* velocity) {
  const float w1 = kDecayed ? w - (w * k.weight_decay) * k.learning_rate : w;
  float w2;
  if (kMomentum) {
    *velocity = m * k.momentum - g * k.learning_rate;
    w2 = kNesterov ? w1 + (*velocity * k.momentum - g * k.learning_rate) : w1 + *velocity;
  } else {
    w2 = w1 - g * k.learning_rate;
  }
  return w - w2;
}

// The checks both ops make of a gradient (1-D), a velocity (empty without momentum, else as
// long) and the coefficients; OK, or the problem named.
inline tsl::Status CheckSgdInputs(const tensorflow::Tensor& gradient,
                                  const tensorflow::Tensor& m,
                                  const tensorflow::Tensor& coefficients) {
  if (gradient.dims() != 1) return absl::InvalidArgumentError("gradient must be 1-D (flat)");
  if (m.NumElements() != 0 && m.NumElements() != gradient.NumElements()) {
    return absl::InvalidArgumentError("m must be empty or have as many entries as gradient");
  }
  if (coefficients.NumElements() != kSgdCoefficients) {
    return absl::InvalidArgumentError("coefficients must hold 4 values");
  }
  return tsl::OkStatus();
}

}  // namespace sparse_hvd

#endif  // SPARSE_HVD_KERNELS_SGD_ENTRY_H_
