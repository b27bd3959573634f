// SparseHvdEncodePositions / SparseHvdDecodePositions: sparse_hvd/exchanges/index_coding.py's
// Elias-Fano code in one pass each way, with the same words, bit for bit, as its TensorFlow ops.
//
// Encoding one rank's K distinct ``positions`` in [0, space), in any order:
//
//   1. ``order``: the permutation that sorts them (the identity, found in one pass, when they
//      arrive sorted, as a threshold selection sends them); L = floor(log2(space / K));
//   2. the L low bits of each sorted position, packed 32 to an int32 word, little-endian;
//   3. a bitmap of K + (space >> L) + 1 bits with bit (x_i >> L) + i set, from a fresh word.
//
// ``SparseHvdEncodeEntries`` codes the positions the same way and hands back their values in
// that order: the input itself when the positions arrive sorted (no copy; the sparse
// allreduce's blocks, whose TensorFlow gather of the values in the code's order was an
// identity copy of 1-3 ms a step at 5% density and 4 workers).
//
// Decoding reads every rank's block (one thread per group of ranks): rank r sent
// ``counts[r, v]`` positions of variable v, whose entries start at ``starts[v]`` of the space;
// each comes back as an int32 index within its variable, rank after rank. Positions that
// repeat, fall outside the space or outside their variable's range are an error that says so.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "bit_stream.h"
#include "codecs.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using bit_stream::BitReader;
using bit_stream::BitWriter;
using bit_stream::WordsFor;

REGISTER_OP("SparseHvdEncodePositions")
    .Input("positions: int64")
    .Input("space: int64")
    .Output("words: int32")
    .Output("order: int32")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->input(0));
      return tsl::OkStatus();
    });

REGISTER_OP("SparseHvdEncodeEntries")
    .Input("positions: int64")
    .Input("values: T")
    .Input("space: int64")
    .Output("words: int32")
    .Output("values_in_order: T")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      tensorflow::shape_inference::ShapeHandle shape;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &shape));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, shape);
      return tsl::OkStatus();
    });

REGISTER_OP("SparseHvdDecodePositions")
    .Input("words: int32")
    .Input("counts: int32")
    .Input("starts: int64")
    .Input("space: int64")
    .Output("indices: int32")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return tsl::OkStatus();
    });

namespace codecs {

int LowBits(int64_t count, int64_t space) {
  const uint64_t quotient = static_cast<uint64_t>(space / std::max<int64_t>(count, 1));
  return quotient <= 1 ? 0 : 63 - __builtin_clzll(quotient);
}

std::pair<int64_t, int64_t> PositionWords(int64_t count, int64_t space) {
  if (count == 0) return {0, 0};
  const int low = LowBits(count, space);
  return {WordsFor(count * low), WordsFor(count + (space >> low) + 1)};
}

absl::Status SortedOrder(const int64_t* positions, int64_t count, int64_t space, int32_t* order,
                         bool* sorted) {
  std::iota(order, order + count, 0);
  *sorted = true;
  for (int64_t i = 1; i < count && *sorted; ++i) *sorted = positions[i - 1] < positions[i];
  if (!*sorted)
    std::sort(order, order + count,
              [&](int32_t a, int32_t b) { return positions[a] < positions[b]; });
  for (int64_t i = 0; i < count; ++i) {
    const int64_t x = positions[order[i]];
    if (x < 0 || x >= space)
      return InvalidArgumentError(absl::StrCat("position ", x, " is outside [0, ", space, ")"));
    if (i > 0 && positions[order[i - 1]] >= x)
      return InvalidArgumentError(absl::StrCat("position ", x, " is sent twice"));
  }
  return absl::OkStatus();
}

void WritePositions(const int64_t* positions, const int32_t* order, int64_t count,
                    int64_t space, uint32_t* out) {
  const int low = count == 0 ? 0 : LowBits(count, space);
  const auto [low_words, bitmap_words] = PositionWords(count, space);
  std::fill(out, out + low_words + bitmap_words, 0u);
  // Step 2
  const uint64_t mask = (uint64_t{1} << low) - 1;
  BitWriter writer(out);
  for (int64_t i = 0; i < count; ++i)
    writer.Put(static_cast<uint64_t>(positions[order[i]]) & mask, low);
  writer.Flush();
  // Step 3
  uint32_t* bitmap = out + low_words;
  for (int64_t i = 0; i < count; ++i)
    bit_stream::SetBit(bitmap, (positions[order[i]] >> low) + i);
}

bool ReadPositions(const uint32_t* words, const uint32_t* end, int64_t count, int64_t space,
                   int64_t* positions) {
  if (count == 0) return true;
  const int low = LowBits(count, space);
  const uint32_t* bitmap = words + PositionWords(count, space).first;
  if (bitmap > end) return false;
  // the low halves, then the high halves: the i-th set bit of the bitmap is at high_i + i, so
  // high_i is the number of 0 bits before it
  BitReader low_reader(words, bitmap);
  BitReader high_reader(bitmap, end);
  int64_t high = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t zeros = high_reader.Unary();
    if (zeros < 0) return false;
    high += zeros;
    positions[i] = (high << low) | static_cast<int64_t>(low_reader.Get(low));
  }
  return true;
}

}  // namespace codecs

// Steps 1-3 for ``count`` positions into output 0 of ``context``: ``order`` (``count``
// entries) becomes the permutation that sorts them; false (the context's status set) when a
// position is outside the space or repeats. ``sorted``: whether they arrived sorted.
static bool EncodeInto(OpKernelContext* context, const int64_t* positions, int64_t count,
                       int64_t space, int32_t* order, bool* sorted) {
  const auto status = codecs::SortedOrder(positions, count, space, order, sorted);
  if (!status.ok()) {
    context->CtxFailure(status);
    return false;
  }
  const auto [low_words, bitmap_words] = codecs::PositionWords(count, space);
  Tensor* words_tensor = nullptr;
  const auto allocated = context->allocate_output(0, TensorShape({low_words + bitmap_words}),
                                                  &words_tensor);
  if (!allocated.ok()) {
    context->CtxFailure(allocated);
    return false;
  }
  codecs::WritePositions(positions, order, count, space,
                         reinterpret_cast<uint32_t*>(words_tensor->flat<int32_t>().data()));
  return true;
}

class EncodePositionsOp : public OpKernel {
 public:
  explicit EncodePositionsOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& positions = context->input(0);
    const int64_t space = context->input(1).scalar<int64_t>()();
    Tensor* order = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, positions.shape(), &order));
    bool sorted;
    EncodeInto(context, positions.flat<int64_t>().data(), positions.NumElements(), space,
               order->flat<int32_t>().data(), &sorted);
  }
};

template <typename T>
class EncodeEntriesOp : public OpKernel {
 public:
  explicit EncodeEntriesOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& positions = context->input(0);
    const Tensor& values = context->input(1);
    const int64_t space = context->input(2).scalar<int64_t>()();
    const int64_t count = positions.NumElements();
    OP_REQUIRES(context, positions.dims() == 1 && values.dims() == 1 &&
                             values.NumElements() == count,
                InvalidArgumentError(absl::StrCat("positions and values must be 1-D and "
                                                  "alike in length: ", count, " positions, ",
                                                  values.NumElements(), " values")));
    std::vector<int32_t> order(count);
    bool sorted;
    if (!EncodeInto(context, positions.flat<int64_t>().data(), count, space, order.data(),
                    &sorted))
      return;
    if (sorted) {
      context->set_output(1, values);
      return;
    }
    Tensor* in_order = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, values.shape(), &in_order));
    const T* given = values.flat<T>().data();
    T* out = in_order->flat<T>().data();
    for (int64_t i = 0; i < count; ++i) out[i] = given[order[i]];
  }
};

class DecodePositionsOp : public OpKernel {
 public:
  explicit DecodePositionsOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& words = context->input(0);
    const Tensor& counts_tensor = context->input(1);
    const auto starts = context->input(2).flat<int64_t>();
    const int64_t space = context->input(3).scalar<int64_t>()();
    OP_REQUIRES(context, counts_tensor.dims() == 2 &&
                             counts_tensor.dim_size(1) == starts.size(),
                InvalidArgumentError("counts must be [ranks, variables], starts [variables]"));
    const auto counts = counts_tensor.matrix<int32_t>();
    const int64_t ranks = counts_tensor.dim_size(0), variables = starts.size();
    std::vector<int64_t> word_start(ranks + 1, 0), start(ranks + 1, 0);
    for (int64_t r = 0; r < ranks; ++r) {
      int64_t count = 0;
      for (int64_t v = 0; v < variables; ++v) {
        OP_REQUIRES(context, counts(r, v) >= 0, InvalidArgumentError("a negative count"));
        count += counts(r, v);
      }
      OP_REQUIRES(context, count <= space,
                  InvalidArgumentError(absl::StrCat("rank ", r, " sent ", count,
                                                    " positions among ", space)));
      const auto [low_words, bitmap_words] = codecs::PositionWords(count, space);
      word_start[r + 1] = word_start[r] + low_words + bitmap_words;
      start[r + 1] = start[r] + count;
    }
    OP_REQUIRES(context, word_start[ranks] == words.NumElements(),
                InvalidArgumentError(absl::StrCat("the index codes of ", start[ranks],
                                                  " positions take ", word_start[ranks],
                                                  " words, ", words.NumElements(),
                                                  " arrived")));
    Tensor* indices_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({start[ranks]}),
                                                     &indices_tensor));
    int32_t* out = indices_tensor->flat<int32_t>().data();
    const uint32_t* in = reinterpret_cast<const uint32_t*>(words.flat<int32_t>().data());
    std::vector<int64_t> bad(ranks, 0);
    auto* pool = context->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(
        pool->num_threads, pool->workers, ranks, /*cost_per_unit=*/1 << 16,
        [&](int64_t first, int64_t last) {
          std::vector<int64_t> positions;
          for (int64_t r = first; r < last; ++r) {
            const int64_t count = start[r + 1] - start[r];
            if (count == 0) continue;
            positions.assign(count, 0);
            if (!codecs::ReadPositions(in + word_start[r], in + word_start[r + 1], count, space,
                                       positions.data())) {
              bad[r] = 1;
              continue;
            }
            // each variable's run of positions, as indices within it
            int32_t* indices = out + start[r];
            for (int64_t v = 0, j = 0; v < variables; ++v) {
              const int64_t begin = starts(v);
              const int64_t limit = v + 1 < variables ? starts(v + 1) : space;
              for (int64_t e = 0; e < counts(r, v); ++e, ++j) {
                const int64_t x = positions[j];
                if (x < begin || x >= limit || (j > 0 && x <= positions[j - 1])) bad[r] = 1;
                indices[j] = static_cast<int32_t>(x - begin);
              }
            }
          }
        });
    for (int64_t r = 0; r < ranks; ++r) {
      OP_REQUIRES(context, !bad[r],
                  InvalidArgumentError(absl::StrCat("rank ", r, "'s index code does not "
                                                    "decode to ascending positions within its "
                                                    "variables' ranges of [0, ", space, ")")));
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdEncodePositions").Device(tensorflow::DEVICE_CPU),
                        EncodePositionsOp);
REGISTER_KERNEL_BUILDER(Name("SparseHvdDecodePositions").Device(tensorflow::DEVICE_CPU),
                        DecodePositionsOp);
#define REGISTER(T)                                                                         \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name("SparseHvdEncodeEntries").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      EncodeEntriesOp<T>)
REGISTER(Eigen::half);
REGISTER(tensorflow::bfloat16);
REGISTER(float);
REGISTER(double);
#undef REGISTER

}  // namespace sparse_hvd
