// SparseHvdCompensateSign: error feedback's step for the scaled signs (step 1), in two passes:
// c = gradient + residual and the sum of |c| (in double, in index order), scale = that sum
// over n, rounded to float; then sent = -scale where c < 0, else scale, and the remainder
// c - sent. The TensorFlow path (``scaled_signs``) takes about five passes; its mean is
// float32's reduction, which may differ in the last bit: each rank sends its own scale, so
// replicas stay identical either way.
//
// SparseHvdSignPack: one rank's sign bits of a variable's scaled signs and their magnitude
// (sparse_hvd/exchanges/sign.py, step 2), in one pass: bit i of word i / 32 (little-endian)
// is set where value i is negative, and ``scale`` is the largest |value| (every value is
// +-scale; an exact maximum, in any order). The TensorFlow path takes several passes.
//
// SparseHvdSignSum: one variable's average from every rank's sign bits and scale
// (sparse_hvd/exchanges/sign.py, step 3), in one pass over the output.
//
// The TensorFlow path unpacks every rank's bits into a [ranks, n] tensor of +-1, multiplies
// each row by its rank's scale and adds the rows: several passes over ranks x n entries.
// Here each output entry is made once:
//
//   1. in shards of 64K entries on the CPU worker threads, entry i starts at 0.0f;
//   2. rank by rank, in rank order, it adds -scale[r] where bit i of rank r's words is set,
//      else scale[r] (the same additions, in the same order, as the TensorFlow path's
//      ``sum_rows_in_order``: the same bits);
//   3. it is divided by the number of ranks (IEEE division, as ``tf.math.divide_no_nan`` for
//      a divisor of 1 or more).
//
// Bits are little-endian: bit i is bit i % 32 of word i / 32.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

REGISTER_OP("SparseHvdSignSum")
    .Attr("num_elements: int >= 0")
    .Input("words: int32")   // [ranks, words]: each rank's sign bits
    .Input("scales: float")  // [ranks]: each rank's scale
    .Output("average: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      int64_t n = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("num_elements", &n));
      c->set_output(0, c->Vector(n));
      return tsl::OkStatus();
    });

constexpr int64_t kShard = 1 << 16;  // a multiple of 32: a shard starts at a word

// Steps 1-3 for the ``count`` (at most 32) entries of one word: ``bits`` is rank 0's word,
// rank r's is ``width`` words further on. Each entry is added up in a register and written
// once.
inline void SumWord(const uint32_t* bits, int64_t width, int64_t ranks, const float* scale,
                    float divisor, float* out, int64_t count) {
  alignas(64) float sums[32] = {0.0f};  // step 1
  alignas(64) uint32_t lanes[32];
  for (int64_t r = 0; r < ranks; ++r) {  // step 2, rank by rank
    const uint32_t word = bits[r * width];
    const float plus = scale[r], minus = -scale[r];
    // the word's bit b in lane b, by masks rather than shifts by b (plain SSE2 has no
    // per-lane shift), so that the compiler can add several lanes at once
    for (int b = 0; b < 32; ++b) lanes[b] = word & (1u << b);
    for (int b = 0; b < 32; ++b) sums[b] += lanes[b] ? minus : plus;
  }
  for (int64_t b = 0; b < count; ++b) out[b] = sums[b] / divisor;  // step 3
}

class SignSumOp : public OpKernel {
 public:
  explicit SignSumOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("num_elements", &num_elements_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& words = context->input(0);
    const Tensor& scales = context->input(1);
    OP_REQUIRES(context, words.dims() == 2 && scales.dims() == 1 &&
                             scales.dim_size(0) == words.dim_size(0),
                InvalidArgumentError("words must be [ranks, words] and scales [ranks]"));
    const int64_t ranks = words.dim_size(0), width = words.dim_size(1);
    const int64_t n = num_elements_;
    OP_REQUIRES(context, width == (n + 31) / 32,
                InvalidArgumentError(absl::StrCat("expected ", (n + 31) / 32,
                                                  " words a rank for ", n,
                                                  " entries, got ", width)));
    OP_REQUIRES(context, ranks >= 1, InvalidArgumentError("no ranks"));
    Tensor* average = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({n}), &average));
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(words.flat<int32_t>().data());
    const float* scale = scales.flat<float>().data();
    float* out = average->flat<float>().data();
    const float divisor = static_cast<float>(ranks);
    auto* pool = context->device()->tensorflow_cpu_worker_threads();
    const int64_t shards = (n + kShard - 1) / kShard;
    tensorflow::Shard(pool->num_threads, pool->workers, shards, kShard * ranks,
                      [&](int64_t first, int64_t last) {
                        const int64_t end = std::min(n, last * kShard);
                        for (int64_t word = first * kShard / 32; word * 32 < end; ++word) {
                          SumWord(bits + word, width, ranks, scale, divisor, out + word * 32,
                                  std::min<int64_t>(32, end - word * 32));
                        }
                      });
  }

 private:
  int64_t num_elements_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdSignSum").Device(tensorflow::DEVICE_CPU), SignSumOp);

REGISTER_OP("SparseHvdCompensateSign")
    .Input("gradient: float")  // [n]
    .Input("residual: float")  // [n]
    .Output("sent: float")     // [n]: +-scale
    .Output("remainder: float")  // [n]: c - sent
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(0));
      return tsl::OkStatus();
    });

class CompensateSignOp : public OpKernel {
 public:
  explicit CompensateSignOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& gradient = context->input(0);
    const Tensor& residual = context->input(1);
    OP_REQUIRES(context, gradient.dims() == 1 && gradient.shape() == residual.shape(),
                InvalidArgumentError("gradient and residual must be 1-D and alike"));
    const int64_t n = gradient.dim_size(0);
    Tensor* sent = nullptr;
    Tensor* remainder = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, gradient.shape(), &sent));
    OP_REQUIRES_OK(context, context->allocate_output(1, gradient.shape(), &remainder));
    const float* g = gradient.flat<float>().data();
    const float* r = residual.flat<float>().data();
    float* s = sent->flat<float>().data();
    float* c = remainder->flat<float>().data();  // holds c until the second pass
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      c[i] = g[i] + r[i];
      total += std::fabs(c[i]);
    }
    const float scale = n > 0 ? static_cast<float>(total / static_cast<double>(n)) : 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      s[i] = c[i] < 0.0f ? -scale : scale;
      c[i] -= s[i];
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdCompensateSign").Device(tensorflow::DEVICE_CPU),
                        CompensateSignOp);

REGISTER_OP("SparseHvdSignPack")
    .Input("values: float")  // [n]: one rank's scaled signs of a variable
    .Output("words: int32")  // [(n + 31) / 32]
    .Output("scale: float")  // the largest |value|
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      tensorflow::shape_inference::DimensionHandle n = c->Dim(c->input(0), 0);
      if (c->ValueKnown(n)) {
        c->set_output(0, c->Vector((c->Value(n) + 31) / 32));
      } else {
        c->set_output(0, c->Vector(c->UnknownDim()));
      }
      c->set_output(1, c->Scalar());
      return tsl::OkStatus();
    });

class SignPackOp : public OpKernel {
 public:
  explicit SignPackOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& values = context->input(0);
    OP_REQUIRES(context, values.dims() == 1, InvalidArgumentError("values must be 1-D"));
    const int64_t n = values.dim_size(0), width = (n + 31) / 32;
    Tensor* words = nullptr;
    Tensor* scale = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({width}), &words));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({}), &scale));
    const float* in = values.flat<float>().data();
    uint32_t* out = reinterpret_cast<uint32_t*>(words->flat<int32_t>().data());
    float largest = 0.0f;
    for (int64_t word = 0; word < width; ++word) {
      const int64_t begin = word * 32, count = std::min<int64_t>(32, n - begin);
      uint32_t bits = 0;
      for (int64_t b = 0; b < count; ++b) {
        const float value = in[begin + b];
        bits |= static_cast<uint32_t>(value < 0.0f) << b;
        largest = std::max(largest, std::fabs(value));
      }
      out[word] = bits;
    }
    scale->scalar<float>()() = largest;
  }
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdSignPack").Device(tensorflow::DEVICE_CPU), SignPackOp);

}  // namespace sparse_hvd
