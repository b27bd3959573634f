// Bit fields and unary codes in int32 words, little-endian (bit b of the string is bit b % 32
// of word b / 32): what the value and index codecs (value_codec.cc, index_codec.cc) write and
// read, the same layout as sparse_hvd/exchanges/bit_packing.py's TensorFlow ops.

#ifndef SPARSE_HVD_KERNELS_BIT_STREAM_H_
#define SPARSE_HVD_KERNELS_BIT_STREAM_H_

#include <cstdint>

namespace sparse_hvd {
namespace bit_stream {

inline int64_t WordsFor(int64_t bits) { return (bits + 31) / 32; }

// Appends fields of up to 32 bits to int32 words, little-endian.
class BitWriter {
 public:
  explicit BitWriter(uint32_t* words) : out_(words) {}
  void Put(uint64_t value, int width) {
    buffer_ |= value << filled_;
    filled_ += width;
    if (filled_ >= 32) {
      *out_++ = static_cast<uint32_t>(buffer_);
      buffer_ >>= 32;
      filled_ -= 32;
    }
  }
  // Writes what is left; the next part starts at a fresh word.
  uint32_t* Flush() {
    if (filled_ > 0) *out_++ = static_cast<uint32_t>(buffer_);
    buffer_ = 0;
    filled_ = 0;
    return out_;
  }

 private:
  uint32_t* out_;
  uint64_t buffer_ = 0;
  int filled_ = 0;
};

// Reads fields of up to 32 bits from int32 words, little-endian, within [words, end).
class BitReader {
 public:
  BitReader(const uint32_t* words, const uint32_t* end) : in_(words), end_(end) {}
  uint64_t Get(int width) {
    if (available_ < width) {
      buffer_ |= static_cast<uint64_t>(in_ < end_ ? *in_ : 0) << available_;
      ++in_;
      available_ += 32;
    }
    const uint64_t value = width == 0 ? 0 : buffer_ & ((uint64_t{1} << width) - 1);
    buffer_ >>= width;
    available_ -= width;
    return value;
  }
  // The number of 0 bits before the next 1 bit, which is consumed; -1 past the end.
  int64_t Unary() {
    int64_t zeros = 0;
    while (true) {
      if (available_ == 0) {
        if (in_ >= end_) return -1;
        buffer_ = *in_++;
        available_ = 32;
      }
      if (buffer_ != 0) {
        const int skip = __builtin_ctzll(buffer_);
        buffer_ >>= skip;
        buffer_ >>= 1;
        available_ -= skip + 1;
        return zeros + skip;
      }
      zeros += available_;
      available_ = 0;
    }
  }

 private:
  const uint32_t* in_;
  const uint32_t* end_;
  uint64_t buffer_ = 0;
  int available_ = 0;
};

// Sets bit ``place`` of ``words``.
inline void SetBit(uint32_t* words, int64_t place) { words[place >> 5] |= 1u << (place & 31); }

}  // namespace bit_stream
}  // namespace sparse_hvd

#endif  // SPARSE_HVD_KERNELS_BIT_STREAM_H_
