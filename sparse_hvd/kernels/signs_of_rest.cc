// SparseHvdSignsOfRest: the second stage of ``exchange="topk_sign"``
// (sparse_hvd/exchanges/topk_sign.py, steps 2-3) for one variable, in two passes:
//
//   1. the sum of |remainder| in double, in eight lanes (entry i in lane i % 8, the lanes
//      added in a fixed order at the end; the selected entries are zero); with ``group`` 2
//      (``exchange="topk_sign_pairs"``) the sum of |r[2j] + r[2j+1]| over the pairs j (pair j
//      in lane j % 8; a last odd entry is a pair of its own);
//   2. scale = that sum over the n - selected entries not selected, rounded to float;
//      signs = -scale where remainder < 0 (group 2: where its pair's sum is), else scale;
//      residual = remainder - signs, written
//      over the remainder when nothing else holds it (the error feedback's remainder is a
//      temporary: a fresh buffer of the variable's size costs more than this pass, in page
//      faults, under TensorFlow's default CPU allocator).
//
// SparseHvdPackedSignsOfRest: the same two passes for a rank that sends its signs (more than
// one worker, no compression), its pass 2 writing the sign bits as they travel (one per
// entry, or one per pair with ``group`` 2; little-endian in int32 words, 1: negative) and the
// scale, instead of a float layer of signs that a third pass would read back to pack
// (SparseHvdSignPack, sign_sum.cc): the same words, scale and residual, the layer never made.
//
// The TensorFlow path takes about four passes and sums in float32, which may differ in the
// last bit of the scale: each rank sends its own scale, so replicas stay identical either way.
// Both compiled versions of the passes give the same bits (``vectorised.h``).

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "vectorised.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

REGISTER_OP("SparseHvdSignsOfRest")
    .Input("remainder: float")  // [n]: the compensated tensor, the selected entries zeroed
    .Input("selected: int32")   // the number of selected entries
    .Attr("group: int = 1")     // 1: each entry's own sign; 2: the sign of its pair's sum
    .Output("signs: float")     // [n]: +-scale
    .Output("residual: float")  // [n]: remainder - signs
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(0));
      return tsl::OkStatus();
    });

namespace {

// Pass 1: eight lanes the compiler can add at once, where one running sum would wait on each
// addition; a double holds a sum of float magnitudes nearly exactly, so the order barely
// matters, and it is fixed in the source.
SPARSE_HVD_VECTORISED
double AbsoluteSum(const float* __restrict r, int64_t n) {
  double lanes[8] = {0.0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] += std::fabs(static_cast<double>(r[i + l]));
  }
  for (; i < n; ++i) lanes[i & 7] += std::fabs(static_cast<double>(r[i]));
  return SumOfEightLanes(lanes);
}

// Pass 1 for pairs: the pair sums are taken in float, as the TensorFlow path takes them.
SPARSE_HVD_VECTORISED
double PairSumsAbsoluteSum(const float* __restrict r, int64_t n) {
  double lanes[8] = {0.0};
  const int64_t pairs = n / 2;
  int64_t j = 0;
  for (; j + 8 <= pairs; j += 8) {
    for (int l = 0; l < 8; ++l) {
      lanes[l] += std::fabs(static_cast<double>(r[2 * (j + l)] + r[2 * (j + l) + 1]));
    }
  }
  for (; j < pairs; ++j) lanes[j & 7] += std::fabs(static_cast<double>(r[2 * j] + r[2 * j + 1]));
  if (n % 2) lanes[pairs & 7] += std::fabs(static_cast<double>(r[n - 1]));
  return SumOfEightLanes(lanes);
}

// Step 2's scale: pass 1's sum over the n - selected entries not selected (at least one).
float ScaleOfRest(const float* r, int64_t n, int64_t selected, int group) {
  const int64_t rest = std::max<int64_t>(n - selected, 1);
  const double total = group == 1 ? AbsoluteSum(r, n) : PairSumsAbsoluteSum(r, n);
  return static_cast<float>(total / static_cast<double>(rest));
}

// Pass 2; ``out`` may be ``r`` itself (the remainder's buffer forwarded).
SPARSE_HVD_VECTORISED
void Signed(const float* r, float scale, int64_t n, float* __restrict s, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float sign = r[i] < 0.0f ? -scale : scale;
    s[i] = sign;
    out[i] = r[i] - sign;
  }
}

// Pass 2 for pairs: both entries of a pair take the sign of its sum.
SPARSE_HVD_VECTORISED
void PairSigned(const float* r, float scale, int64_t n, float* __restrict s, float* out) {
  const int64_t pairs = n / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    const float a = r[2 * j], b = r[2 * j + 1];
    const float sign = a + b < 0.0f ? -scale : scale;
    s[2 * j] = sign;
    s[2 * j + 1] = sign;
    out[2 * j] = a - sign;
    out[2 * j + 1] = b - sign;
  }
  if (n % 2) {
    const float sign = r[n - 1] < 0.0f ? -scale : scale;
    s[n - 1] = sign;
    out[n - 1] = r[n - 1] - sign;
  }
}

// Pass 2, packed: the word of sign bits from sign ``begin`` (a multiple of 32) of ``count``
// signs, one per ``G`` entries (a last odd entry a pair of its own), each sign's entries'
// residual written. A bit is set where the float layer's value would be negative, so the
// words are SignPack's of that layer. ``out`` may be ``r`` (each entry is read first).
template <int G>
SPARSE_HVD_INLINE uint32_t SignedWord(const float* r, float scale, int64_t n, int64_t begin,
                                      int64_t count, float* out) {
  uint32_t bits = 0;
  for (int64_t b = 0; b < count; ++b) {
    const int64_t i = (begin + b) * G;
    const bool pair = G == 2 && i + 1 < n;
    const float first = r[i], second = pair ? r[i + 1] : 0.0f;
    const float sign = (pair ? first + second : first) < 0.0f ? -scale : scale;
    bits |= static_cast<uint32_t>(sign < 0.0f) << b;
    out[i] = first - sign;
    if (pair) out[i + 1] = second - sign;
  }
  return bits;
}

// The same for a whole word inside the tensor: no bounds to check, so it vectorises.
template <int G>
SPARSE_HVD_INLINE uint32_t WholeWord(const float* r, float scale, int64_t begin, float* out) {
  uint32_t bits = 0;
  for (int64_t b = 0; b < 32; ++b) {
    const int64_t i = (begin + b) * G;
    const float first = r[i], second = G == 2 ? r[i + 1] : 0.0f;
    const float sign = (G == 2 ? first + second : first) < 0.0f ? -scale : scale;
    bits |= static_cast<uint32_t>(sign < 0.0f) << b;
    out[i] = first - sign;
    if (G == 2) out[i + 1] = second - sign;
  }
  return bits;
}

template <int G>
SPARSE_HVD_INLINE void PackedSigned(const float* r, float scale, int64_t n,
                                    uint32_t* __restrict words, float* out) {
  const int64_t signs = (n + G - 1) / G, width = (signs + 31) / 32;
  const int64_t whole = n / (32 * G);  // words whose every sign has all G entries
  for (int64_t word = 0; word < whole; ++word) words[word] = WholeWord<G>(r, scale, word * 32, out);
  for (int64_t word = whole; word < width; ++word) {
    const int64_t begin = word * 32;
    words[word] = SignedWord<G>(r, scale, n, begin, std::min<int64_t>(32, signs - begin), out);
  }
}

// The two instances, each compiled in both versions (``vectorised.h``).
SPARSE_HVD_VECTORISED
void PackedEntrySigns(const float* r, float scale, int64_t n, uint32_t* __restrict words,
                      float* out) {
  PackedSigned<1>(r, scale, n, words, out);
}

SPARSE_HVD_VECTORISED
void PackedPairSigns(const float* r, float scale, int64_t n, uint32_t* __restrict words,
                     float* out) {
  PackedSigned<2>(r, scale, n, words, out);
}

}  // namespace

// What both ops share: the attribute ``group`` and the inputs' checks.
class RestOpBase : public OpKernel {
 public:
  explicit RestOpBase(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("group", &group_));
    OP_REQUIRES(context, group_ == 1 || group_ == 2, InvalidArgumentError("group must be 1 or 2"));
  }

 protected:
  static absl::Status CheckedInputs(const Tensor& remainder, const Tensor& selected) {
    if (remainder.dims() != 1) return InvalidArgumentError("remainder must be 1-D");
    if (selected.dims() != 0) return InvalidArgumentError("selected must be a scalar");
    return tsl::OkStatus();
  }

  int group_ = 1;
};

class SignsOfRestOp : public RestOpBase {
 public:
  using RestOpBase::RestOpBase;

  void Compute(OpKernelContext* context) override {
    const Tensor& remainder = context->input(0);
    const Tensor& selected = context->input(1);
    OP_REQUIRES_OK(context, CheckedInputs(remainder, selected));
    const int64_t n = remainder.dim_size(0);
    Tensor* signs = nullptr;
    Tensor* residual = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, remainder.shape(), &signs));
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output({0}, 1, remainder.shape(),
                                                                      &residual));
    const float* r = remainder.flat<float>().data();
    const float scale = ScaleOfRest(r, n, selected.scalar<int32_t>()(), group_);
    float* s = signs->flat<float>().data();
    float* out = residual->flat<float>().data();
    if (group_ == 1) {
      Signed(r, scale, n, s, out);
    } else {
      PairSigned(r, scale, n, s, out);
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdSignsOfRest").Device(tensorflow::DEVICE_CPU),
                        SignsOfRestOp);

REGISTER_OP("SparseHvdPackedSignsOfRest")
    .Input("remainder: float")  // [n]: the compensated tensor, the selected entries zeroed
    .Input("selected: int32")   // the number of selected entries
    .Attr("group: int = 1")     // 1: each entry's own sign; 2: the sign of its pair's sum
    .Output("words: int32")     // [(m + 31) / 32], m = ceil(n / group) sign bits
    .Output("scale: float")     // [1]
    .Output("residual: float")  // [n]: remainder - the signs
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      int64_t group = 1;
      TF_RETURN_IF_ERROR(c->GetAttr("group", &group));
      tensorflow::shape_inference::DimensionHandle n = c->Dim(c->input(0), 0);
      c->set_output(0, c->ValueKnown(n)
                           ? c->Vector(((c->Value(n) + group - 1) / group + 31) / 32)
                           : c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(1));
      c->set_output(2, c->input(0));
      return tsl::OkStatus();
    });

class PackedSignsOfRestOp : public RestOpBase {
 public:
  using RestOpBase::RestOpBase;

  void Compute(OpKernelContext* context) override {
    const Tensor& remainder = context->input(0);
    const Tensor& selected = context->input(1);
    OP_REQUIRES_OK(context, CheckedInputs(remainder, selected));
    const int64_t n = remainder.dim_size(0);
    const int64_t width = ((n + group_ - 1) / group_ + 31) / 32;
    Tensor* words = nullptr;
    Tensor* scale_out = nullptr;
    Tensor* residual = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({width}), &words));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({1}), &scale_out));
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output({0}, 2, remainder.shape(),
                                                                      &residual));
    const float* r = remainder.flat<float>().data();
    const float scale = ScaleOfRest(r, n, selected.scalar<int32_t>()(), group_);
    scale_out->flat<float>()(0) = scale;
    uint32_t* packed = reinterpret_cast<uint32_t*>(words->flat<int32_t>().data());
    float* out = residual->flat<float>().data();
    if (group_ == 1) {
      PackedEntrySigns(r, scale, n, packed, out);
    } else {
      PackedPairSigns(r, scale, n, packed, out);
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdPackedSignsOfRest").Device(tensorflow::DEVICE_CPU),
                        PackedSignsOfRestOp);

}  // namespace sparse_hvd
