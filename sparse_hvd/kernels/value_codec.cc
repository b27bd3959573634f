// SparseHvdEncodeValues / SparseHvdDecodeValues: sparse_hvd/exchanges/value_coding.py's code in
// one sequential pass each way, with the same words, bit for bit, as its TensorFlow ops.
//
// A value travels as its raw bits (``bits``: int32, a 16-bit value zero-extended), of which
// ``exponent_bits`` are the exponent, above ``mantissa = value_bits - 1 - exponent_bits``
// mantissa bits, below the sign. Encoding one rank's values (``counts[j]`` of variable j):
//
//   1. per variable, base = its least nonzero exponent, less one if it has an exponent 0;
//      code c = e - base, or 0 for exponent 0;
//   2. W = the first width in [0, exponent_bits] with the least K W + sum(c >> W) (from a
//      histogram of c);
//   3. the words: the sign-and-mantissa fields, the W low bits of each code, then c >> W in
//      unary (that many 0 bits, then a 1), each part from a fresh int32 word, bits numbered
//      little-endian; ``fields`` = [W, bitmap bits, 2 base + zero flag per variable].
//
// Decoding reads every rank's block (one thread per group of ranks) from ``counts`` [ranks,
// variables] and every rank's ``fields``. Words that do not hold what the fields say are an
// error, never a silent wrong value.

#include <algorithm>
#include <cstdint>
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
using codecs::Layout;

REGISTER_OP("SparseHvdEncodeValues")
    .Attr("value_bits: int")
    .Attr("exponent_bits: int")
    .Input("bits: int32")
    .Input("counts: int32")
    .Output("words: int32")
    .Output("fields: int64")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      tensorflow::shape_inference::DimensionHandle fields;
      TF_RETURN_IF_ERROR(c->Add(c->Dim(c->input(1), 0), 2, &fields));
      c->set_output(1, c->Vector(fields));
      return tsl::OkStatus();
    });

REGISTER_OP("SparseHvdDecodeValues")
    .Attr("value_bits: int")
    .Attr("exponent_bits: int")
    .Input("words: int32")
    .Input("counts: int32")
    .Input("fields: int64")
    .Output("bits: int32")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return tsl::OkStatus();
    });

namespace {

absl::Status ReadLayout(OpKernelConstruction* context, Layout* layout) {
  int value_bits = 0, exponent_bits = 0;
  TF_RETURN_IF_ERROR(context->GetAttr("value_bits", &value_bits));
  TF_RETURN_IF_ERROR(context->GetAttr("exponent_bits", &exponent_bits));
  if (!((value_bits == 32 || value_bits == 16) && exponent_bits > 0 && exponent_bits <= 8 &&
        exponent_bits < value_bits - 1))
    return InvalidArgumentError("value_bits must be 16 or 32, exponent_bits 1..8");
  *layout = Layout(value_bits, exponent_bits);
  return absl::OkStatus();
}

}  // namespace

namespace codecs {

int64_t ValueEncoder::Plan(const uint32_t* raw, const int32_t* counts, int64_t variables,
                           int64_t* fields) {
  const Layout& l = layout_;
  const uint32_t largest = (1u << l.exponent_bits) - 1;
  int64_t total = 0;
  for (int64_t v = 0; v < variables; ++v) total += counts[v];
  // Step 1: each variable's base, then the codes
  codes_.resize(total);
  std::vector<int64_t> histogram(largest + 1, 0);
  for (int64_t v = 0, start = 0; v < variables; start += counts[v], ++v) {
    uint32_t least = largest;
    bool zero = false;
    for (int64_t i = start; i < start + counts[v]; ++i) {
      const uint32_t e = l.Exponent(raw[i]);
      if (e == 0) zero = true;
      else least = std::min(least, e);
    }
    const uint32_t base = least - (zero ? 1 : 0);
    fields[2 + v] = 2 * static_cast<int64_t>(base) + (zero ? 1 : 0);
    for (int64_t i = start; i < start + counts[v]; ++i) {
      const uint32_t e = l.Exponent(raw[i]);
      codes_[i] = e == 0 ? 0 : e - base;
      ++histogram[codes_[i]];
    }
  }
  // Step 2
  int64_t best = -1;
  width_ = 0;
  for (int w = 0; w <= l.exponent_bits; ++w) {
    int64_t cost = total * w;
    for (uint32_t c = 0; c <= largest; ++c) cost += histogram[c] * (c >> w);
    if (best < 0 || cost < best) best = cost, width_ = w;
  }
  unary_ = total;
  for (int64_t i = 0; i < total; ++i) unary_ += codes_[i] >> width_;
  fields[0] = width_;
  fields[1] = unary_;
  return l.BlockWords(total, width_, unary_);
}

void ValueEncoder::Write(const uint32_t* raw, uint32_t* out) const {
  // Step 3
  const Layout& l = layout_;
  const int64_t total = static_cast<int64_t>(codes_.size());
  BitWriter writer(out);
  for (int64_t i = 0; i < total; ++i) writer.Put(l.Field(raw[i]), l.field);
  writer = BitWriter(writer.Flush());
  const uint32_t low_mask = (1u << width_) - 1;
  for (int64_t i = 0; i < total; ++i) writer.Put(codes_[i] & low_mask, static_cast<int>(width_));
  uint32_t* bitmap = writer.Flush();
  std::fill(bitmap, bitmap + WordsFor(unary_), 0u);
  int64_t place = 0;
  for (int64_t i = 0; i < total; ++i) {
    place += codes_[i] >> width_;
    bit_stream::SetBit(bitmap, place++);
  }
}

bool ReadValues(const Layout& l, const uint32_t* block, const uint32_t* end,
                const int32_t* counts, int64_t variables, int width,
                const int64_t* base_fields, std::vector<uint32_t>* codes, uint32_t* raw) {
  int64_t n = 0;
  for (int64_t v = 0; v < variables; ++v) n += counts[v];
  const uint32_t largest = (1u << l.exponent_bits) - 1;
  const uint32_t* lows = block + WordsFor(n * l.field);
  const uint32_t* bitmap = lows + WordsFor(n * width);
  if (bitmap > end) return false;
  BitReader low_reader(lows, bitmap);
  BitReader unary_reader(bitmap, end);
  codes->resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t quotient = unary_reader.Unary();
    const uint64_t code = (static_cast<uint64_t>(quotient) << width) | low_reader.Get(width);
    if (quotient < 0 || code > largest) return false;
    (*codes)[i] = static_cast<uint32_t>(code);
  }
  BitReader field_reader(block, lows);
  bool good = true;
  for (int64_t v = 0, i = 0; v < variables; ++v) {
    const int64_t base = base_fields[v] >> 1;
    const bool zero = base_fields[v] & 1;
    for (int64_t e = 0; e < counts[v]; ++e, ++i) {
      const uint32_t field = static_cast<uint32_t>(field_reader.Get(l.field));
      const int64_t exponent = (*codes)[i] == 0 && zero ? 0 : (*codes)[i] + base;
      good &= exponent >= 0 && exponent <= largest;
      raw[i] = l.Raw(field, static_cast<uint32_t>(exponent) & largest);
    }
  }
  return good;
}

}  // namespace codecs

class EncodeValuesOp : public OpKernel {
 public:
  explicit EncodeValuesOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, ReadLayout(context, &layout_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& bits = context->input(0);
    const Tensor& counts = context->input(1);
    const int64_t total = bits.NumElements();
    const int64_t variables = counts.NumElements();
    const auto count = counts.flat<int32_t>();
    const uint32_t* raw = reinterpret_cast<const uint32_t*>(bits.flat<int32_t>().data());
    int64_t sum = 0;
    for (int64_t v = 0; v < variables; ++v) {
      OP_REQUIRES(context, count(v) >= 0, InvalidArgumentError("a negative count"));
      sum += count(v);
    }
    OP_REQUIRES(context, sum == total,
                InvalidArgumentError(absl::StrCat("counts add up to ", sum, " values, ",
                                                  total, " given")));
    Tensor* fields_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({variables + 2}),
                                                     &fields_tensor));
    codecs::ValueEncoder encoder(layout_);
    const int64_t words = encoder.Plan(raw, count.data(), variables,
                                       fields_tensor->flat<int64_t>().data());
    Tensor* words_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({words}), &words_tensor));
    encoder.Write(raw, reinterpret_cast<uint32_t*>(words_tensor->flat<int32_t>().data()));
  }

 private:
  Layout layout_;
};

class DecodeValuesOp : public OpKernel {
 public:
  explicit DecodeValuesOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, ReadLayout(context, &layout_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& words = context->input(0);
    const Tensor& counts = context->input(1);
    const Tensor& fields_tensor = context->input(2);
    OP_REQUIRES(context, counts.dims() == 2 && fields_tensor.dims() == 2 &&
                             fields_tensor.dim_size(0) == counts.dim_size(0) &&
                             fields_tensor.dim_size(1) == counts.dim_size(1) + 2,
                InvalidArgumentError("counts must be [ranks, variables] and fields "
                                     "[ranks, variables + 2]"));
    const Layout& l = layout_;
    const int64_t ranks = counts.dim_size(0), variables = counts.dim_size(1);
    const auto count = counts.matrix<int32_t>();
    const auto fields = fields_tensor.matrix<int64_t>();
    std::vector<int64_t> word_start(ranks + 1, 0), value_start(ranks + 1, 0);
    for (int64_t r = 0; r < ranks; ++r) {
      int64_t n = 0;
      for (int64_t v = 0; v < variables; ++v) {
        OP_REQUIRES(context, count(r, v) >= 0, InvalidArgumentError("a negative count"));
        n += count(r, v);
      }
      const int64_t width = fields(r, 0), unary = fields(r, 1);
      OP_REQUIRES(context, width >= 0 && width <= l.exponent_bits && unary >= n &&
                               unary <= n * ((int64_t{1} << l.exponent_bits) + 1),
                  InvalidArgumentError(absl::StrCat("rank ", r, "'s header is not a value "
                                                    "code's (width ", width, ", ", unary,
                                                    " bitmap bits for ", n, " values)")));
      value_start[r + 1] = value_start[r] + n;
      word_start[r + 1] = word_start[r] + l.BlockWords(n, width, unary);
    }
    OP_REQUIRES(context, word_start[ranks] == words.NumElements(),
                InvalidArgumentError(absl::StrCat("the value codes' headers add up to ",
                                                  word_start[ranks], " words, ",
                                                  words.NumElements(), " arrived")));
    Tensor* bits_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({value_start[ranks]}),
                                                     &bits_tensor));
    uint32_t* out = reinterpret_cast<uint32_t*>(bits_tensor->flat<int32_t>().data());
    const uint32_t* in = reinterpret_cast<const uint32_t*>(words.flat<int32_t>().data());
    const int32_t* count_rows = counts.flat<int32_t>().data();
    const int64_t* field_rows = fields_tensor.flat<int64_t>().data();
    std::vector<int64_t> bad(ranks, 0);
    auto* pool = context->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(
        pool->num_threads, pool->workers, ranks, /*cost_per_unit=*/1 << 16,
        [&](int64_t first, int64_t last) {
          std::vector<uint32_t> codes;
          for (int64_t r = first; r < last; ++r) {
            bad[r] = !codecs::ReadValues(
                l, in + word_start[r], in + word_start[r + 1], count_rows + r * variables,
                variables, static_cast<int>(fields(r, 0)), field_rows + r * (variables + 2) + 2,
                &codes, out + value_start[r]);
          }
        });
    for (int64_t r = 0; r < ranks; ++r) {
      OP_REQUIRES(context, !bad[r],
                  InvalidArgumentError(absl::StrCat("rank ", r, "'s value code does not "
                                                    "decode to its header's values")));
    }
  }

 private:
  Layout layout_;
};

REGISTER_KERNEL_BUILDER(Name("SparseHvdEncodeValues").Device(tensorflow::DEVICE_CPU),
                        EncodeValuesOp);
REGISTER_KERNEL_BUILDER(Name("SparseHvdDecodeValues").Device(tensorflow::DEVICE_CPU),
                        DecodeValuesOp);

}  // namespace sparse_hvd
