// The ops of the scaled signs (sparse_hvd/exchanges/sign.py). Each has an attribute ``block``:
// 0 is one scale for the whole variable (``exchange="sign_per_variable"``, and the signs of
// ``exchange="topk_sign"``); B > 0 (a multiple of 32) is one scale per block of B entries
// (``exchange="sign"``), the last block holding what is left.
//
// SparseHvdCompensateSign: error feedback's step for the scaled signs (step 1), in two passes:
// c = gradient + residual and, per block, the sum of |c| (in double, in eight lanes); the
// block's scale is that sum over its entries, rounded to float (and with block > 0 to
// bfloat16, round to nearest even, as its scales travel); then sent = -scale where c < 0, else
// scale, and the remainder c - sent; and whether every c was finite (the payload's check,
// found in the same pass). The TensorFlow path (``scaled_signs``) takes about five passes; its
// mean is float32's reduction, which may differ in the last bit: each rank sends its own
// scales, so replicas stay identical either way.
//
// SparseHvdPackedCompensateSign: SparseHvdCompensateSign for a rank that sends its signs as
// they are (more than one worker, its scales not rounded), writing them as SparseHvdSignPack
// would pack them: the sign bits in int32 words and each block's scale (the largest |sent|,
// which is the scale itself, 0 for a NaN one as the pack's maximum gives it), never the [n]
// floats ``sent``, which only the packing would read (a write and a read of every entry fewer).
//
// SparseHvdSignPack: one rank's sign bits of a variable's scaled signs and their magnitudes
// (step 2), in one pass: bit i of word i / 32 (little-endian) is set where value i is negative,
// and a block's scale is its largest |value| (every value of a block is +-scale; an exact
// maximum, in any order). The TensorFlow path takes several passes.
//
// SparseHvdSignSum: one variable's average from every rank's sign bits and scales (step 3),
// in one pass over the output. Its attribute ``group`` (``exchange="topk_sign_pairs"``: 2) is
// the number of entries each sign stands for: the words hold ceil(n / group) signs and every
// average is written to its ``group`` entries (the last group cut at n), so that no copy
// spreads them afterwards; SparseHvdSignPack's ``stride`` is its other side: it packs entries
// 0, stride, 2 x stride, ... only (one of each group, all equal), so that no strided copy is
// made to be packed.
//
// The TensorFlow path unpacks every rank's bits into a [ranks, n] tensor of +-1, multiplies
// each row by its rank's scales and adds the rows: several passes over ranks x n entries.
// Here each output entry is made once:
//
//   1. in shards of 64K entries on the CPU worker threads, entry i starts at 0.0f;
//   2. rank by rank, in rank order, it adds -scale where bit i of rank r's words is set, else
//      scale, the scale of rank r's block holding i (the same additions, in the same order, as
//      the TensorFlow path's ``sum_rows_in_order``: the same bits);
//   3. it is divided by the number of ranks (IEEE division, as ``tf.math.divide_no_nan`` for
//      a divisor of 1 or more).
//
// Bits are little-endian: bit i is bit i % 32 of word i / 32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "vectorised.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

REGISTER_OP("SparseHvdSignSum")
    .Attr("num_elements: int >= 0")
    .Attr("block: int = 0")
    .Attr("group: int >= 1 = 1")
    .Input("words: int32")   // [ranks, words]: each rank's sign bits
    .Input("scales: float")  // [ranks, blocks]: each rank's scales
    .Output("average: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      int64_t n = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("num_elements", &n));
      c->set_output(0, c->Vector(n));
      return tsl::OkStatus();
    });

constexpr int64_t kShard = 1 << 16;  // a multiple of 32: a shard starts at a word

// The number of scales a variable of ``n`` entries has with ``block`` (0: one).
inline int64_t BlocksOf(int64_t n, int64_t block) {
  return block == 0 ? 1 : (n + block - 1) / block;
}

// ``value`` rounded to the nearest bfloat16 (ties to even), as float: what TensorFlow's cast
// to bfloat16 gives for a finite value or an infinity; a NaN stays a NaN.
inline float RoundedToBfloat16(float value) {
  if (std::isnan(value)) return value;
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  bits &= 0xffff0000u;
  float rounded;
  std::memcpy(&rounded, &bits, sizeof rounded);
  return rounded;
}

// The attribute ``block`` of each op: 0, or a positive multiple of 32 (a word's bits share a
// block, which keeps the sum's inner loop per word).
inline tsl::Status CheckedBlock(int64_t block) {
  if (block < 0 || block % 32 != 0) {
    return InvalidArgumentError(absl::StrCat("block must be 0 or a positive multiple of 32, got ",
                                             block));
  }
  return tsl::OkStatus();
}

// Steps 1-3 for the ``count`` (at most 32) signs of one word: ``bits`` is rank 0's word,
// rank r's is ``width`` words further on; ``scale`` is rank 0's scale of the word's block,
// rank r's is ``blocks`` further on. Each average is added up in a register and written once
// to each of the ``group`` entries its sign stands for, the first ``entries`` of ``out``.
SPARSE_HVD_INLINE void SumWord(const uint32_t* bits, int64_t width, int64_t ranks,
                               const float* scale, int64_t blocks, float divisor, float* out,
                               int64_t count, int64_t group, int64_t entries) {
  alignas(64) float sums[32] = {0.0f};  // step 1
  alignas(64) uint32_t lanes[32];
  for (int64_t r = 0; r < ranks; ++r) {  // step 2, rank by rank
    const uint32_t word = bits[r * width];
    const float plus = scale[r * blocks], minus = -scale[r * blocks];
    // the word's bit b in lane b, by masks rather than shifts by b (plain SSE2 has no
    // per-lane shift), so that the compiler can add several lanes at once
    for (int b = 0; b < 32; ++b) lanes[b] = word & (1u << b);
    for (int b = 0; b < 32; ++b) sums[b] += lanes[b] ? minus : plus;
  }
  if (group == 1) {
    for (int64_t b = 0; b < count; ++b) out[b] = sums[b] / divisor;  // step 3
    return;
  }
  if (group == 2 && count == 32 && entries >= 64) {  // a whole word of pairs: interleaved
    for (int64_t b = 0; b < 32; ++b) out[2 * b] = out[2 * b + 1] = sums[b] / divisor;
    return;
  }
  for (int64_t b = 0; b < count; ++b) {
    const float average = sums[b] / divisor;
    for (int64_t at = b * group; at < std::min(entries, (b + 1) * group); ++at) out[at] = average;
  }
}

// Steps 1-3 for the signs of words [first, last) of a variable of ``n`` entries, ``signs``
// of them (ceil(n / group)).
SPARSE_HVD_VECTORISED
void SumWords(const uint32_t* bits, int64_t width, int64_t ranks, const float* scale,
              int64_t blocks, int64_t block, float divisor, float* out, int64_t n,
              int64_t signs, int64_t group, int64_t first, int64_t last) {
  for (int64_t word = first; word < last; ++word) {
    const int64_t at = block == 0 ? 0 : word * 32 / block;
    SumWord(bits + word, width, ranks, scale + at, blocks, divisor, out + word * 32 * group,
            std::min<int64_t>(32, signs - word * 32), group, n - word * 32 * group);
  }
}

class SignSumOp : public OpKernel {
 public:
  explicit SignSumOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("num_elements", &num_elements_));
    OP_REQUIRES_OK(context, context->GetAttr("block", &block_));
    OP_REQUIRES_OK(context, CheckedBlock(block_));
    OP_REQUIRES_OK(context, context->GetAttr("group", &group_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& words = context->input(0);
    const Tensor& scales = context->input(1);
    const int64_t n = num_elements_, signs = (n + group_ - 1) / group_;
    const int64_t blocks = BlocksOf(signs, block_);
    OP_REQUIRES(context, words.dims() == 2 && scales.dims() == 2 &&
                             scales.dim_size(0) == words.dim_size(0) &&
                             scales.dim_size(1) == blocks,
                InvalidArgumentError(absl::StrCat("words must be [ranks, words] and scales [",
                                                  "ranks, ", blocks, "]")));
    const int64_t ranks = words.dim_size(0), width = words.dim_size(1);
    OP_REQUIRES(context, width == (signs + 31) / 32,
                InvalidArgumentError(absl::StrCat("expected ", (signs + 31) / 32,
                                                  " words a rank for ", signs,
                                                  " signs, got ", width)));
    OP_REQUIRES(context, ranks >= 1, InvalidArgumentError("no ranks"));
    Tensor* average = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({n}), &average));
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(words.flat<int32_t>().data());
    const float* scale = scales.flat<float>().data();
    float* out = average->flat<float>().data();
    const float divisor = static_cast<float>(ranks);
    auto* pool = context->device()->tensorflow_cpu_worker_threads();
    const int64_t shards = (signs + kShard - 1) / kShard;
    tensorflow::Shard(pool->num_threads, pool->workers, shards, kShard * (ranks + group_),
                      [&](int64_t first, int64_t last) {
                        SumWords(bits, width, ranks, scale, blocks, block_, divisor, out, n,
                                 signs, group_, first * kShard / 32,
                                 std::min(width, last * kShard / 32));
                      });
  }

 private:
  int64_t num_elements_ = 0;
  int64_t block_ = 0;
  int64_t group_ = 1;
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdSignSum").Device(tensorflow::DEVICE_CPU), SignSumOp);

REGISTER_OP("SparseHvdCompensateSign")
    .Attr("block: int = 0")
    .Input("gradient: float")  // [n]
    .Input("residual: float")  // [n]
    .Output("sent: float")     // [n]: +-scale
    .Output("remainder: float")  // [n]: c - sent
    .Output("finite: bool")      // every c was finite
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(0));
      c->set_output(2, c->Scalar());
      return tsl::OkStatus();
    });

// The sum of |g + r| over [begin, end), each c = g + r written to ``c``: in eight double
// lanes (entry i in lane i % 8, the lanes added in a fixed order at the end), so that the
// compiler can add several at once where one running sum would wait on each addition. A
// double holds the sum of 64 float magnitudes nearly exactly, so the order barely matters;
// it is fixed in the source, so every version of the loop gives the same bits.
SPARSE_HVD_INLINE double CompensatedMagnitudes(const float* __restrict g,
                                               const float* __restrict r, float* __restrict c,
                                               int64_t begin, int64_t end) {
  double lanes[8] = {0.0};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (int l = 0; l < 8; ++l) {
      c[i + l] = g[i + l] + r[i + l];
      lanes[l] += std::fabs(static_cast<double>(c[i + l]));
    }
  }
  for (; i < end; ++i) {
    c[i] = g[i] + r[i];
    lanes[(i - begin) & 7] += std::fabs(static_cast<double>(c[i]));
  }
  return SumOfEightLanes(lanes);
}

// A block's scale from the sum of its ``count`` magnitudes: their mean, rounded to float and,
// with ``block`` > 0, to bfloat16 (as the scales travel).
SPARSE_HVD_INLINE float BlockScale(double total, int64_t count, int64_t block) {
  const float scale = static_cast<float>(total / static_cast<double>(count));
  return block > 0 ? RoundedToBfloat16(scale) : scale;
}

// Step 1 for a variable of ``n`` entries in blocks of ``block`` (the whole of it for 0):
// writes the sent +-scale and the remainder (``c``); returns whether every c was finite (a
// block's sum of magnitudes in double is finite iff each of its entries is: it cannot
// overflow), so that the payload needs no pass of its own to find out.
SPARSE_HVD_VECTORISED
bool CompensateSigns(const float* __restrict g, const float* __restrict r,
                     float* __restrict s, float* __restrict c, int64_t n, int64_t block) {
  const int64_t size = block == 0 ? std::max<int64_t>(n, 1) : block;
  bool finite = true;
  for (int64_t begin = 0; begin < n; begin += size) {
    const int64_t end = std::min(n, begin + size);
    const double total = CompensatedMagnitudes(g, r, c, begin, end);
    finite = finite && std::isfinite(total);
    const float scale = BlockScale(total, end - begin, block);
    for (int64_t i = begin; i < end; ++i) {
      s[i] = c[i] < 0.0f ? -scale : scale;
      c[i] -= s[i];
    }
  }
  return finite;
}

// What both compensation ops share: the attribute ``block`` and the inputs' check.
class CompensateOpBase : public OpKernel {
 public:
  explicit CompensateOpBase(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("block", &block_));
    OP_REQUIRES_OK(context, CheckedBlock(block_));
  }

 protected:
  // Whether the gradient and the residual (inputs 0 and 1) are 1-D and alike; if not, the
  // context's status says so.
  static bool CheckedInputs(OpKernelContext* context) {
    const Tensor& gradient = context->input(0);
    const Tensor& residual = context->input(1);
    if (gradient.dims() == 1 && gradient.shape() == residual.shape()) return true;
    context->CtxFailure(InvalidArgumentError("gradient and residual must be 1-D and alike"));
    return false;
  }

  int64_t block_ = 0;
};

class CompensateSignOp : public CompensateOpBase {
 public:
  using CompensateOpBase::CompensateOpBase;

  void Compute(OpKernelContext* context) override {
    if (!CheckedInputs(context)) return;
    const Tensor& gradient = context->input(0);
    const Tensor& residual = context->input(1);
    const int64_t n = gradient.dim_size(0);
    Tensor* sent = nullptr;
    Tensor* remainder = nullptr;
    Tensor* finite = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, gradient.shape(), &sent));
    OP_REQUIRES_OK(context, context->allocate_output(1, gradient.shape(), &remainder));
    OP_REQUIRES_OK(context, context->allocate_output(2, TensorShape({}), &finite));
    finite->scalar<bool>()() = CompensateSigns(
        gradient.flat<float>().data(), residual.flat<float>().data(),
        sent->flat<float>().data(), remainder->flat<float>().data(), n, block_);
  }
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdCompensateSign").Device(tensorflow::DEVICE_CPU),
                        CompensateSignOp);

REGISTER_OP("SparseHvdPackedCompensateSign")
    .Attr("block: int = 0")
    .Input("gradient: float")    // [n]
    .Input("residual: float")    // [n]
    .Output("words: int32")      // [(n + 31) / 32]: bit i set where sent i is negative
    .Output("scales: float")     // [blocks]: each block's largest |sent|
    .Output("remainder: float")  // [n]: c - sent
    .Output("finite: bool")      // every c was finite
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      int64_t block = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("block", &block));
      tensorflow::shape_inference::DimensionHandle n = c->Dim(c->input(0), 0);
      if (c->ValueKnown(n)) {
        c->set_output(0, c->Vector((c->Value(n) + 31) / 32));
        c->set_output(1, c->Vector(BlocksOf(c->Value(n), block)));
      } else {
        c->set_output(0, c->Vector(c->UnknownDim()));
        c->set_output(1, c->Vector(block == 0 ? c->MakeDim(1) : c->UnknownDim()));
      }
      c->set_output(2, c->input(0));
      c->set_output(3, c->Scalar());
      return tsl::OkStatus();
    });

// CompensateSigns with the signs packed as they are made: per block, c and the sum of |c|
// (the same lanes), its scale, then per word of 32 entries the sent sign's bit (``sent < 0``,
// SignPack's test) and the remainder c - sent. A block is whole words (block is a multiple of
// 32, or the whole variable), so each word is written once, in one block.
SPARSE_HVD_VECTORISED
bool PackedCompensateSigns(const float* __restrict g, const float* __restrict r,
                           uint32_t* __restrict words, float* __restrict scales,
                           float* __restrict c, int64_t n, int64_t block) {
  const int64_t size = block == 0 ? std::max<int64_t>(n, 1) : block;
  std::fill(scales, scales + BlocksOf(n, block), 0.0f);
  bool finite = true;
  for (int64_t begin = 0; begin < n; begin += size) {
    const int64_t end = std::min(n, begin + size);
    const double total = CompensatedMagnitudes(g, r, c, begin, end);
    finite = finite && std::isfinite(total);
    const float scale = BlockScale(total, end - begin, block);
    scales[begin / size] = std::max(0.0f, scale);  // std::max(0, NaN) is 0, as in PackWord
    for (int64_t word = begin; word < end; word += 32) {
      const int64_t count = std::min<int64_t>(32, end - word);
      uint32_t bits = 0;
      for (int64_t b = 0; b < count; ++b) {
        const float sent = c[word + b] < 0.0f ? -scale : scale;
        bits |= static_cast<uint32_t>(sent < 0.0f) << b;
        c[word + b] -= sent;
      }
      words[word / 32] = bits;
    }
  }
  return finite;
}

class PackedCompensateSignOp : public CompensateOpBase {
 public:
  using CompensateOpBase::CompensateOpBase;

  void Compute(OpKernelContext* context) override {
    if (!CheckedInputs(context)) return;
    const Tensor& gradient = context->input(0);
    const Tensor& residual = context->input(1);
    const int64_t n = gradient.dim_size(0);
    Tensor* words = nullptr;
    Tensor* scales = nullptr;
    Tensor* remainder = nullptr;
    Tensor* finite = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({(n + 31) / 32}), &words));
    OP_REQUIRES_OK(context,
                   context->allocate_output(1, TensorShape({BlocksOf(n, block_)}), &scales));
    OP_REQUIRES_OK(context, context->allocate_output(2, gradient.shape(), &remainder));
    OP_REQUIRES_OK(context, context->allocate_output(3, TensorShape({}), &finite));
    finite->scalar<bool>()() = PackedCompensateSigns(
        gradient.flat<float>().data(), residual.flat<float>().data(),
        reinterpret_cast<uint32_t*>(words->flat<int32_t>().data()), scales->flat<float>().data(),
        remainder->flat<float>().data(), n, block_);
  }
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdPackedCompensateSign").Device(tensorflow::DEVICE_CPU),
                        PackedCompensateSignOp);

REGISTER_OP("SparseHvdSignPack")
    .Attr("block: int = 0")
    .Attr("stride: int >= 1 = 1")
    .Input("values: float")   // [n]: one rank's scaled signs of a variable
    .Output("words: int32")   // [(m + 31) / 32], m = ceil(n / stride) values packed
    .Output("scales: float")  // [blocks of m]: each block's largest |value|
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      int64_t block = 0, stride = 1;
      TF_RETURN_IF_ERROR(c->GetAttr("block", &block));
      TF_RETURN_IF_ERROR(c->GetAttr("stride", &stride));
      tensorflow::shape_inference::DimensionHandle n = c->Dim(c->input(0), 0);
      if (c->ValueKnown(n)) {
        const int64_t packed = (c->Value(n) + stride - 1) / stride;
        c->set_output(0, c->Vector((packed + 31) / 32));
        c->set_output(1, c->Vector(BlocksOf(packed, block)));
      } else {
        c->set_output(0, c->Vector(c->UnknownDim()));
        c->set_output(1, c->Vector(block == 0 ? c->MakeDim(1) : c->UnknownDim()));
      }
      return tsl::OkStatus();
    });

// The sign bits of 32 values, and ``scale`` raised to their largest |value| (in eight lanes
// the compiler can compare at once; a maximum is exact in any order).
SPARSE_HVD_INLINE uint32_t PackWord(const float* __restrict values, float& scale) {
  uint32_t bits = 0;
  float lanes[8] = {scale, scale, scale, scale, scale, scale, scale, scale};
  for (int64_t b = 0; b < 32; ++b) bits |= static_cast<uint32_t>(values[b] < 0.0f) << b;
  for (int64_t b = 0; b < 32; b += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] = std::max(lanes[l], std::fabs(values[b + l]));
  }
  for (int l = 0; l < 8; ++l) scale = std::max(scale, lanes[l]);
  return bits;
}

// Step 2 for a variable of ``n`` entries: the sign bits of each word, and each block's
// largest |value|.
SPARSE_HVD_VECTORISED
void PackSigns(const float* __restrict in, int64_t n, int64_t block, uint32_t* __restrict out,
               float* __restrict largest) {
  const int64_t blocks = BlocksOf(n, block), width = (n + 31) / 32;
  std::fill(largest, largest + blocks, 0.0f);
  for (int64_t word = 0; word < width; ++word) {
    const int64_t begin = word * 32, count = std::min<int64_t>(32, n - begin);
    float& scale = largest[block == 0 ? 0 : begin / block];  // a word is in one block
    if (count == 32) {
      out[word] = PackWord(in + begin, scale);
      continue;
    }
    alignas(64) float last[32] = {0.0f};  // the last word, its missing values +0 (no bit,
    std::copy(in + begin, in + n, last);   // no magnitude), like the strided pack's
    out[word] = PackWord(last, scale);
  }
}

// PackSigns for values 0, stride, 2 x stride, ... of ``in`` (``n`` entries): ``packed`` =
// ceil(n / stride) of them (a last word's missing values count as +0: no bit, no magnitude).
SPARSE_HVD_VECTORISED
void PackStridedSigns(const float* __restrict in, int64_t n, int64_t stride, int64_t block,
                      uint32_t* __restrict out, float* __restrict largest) {
  const int64_t packed = (n + stride - 1) / stride, width = (packed + 31) / 32;
  std::fill(largest, largest + BlocksOf(packed, block), 0.0f);
  for (int64_t word = 0; word < width; ++word) {
    const int64_t begin = word * 32, count = std::min<int64_t>(32, packed - begin);
    float& scale = largest[block == 0 ? 0 : begin / block];
    alignas(64) float picked[32] = {0.0f};  // the word's values, gathered so that the
    for (int64_t b = 0; b < count; ++b) picked[b] = in[(begin + b) * stride];  // rest vectorises
    out[word] = PackWord(picked, scale);
  }
}

class SignPackOp : public OpKernel {
 public:
  explicit SignPackOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("block", &block_));
    OP_REQUIRES_OK(context, CheckedBlock(block_));
    OP_REQUIRES_OK(context, context->GetAttr("stride", &stride_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& values = context->input(0);
    OP_REQUIRES(context, values.dims() == 1, InvalidArgumentError("values must be 1-D"));
    const int64_t n = values.dim_size(0), packed = (n + stride_ - 1) / stride_;
    const int64_t width = (packed + 31) / 32, blocks = BlocksOf(packed, block_);
    Tensor* words = nullptr;
    Tensor* scales = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({width}), &words));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({blocks}), &scales));
    uint32_t* out = reinterpret_cast<uint32_t*>(words->flat<int32_t>().data());
    if (stride_ == 1) {
      PackSigns(values.flat<float>().data(), n, block_, out, scales->flat<float>().data());
    } else {
      PackStridedSigns(values.flat<float>().data(), n, stride_, block_, out,
                       scales->flat<float>().data());
    }
  }

 private:
  int64_t block_ = 0;
  int64_t stride_ = 1;
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdSignPack").Device(tensorflow::DEVICE_CPU), SignPackOp);

}  // namespace sparse_hvd
