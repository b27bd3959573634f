// The sparse allreduce's coded blocks (sparse_hvd/exchanges/sparse_blocks.py's CodedBlocks;
// scatter_blocks.cc writes them, decode_blocks.cc reads them): a block is [count, W, the Rice
// bitmap's bits, 2 base + zero flag | the positions' Elias-Fano code | the values' code], the
// header kept apart in the gather's. A float32 or 16-bit value travels as the bits the value
// code reads (a 16-bit value zero-extended) in the layout of its type (value_coding.FORMATS); a
// float64 uncoded, as its two raw words.

#ifndef SPARSE_HVD_KERNELS_BLOCK_FORMAT_H_
#define SPARSE_HVD_KERNELS_BLOCK_FORMAT_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tensorflow/core/framework/types.h"
#include "codecs.h"

namespace sparse_hvd {

constexpr int kBlockHeader = 4;  // sparse_blocks.BLOCK_HEADER

template <typename T>
struct Bits;

template <typename T, int kValueBits, int kExponentBits>
struct CodedBits {
  static constexpr bool kCoded = true;
  using Word = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;
  static_assert(sizeof(Word) == sizeof(T));
  static codecs::Layout Layout() { return codecs::Layout(kValueBits, kExponentBits); }
  static uint32_t Raw(const T& value) {
    Word raw;
    std::memcpy(&raw, &value, sizeof(raw));
    return raw;
  }
  static T FromRaw(uint32_t raw) {
    const Word word = static_cast<Word>(raw);
    T value;
    std::memcpy(&value, &word, sizeof(value));
    return value;
  }
};

template <>
struct Bits<float> : CodedBits<float, 32, 8> {};
template <>
struct Bits<Eigen::half> : CodedBits<Eigen::half, 16, 5> {};
template <>
struct Bits<tensorflow::bfloat16> : CodedBits<tensorflow::bfloat16, 16, 8> {};
template <>
struct Bits<double> {
  static constexpr bool kCoded = false;
};

}  // namespace sparse_hvd

#endif  // SPARSE_HVD_KERNELS_BLOCK_FORMAT_H_
