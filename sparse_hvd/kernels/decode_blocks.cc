// SparseHvdDecodeScatter / SparseHvdDecodeGather: the sparse allreduce's unpacking of every
// rank's coded blocks (sparse_hvd/exchanges/sparse_blocks.py's CodedBlocks; block_format.h) in
// one op each. TensorFlow ops found each block's words (its header, the codes' closed-form
// lengths, ranges and gathers) before the decoding ops ran, and the gather's did so owner by
// owner: about 30 operations a rank of each traced step, run every step.
//
//   * SparseHvdDecodeScatter: what an owner received, ``block_words[r]`` words from rank r,
//     each block [header | positions | values] coded among the owner's region [start, start +
//     length); a rank that sent no words (one that is not training) sent no entries;
//   * SparseHvdDecodeGather: every owner's kept sums, block r [positions | values] coded among
//     owner r's region [boundaries[r], boundaries[r + 1]), its header ``fields[r]`` from the
//     gather's headers.
//
// Both: 1. each block's header checked and its words located (their count must be what the
// header says, to the word); 2. every block decoded (one thread per group of blocks), its
// positions ascending within its region. Outputs, block after block: the global indices
// (int32: region start + position), the values (T; float64 raw), the entries per block. Words
// that do not hold what the headers say are an error that names the rank, never a wrong value.

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"
#include "block_format.h"
#include "codecs.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

static absl::Status DecodedBlocksShape(tensorflow::shape_inference::InferenceContext* c) {
  c->set_output(0, c->Vector(c->UnknownDim()));
  c->set_output(1, c->Vector(c->UnknownDim()));
  return tsl::OkStatus();
}

REGISTER_OP("SparseHvdDecodeScatter")
    .Input("words: int32")
    .Input("block_words: int32")
    .Input("start: int64")
    .Input("length: int64")
    .Output("indices: int32")
    .Output("values: T")
    .Output("counts: int32")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      TF_RETURN_IF_ERROR(DecodedBlocksShape(c));
      c->set_output(2, c->input(1));
      return tsl::OkStatus();
    });

REGISTER_OP("SparseHvdDecodeGather")
    .Input("words: int32")
    .Input("fields: int32")
    .Input("boundaries: int64")
    .Output("indices: int32")
    .Output("values: T")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn(DecodedBlocksShape);

namespace {

// One block, located (step 1): its header and region, where its codes' words lie and where
// its entries go in the outputs.
struct Located {
  int64_t count = 0, width = 0, unary = 0, base_field = 0;
  int64_t start = 0, length = 0;  // its region
  int64_t index_begin = 0, value_begin = 0, end = 0;  // in the words
  int64_t first = 0;  // its first entry in the outputs
};

// Step 1 for one block whose codes start at word ``begin`` of the words (its region already in
// ``b``): its header ``fields`` [count, W, bitmap bits, 2 base + zero flag] checked and kept,
// and where its positions' and its values' codes lie; an error where the header is not one.
template <typename T>
absl::Status Locate(const int64_t* fields, int64_t begin, int64_t rank, Located* b) {
  const int64_t count = fields[0], width = fields[1], unary = fields[2];
  if (count < 0 || count > b->length)
    return InvalidArgumentError(absl::StrCat("rank ", rank, "'s block says ", count,
                                             " entries among its region's ", b->length));
  const auto [low_words, bitmap_words] = codecs::PositionWords(count, b->length);
  int64_t value_words = count * static_cast<int64_t>(sizeof(T) / 4);  // raw float64
  if constexpr (Bits<T>::kCoded) {
    const codecs::Layout layout = Bits<T>::Layout();
    if (width < 0 || width > layout.exponent_bits || unary < count ||
        unary > count * ((int64_t{1} << layout.exponent_bits) + 1))
      return InvalidArgumentError(absl::StrCat("rank ", rank, "'s block header is not a value "
                                               "code's (width ", width, ", ", unary,
                                               " bitmap bits for ", count, " values)"));
    value_words = layout.BlockWords(count, width, unary);
  }
  b->count = count, b->width = width, b->unary = unary, b->base_field = fields[3];
  b->index_begin = begin;
  b->value_begin = begin + low_words + bitmap_words;
  b->end = b->value_begin + value_words;
  return absl::OkStatus();
}

// Step 2 for every located block into the outputs; false for a block whose words do not
// decode to ascending positions within its region or to values of its header (``bad``).
template <typename T>
void DecodeLocated(OpKernelContext* context, const uint32_t* in,
                   const std::vector<Located>& blocks, int32_t* indices, T* values,
                   std::vector<int64_t>* bad) {
  auto* pool = context->device()->tensorflow_cpu_worker_threads();
  tensorflow::Shard(
      pool->num_threads, pool->workers, static_cast<int64_t>(blocks.size()),
      /*cost_per_unit=*/1 << 16, [&](int64_t first, int64_t last) {
        std::vector<int64_t> positions;
        std::vector<uint32_t> codes, raw;
        for (int64_t r = first; r < last; ++r) {
          const Located& b = blocks[r];
          if (b.count == 0) continue;
          positions.resize(b.count);
          bool good = codecs::ReadPositions(in + b.index_begin, in + b.value_begin, b.count,
                                            b.length, positions.data());
          for (int64_t i = 0; good && i < b.count; ++i)
            good = positions[i] < b.length && (i == 0 || positions[i - 1] < positions[i]);
          if (!good) {
            (*bad)[r] = 1;
            continue;
          }
          int32_t* out_indices = indices + b.first;
          for (int64_t i = 0; i < b.count; ++i)
            out_indices[i] = static_cast<int32_t>(b.start + positions[i]);
          T* out_values = values + b.first;
          if constexpr (Bits<T>::kCoded) {
            const int32_t count[1] = {static_cast<int32_t>(b.count)};
            raw.resize(b.count);
            if (!codecs::ReadValues(Bits<T>::Layout(), in + b.value_begin, in + b.end, count, 1,
                                    static_cast<int>(b.width), &b.base_field, &codes,
                                    raw.data())) {
              (*bad)[r] = 2;
              continue;
            }
            for (int64_t i = 0; i < b.count; ++i) out_values[i] = Bits<T>::FromRaw(raw[i]);
          } else {
            std::memcpy(out_values, in + b.value_begin, b.count * sizeof(T));
          }
        }
      });
}

// Step 2 and the outputs, once step 1 located the blocks (``total`` entries in all).
template <typename T>
void Decode(OpKernelContext* context, const Tensor& words, const std::vector<Located>& blocks,
            int64_t total) {
  Tensor* indices = nullptr;
  Tensor* values = nullptr;
  OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({total}), &indices));
  OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({total}), &values));
  std::vector<int64_t> bad(blocks.size(), 0);
  DecodeLocated<T>(context, reinterpret_cast<const uint32_t*>(words.flat<int32_t>().data()),
                   blocks, indices->flat<int32_t>().data(), values->flat<T>().data(), &bad);
  for (size_t r = 0; r < blocks.size(); ++r) {
    OP_REQUIRES(context, bad[r] == 0,
                InvalidArgumentError(absl::StrCat(
                    "rank ", r, "'s block does not decode to ",
                    bad[r] == 1 ? absl::StrCat("ascending positions within its region of ",
                                               blocks[r].length)
                                : std::string("the values its header says"))));
  }
}

// A region's entries as int32 global indices: [start, start + length) within int32's range.
absl::Status CheckRegion(int64_t start, int64_t length) {
  if (start < 0 || length < 0 || start + length - 1 > std::numeric_limits<int32_t>::max())
    return InvalidArgumentError(absl::StrCat("the region [", start, ", ", start + length,
                                             ") is not one of int32 indices"));
  return absl::OkStatus();
}

}  // namespace

template <typename T>
class DecodeScatterOp : public OpKernel {
 public:
  explicit DecodeScatterOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& words = context->input(0);
    const auto block_words = context->input(1).flat<int32_t>();
    const int64_t start = context->input(2).scalar<int64_t>()();
    const int64_t length = context->input(3).scalar<int64_t>()();
    OP_REQUIRES_OK(context, CheckRegion(start, length));
    const int32_t* in = words.flat<int32_t>().data();
    const int64_t ranks = block_words.size();
    // Step 1: each rank's block, one after another, [header | positions | values]
    std::vector<Located> blocks(ranks);
    Tensor* counts = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(2, TensorShape({ranks}), &counts));
    int64_t at = 0, total = 0;
    for (int64_t r = 0; r < ranks; ++r) {
      Located& b = blocks[r];
      b.start = start;
      b.length = length;
      b.index_begin = b.value_begin = b.end = at;
      b.first = total;
      const int64_t sent = block_words(r);
      OP_REQUIRES(context, sent >= 0 && at + sent <= words.NumElements(),
                  InvalidArgumentError(absl::StrCat("rank ", r, "'s block of ", sent,
                                                    " words lies outside the ",
                                                    words.NumElements(), " received")));
      if (sent > 0) {  // else a rank that is not training: no entries
        OP_REQUIRES(context, sent >= kBlockHeader,
                    InvalidArgumentError(absl::StrCat("rank ", r, "'s block of ", sent,
                                                      " words has no header")));
        const int64_t fields[kBlockHeader] = {in[at], in[at + 1], in[at + 2], in[at + 3]};
        OP_REQUIRES_OK(context, Locate<T>(fields, at + kBlockHeader, r, &b));
        OP_REQUIRES(context, b.end == at + sent,
                    InvalidArgumentError(absl::StrCat("rank ", r, "'s block header says ",
                                                      b.end - at, " words, ", sent,
                                                      " arrived")));
      }
      at += sent;
      total += b.count;
      counts->flat<int32_t>()(r) = static_cast<int32_t>(b.count);
    }
    OP_REQUIRES(context, at == words.NumElements(),
                InvalidArgumentError(absl::StrCat("the blocks take ", at, " words, ",
                                                  words.NumElements(), " arrived")));
    Decode<T>(context, words, blocks, total);
  }
};

template <typename T>
class DecodeGatherOp : public OpKernel {
 public:
  explicit DecodeGatherOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& words = context->input(0);
    const Tensor& fields_tensor = context->input(1);
    const auto bounds = context->input(2).flat<int64_t>();
    OP_REQUIRES(context, fields_tensor.dims() == 2 && fields_tensor.dim_size(1) == kBlockHeader &&
                             bounds.size() == fields_tensor.dim_size(0) + 1,
                InvalidArgumentError(absl::StrCat(
                    "fields must be [ranks, ", kBlockHeader, "] and boundaries [ranks + 1]")));
    const auto fields = fields_tensor.matrix<int32_t>();
    const int64_t ranks = fields_tensor.dim_size(0);
    // Step 1: owner r's block [positions | values] among its region, one after another
    std::vector<Located> blocks(ranks);
    int64_t at = 0, total = 0;
    for (int64_t r = 0; r < ranks; ++r) {
      Located& b = blocks[r];
      b.start = bounds(r);
      b.length = bounds(r + 1) - bounds(r);
      OP_REQUIRES_OK(context, CheckRegion(b.start, b.length));
      const int64_t header[kBlockHeader] = {fields(r, 0), fields(r, 1), fields(r, 2),
                                            fields(r, 3)};
      OP_REQUIRES_OK(context, Locate<T>(header, at, r, &b));
      b.first = total;
      at = b.end;
      total += b.count;
    }
    OP_REQUIRES(context, at == words.NumElements(),
                InvalidArgumentError(absl::StrCat("the blocks' headers add up to ", at,
                                                  " words, ", words.NumElements(),
                                                  " arrived")));
    Decode<T>(context, words, blocks, total);
  }
};

#define REGISTER(T)                                                                         \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name("SparseHvdDecodeScatter").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      DecodeScatterOp<T>)                                                                   \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name("SparseHvdDecodeGather").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),  \
      DecodeGatherOp<T>)
REGISTER(Eigen::half);
REGISTER(tensorflow::bfloat16);
REGISTER(float);
REGISTER(double);
#undef REGISTER

}  // namespace sparse_hvd
