// The index and value codes as functions over plain buffers, both ways: the ops that code one
// code each (index_codec.cc, value_codec.cc), the sparse allreduce's scatter, which codes a
// block per owner in one op (scatter_blocks.cc), and its unpacking of every rank's blocks in
// one op (decode_blocks.cc) write and read the same words through them.

#ifndef SPARSE_HVD_KERNELS_CODECS_H_
#define SPARSE_HVD_KERNELS_CODECS_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "bit_stream.h"

namespace sparse_hvd {
namespace codecs {

// ---- the Elias-Fano code of positions (index_codec.cc) -------------------------------------

// L of step 1: floor(log2(space / count)), 0 when space < 2 count.
int LowBits(int64_t count, int64_t space);

// (low words, bitmap words) of the code of ``count`` positions among ``space``.
std::pair<int64_t, int64_t> PositionWords(int64_t count, int64_t space);

// Step 1: ``order`` (``count`` entries) becomes the permutation that sorts ``positions``
// (``sorted``: whether it is the identity); an error names a position outside [0, space) or
// one that repeats.
absl::Status SortedOrder(const int64_t* positions, int64_t count, int64_t space, int32_t* order,
                         bool* sorted);

// Steps 2-3: the code, ``PositionWords(count, space)`` words, into ``out``.
void WritePositions(const int64_t* positions, const int32_t* order, int64_t count,
                    int64_t space, uint32_t* out);

// Decoding: the ``count`` positions the code in ``[words, end)`` holds, into ``positions``;
// false where those words end before ``count`` positions (a code that is not one). Whether
// they ascend within a range is the caller's check (it knows the range).
bool ReadPositions(const uint32_t* words, const uint32_t* end, int64_t count, int64_t space,
                   int64_t* positions);

// ---- the Rice code of values' exponents (value_codec.cc) -----------------------------------

// A float's bit layout: ``value_bits`` (32 or 16), ``exponent_bits`` of them the exponent.
struct Layout {
  int value_bits, exponent_bits, mantissa, field;
  Layout() : Layout(32, 8) {}
  Layout(int value, int exponent)
      : value_bits(value), exponent_bits(exponent), mantissa(value - 1 - exponent),
        field(value - exponent) {}
  uint32_t Exponent(uint32_t raw) const { return (raw >> mantissa) & ((1u << exponent_bits) - 1); }
  uint32_t Field(uint32_t raw) const {
    return ((raw >> (value_bits - 1)) << mantissa) | (raw & ((1u << mantissa) - 1));
  }
  uint32_t Raw(uint32_t field, uint32_t exponent) const {
    return ((field >> mantissa) << (value_bits - 1)) | (exponent << mantissa) |
           (field & ((1u << mantissa) - 1));
  }
  // Words of one block of ``count`` values with Rice width ``width`` and ``unary`` bitmap bits.
  int64_t BlockWords(int64_t count, int64_t width, int64_t unary) const {
    return bit_stream::WordsFor(count * field) + bit_stream::WordsFor(count * width) +
           bit_stream::WordsFor(unary);
  }
};

// One rank's block of values: :meth:`Plan` (steps 1-2: the codes, W, the bitmap's bits and
// each variable's base) then :meth:`Write` (step 3) into the words it asked for.
class ValueEncoder {
 public:
  explicit ValueEncoder(const Layout& layout) : layout_(layout) {}
  // ``raw``: ``counts[v]`` values of variable v after one another (their bits, zero-extended);
  // ``fields``: [W, bitmap bits, 2 base + zero flag per variable]. Returns the block's words.
  int64_t Plan(const uint32_t* raw, const int32_t* counts, int64_t variables, int64_t* fields);
  void Write(const uint32_t* raw, uint32_t* out) const;

 private:
  Layout layout_;
  std::vector<uint32_t> codes_;
  int64_t width_ = 0, unary_ = 0;
};

// Decoding one block of values from ``[block, end)``: ``counts[v]`` values of each of
// ``variables`` variables, Rice width ``width``, ``base_fields[v]`` = 2 base + zero flag; their
// raw bits (zero-extended) into ``raw``; ``codes``: scratch. False where the words do not
// decode to values of the layout (a code past the end, an exponent out of range).
bool ReadValues(const Layout& layout, const uint32_t* block, const uint32_t* end,
                const int32_t* counts, int64_t variables, int width,
                const int64_t* base_fields, std::vector<uint32_t>* codes, uint32_t* raw);

}  // namespace codecs
}  // namespace sparse_hvd

#endif  // SPARSE_HVD_KERNELS_CODECS_H_
