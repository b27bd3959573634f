// One entry of Keras' Adam step, shared by the ops that compute it: ``SparseHvdLocalAdam``
// (local_step.cc: the update cut's local step, the weights untouched) and
// ``SparseHvdApplyAdam`` (apply_adam.cc: the inner step on averaged gradients, in place). One
// definition keeps their float32 operations, and so their bits, the same as Keras'
// ``Adam.update_step``:
//
//   m' = m + (g - m) * (1 - beta_1);  v' = v + (g * g - v) * (1 - beta_2);
//   w2 = w1 - (m' * alpha) / (sqrt(v') + epsilon)
//
// (w1: the weights after the decoupled decay, where it applies; alpha = lr sqrt(1 -
// beta_2^t) / (1 - beta_1^t), computed by the caller as Keras does).

#ifndef SPARSE_HVD_KERNELS_ADAM_ENTRY_H_
#define SPARSE_HVD_KERNELS_ADAM_ENTRY_H_

#include <cmath>

#include "vectorised.h"

namespace sparse_hvd {

// The moments after the step of one entry.
SPARSE_HVD_INLINE void AdamMoments(float g, float m, float v, float one_minus_beta_1,
                                   float one_minus_beta_2, float* first, float* second) {
  *first = m + (g - m) * one_minus_beta_1;
  *second = v + (g * g - v) * one_minus_beta_2;
}

// The weights after the step of one entry, from the moments after it.
SPARSE_HVD_INLINE float AdamWeights(float w1, float first, float second, float alpha,
                                    float epsilon) {
  return w1 - (first * alpha) / (std::sqrt(second) + epsilon);
}

}  // namespace sparse_hvd

#endif  // SPARSE_HVD_KERNELS_ADAM_ENTRY_H_
