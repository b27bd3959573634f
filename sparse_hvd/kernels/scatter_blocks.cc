// SparseHvdScatterBlocks: the sparse allreduce's step 2 (sparse_hvd/exchanges/sparse_allreduce.py)
// in one op: this rank's entries (global index, value) split among the owners of the index
// space's regions, each owner's block coded as sparse_hvd/exchanges/sparse_blocks.py's
// CodedBlocks codes it, the blocks one after another, with the words each one takes. The same
// words, bit for bit, as that module's TensorFlow ops (a search for the owners, two
// partitions, per owner the index code, a cast, the value code and two concatenations, then
// one concatenation of the blocks: 184 operations fewer in the wide CNN's step at 4 ranks). At
// 5% density and 4 ranks the search, partitions and coders it replaces took about 6 ms of op
// time a step, this op 4.9-6.0 ms; with the owners on the pool's threads it took 8.3 ms (its
// shards wait for threads the other ranks hold on 2 cores), so they are coded in turn.
//
//   1. owners: the owner of index i is the r with boundaries[r] <= i < boundaries[r + 1] (the
//      first and last owners also take what lies below and above the space; an empty region
//      owns nothing). Entries ascending by index (as the selections arrive) fall into
//      contiguous runs, found by binary search; others are split in one stable counting pass;
//   2. per owner r, its positions i - boundaries[r] Elias-Fano coded among the region's
//      boundaries[r + 1] - boundaries[r] (index_codec.cc; an error names a position that
//      repeats or falls outside), and its values in the code's order Rice coded (value_codec.cc)
//      or, float64, as their raw words;
//   3. block r: [count, W, the bitmap's bits, 2 base + zero flag | index words | value words]
//      ([count, 0, 0, 0 | ...] for float64); ``splits[r]``: its words.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "codecs.h"
#include "block_format.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

REGISTER_OP("SparseHvdScatterBlocks")
    .Input("indices: int32")
    .Input("values: T")
    .Input("boundaries: int64")
    .Output("blocks: int32")
    .Output("splits: int32")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return tsl::OkStatus();
    });

namespace {

// One owner's block before it is written: its entries' positions and the order that sorts
// them, its values' bits in that order, and what the value code planned.
struct Block {
  std::vector<int64_t> positions;
  std::vector<int32_t> order;
  std::vector<uint32_t> raw;
  int64_t fields[3] = {0, 0, 0};  // W, the bitmap's bits, 2 base + zero flag
  int64_t index_words = 0, value_words = 0;
};

}  // namespace

template <typename T>
class ScatterBlocksOp : public OpKernel {
 public:
  explicit ScatterBlocksOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& indices_tensor = context->input(0);
    const Tensor& values_tensor = context->input(1);
    const Tensor& boundaries_tensor = context->input(2);
    const int64_t count = indices_tensor.NumElements();
    OP_REQUIRES(context, indices_tensor.dims() == 1 && values_tensor.dims() == 1 &&
                             values_tensor.NumElements() == count,
                InvalidArgumentError(absl::StrCat("indices and values must be 1-D and alike "
                                                  "in length: ", count, " indices, ",
                                                  values_tensor.NumElements(), " values")));
    OP_REQUIRES(context, boundaries_tensor.dims() == 1 && boundaries_tensor.NumElements() >= 2,
                InvalidArgumentError("boundaries must be 1-D: the owners' regions' cut "
                                     "points, the first and the last included"));
    const auto bounds = boundaries_tensor.flat<int64_t>();
    const int64_t owners = bounds.size() - 1;
    for (int64_t r = 0; r < owners; ++r)
      OP_REQUIRES(context, bounds(r) <= bounds(r + 1),
                  InvalidArgumentError(absl::StrCat("boundaries must not decrease: ",
                                                    bounds(r), " then ", bounds(r + 1))));
    const int32_t* indices = indices_tensor.flat<int32_t>().data();
    const T* values = values_tensor.flat<T>().data();
    const int64_t* inner = bounds.data() + 1;  // the cut points between the owners

    // Step 1
    std::vector<Block> blocks(owners);
    bool ascending = true;
    for (int64_t i = 1; i < count && ascending; ++i) ascending = indices[i - 1] < indices[i];
    auto owner_of = [&](int64_t index) {
      return std::upper_bound(inner, inner + owners - 1, index) - inner;
    };
    std::vector<int64_t> begin(owners + 1, 0);
    std::vector<int64_t> taken;  // the entries owner by owner, each owner's in their order
    if (ascending) {
      for (int64_t r = 0; r + 1 < owners; ++r)
        begin[r + 1] = std::lower_bound(indices + begin[r], indices + count, inner[r],
                                        [](int32_t a, int64_t b) { return a < b; }) - indices;
      begin[owners] = count;
    } else {
      std::vector<int64_t> owner(count);
      for (int64_t i = 0; i < count; ++i) ++begin[(owner[i] = owner_of(indices[i])) + 1];
      for (int64_t r = 0; r < owners; ++r) begin[r + 1] += begin[r];
      taken.resize(count);
      std::vector<int64_t> next(begin.begin(), begin.end() - 1);
      for (int64_t i = 0; i < count; ++i) taken[next[owner[i]]++] = i;
    }
    auto entry = [&](int64_t j) { return ascending ? j : taken[j]; };

    // Step 2: each owner's code planned (its words known before anything is written)
    std::vector<codecs::ValueEncoder> encoders;
    int64_t total = 0;
    for (int64_t r = 0; r < owners; ++r) {
      Block& block = blocks[r];
      const int64_t n = begin[r + 1] - begin[r];
      const int64_t start = bounds(r), space = bounds(r + 1) - bounds(r);
      block.positions.resize(n);
      block.order.resize(n);
      for (int64_t j = 0; j < n; ++j)
        block.positions[j] = static_cast<int64_t>(indices[entry(begin[r] + j)]) - start;
      bool sorted;
      OP_REQUIRES_OK(context, codecs::SortedOrder(block.positions.data(), n, space,
                                                  block.order.data(), &sorted));
      const auto [low_words, bitmap_words] = codecs::PositionWords(n, space);
      block.index_words = low_words + bitmap_words;
      block.raw.resize(n * (Bits<T>::kCoded ? 1 : sizeof(T) / 4));
      if constexpr (Bits<T>::kCoded) {
        for (int64_t j = 0; j < n; ++j)
          block.raw[j] = Bits<T>::Raw(values[entry(begin[r] + block.order[j])]);
        codecs::ValueEncoder encoder(Bits<T>::Layout());
        const int32_t counts[1] = {static_cast<int32_t>(n)};
        block.value_words = encoder.Plan(block.raw.data(), counts, 1, block.fields);
        encoders.push_back(std::move(encoder));
      } else {
        for (int64_t j = 0; j < n; ++j)
          std::memcpy(&block.raw[j * sizeof(T) / 4], &values[entry(begin[r] + block.order[j])],
                      sizeof(T));
        block.value_words = static_cast<int64_t>(block.raw.size());
      }
      total += kBlockHeader + block.index_words + block.value_words;
    }

    // Step 3
    Tensor* out_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({total}), &out_tensor));
    Tensor* splits_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({owners}), &splits_tensor));
    auto splits = splits_tensor->flat<int32_t>();
    uint32_t* out = reinterpret_cast<uint32_t*>(out_tensor->flat<int32_t>().data());
    for (int64_t r = 0; r < owners; ++r) {
      const Block& block = blocks[r];
      const int64_t n = static_cast<int64_t>(block.positions.size());
      const int32_t header[kBlockHeader] = {
          static_cast<int32_t>(n), static_cast<int32_t>(block.fields[0]),
          static_cast<int32_t>(block.fields[1]), static_cast<int32_t>(block.fields[2])};
      std::memcpy(out, header, sizeof(header));
      codecs::WritePositions(block.positions.data(), block.order.data(), n,
                             bounds(r + 1) - bounds(r), out + kBlockHeader);
      uint32_t* value_out = out + kBlockHeader + block.index_words;
      if constexpr (Bits<T>::kCoded) {
        encoders[r].Write(block.raw.data(), value_out);
      } else {
        std::copy(block.raw.begin(), block.raw.end(), value_out);
      }
      splits(r) = static_cast<int32_t>(kBlockHeader + block.index_words + block.value_words);
      out += splits(r);
    }
  }
};

#define REGISTER(T)                                                                         \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name("SparseHvdScatterBlocks").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      ScatterBlocksOp<T>)
REGISTER(Eigen::half);
REGISTER(tensorflow::bfloat16);
REGISTER(float);
REGISTER(double);
#undef REGISTER

}  // namespace sparse_hvd
