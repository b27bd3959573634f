// SparseHvdScatterMean: what every rank received in the fused allgather, turned into the
// average of each variable in one walk over the entries (sparse_hvd/exchanges/fused_allgather.py, steps 3-4).
//
// Inputs: the gathered int32 ``indices`` of every sparse variable (rank by rank, and within a
// rank variable by variable), the gathered ``values`` of the variables of one dtype (the
// ``columns`` of ``counts``, in the same order), and ``counts`` [ranks, variables]: how many
// entries each rank sent of each variable. Output ``i`` is variable ``columns[i]``'s average:
//
//   1. zeros of ``num_elements[i]`` entries (in parallel, in chunks);
//   2. every entry added at its index, rank by rank in rank order (one thread per variable),
//      so every rank adds the same numbers in the same order: the same bits everywhere;
//   3. each position that received an entry divided by ``divisor`` once (0 / divisor is 0, so
//      this equals dividing the whole output, without a pass over it).
//
// SparseHvdMeanAtPositions: the same averages as (positions, values) pairs, only where entries
// arrived, for a caller that subtracts them from the weights in place (sparse_hvd/feedback/
// local_update.py): no pass over the whole variable, which step 1 and a dense subtraction
// cost (5.3 and 5.8 ms of a 4.2M-entry layer's step at 2 ranks). For each variable:
//
//   1. a hash table from position to slot, sized for the entries that arrived (not for the
//      variable: a dense sum per position cost one cache miss an entry, 5.6 ms a step);
//   2. the entries in rank order: a position's first entry takes the next slot and starts
//      its sum at ``0 + value`` (so -0.0 sums to +0.0, as in ScatterMean's zeros); later ones
//      add to it: the same additions in the same order as ScatterMean's, so the same bits;
//   3. every recorded position's sum divided by ``divisor``; the positions in the order they
//      first arrived.
//
// Where every rank's entries of the variable ascend (a magnitude cut's do) and there are at
// most kMergedRanks ranks, steps 1-2 are a merge of the ranks' runs instead (Entries::Merge):
// the same sums in the same order, the positions ascending. On the 4.35M MLP at 2 ranks
// (87,000 entries, one thread) the table took 1.5-1.8 ms of the step, the merge 1.0-1.1 ms:
// the table's 2 MB do not stay in cache beside the step's other work.
//
// An index outside its variable is an error that names the variable, never a silent drop.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

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
using tensorflow::OpOutputList;
using tensorflow::Tensor;
using tensorflow::TensorShape;

REGISTER_OP("SparseHvdScatterMean")
    .Attr("T: {float, double}")
    .Attr("columns: list(int)")
    .Attr("num_elements: list(int)")
    .Attr("num_outputs: int >= 0")
    .Input("indices: int32")
    .Input("values: T")
    .Input("counts: int32")
    .Input("divisor: T")
    .Output("averages: num_outputs * T")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      std::vector<int64_t> sizes;
      TF_RETURN_IF_ERROR(c->GetAttr("num_elements", &sizes));
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->Vector(sizes[i]));
      return tsl::OkStatus();
    });

REGISTER_OP("SparseHvdMeanAtPositions")
    .Attr("T: {float, double}")
    .Attr("columns: list(int)")
    .Attr("num_elements: list(int)")
    .Attr("num_outputs: int >= 0")
    .Input("indices: int32")
    .Input("values: T")
    .Input("counts: int32")
    .Input("divisor: T")
    .Output("positions: num_outputs * int32")
    .Output("averages: num_outputs * T")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->Vector(c->UnknownDim()));
      return tsl::OkStatus();
    });

// What ``bad[i]`` holds while output ``i`` met no index outside its variable (a negative index
// is as wrong as one past the end: an int32 index that overflowed).
constexpr int64_t kNoneOutside = std::numeric_limits<int64_t>::min();

// The error for an index ``bad[i]`` outside output ``i``'s variable, if any.
void RefuseOutside(OpKernelContext* context, const std::vector<int64_t>& bad,
                   const std::vector<int64_t>& columns, const std::vector<int64_t>& sizes) {
  for (size_t i = 0; i < bad.size(); ++i) {
    OP_REQUIRES(context, bad[i] == kNoneOutside,
                InvalidArgumentError(absl::StrCat("index ", bad[i], " is outside variable ",
                                                  columns[i], " of ", sizes[i], " entries")));
  }
}

// Where each (rank, output) run of entries starts in ``indices`` and in ``values``, read from
// the op's inputs and checked against them (both ops' inputs are the same); a failed check
// sets the context's status.
struct EntryRuns {
  int64_t ranks = 0, variables = 0, outputs = 0;
  std::vector<int64_t> index_start, value_start;

  void Read(OpKernelContext* context, const std::vector<int64_t>& columns) {
    const Tensor& indices = context->input(0);
    const Tensor& values = context->input(1);
    const Tensor& counts = context->input(2);
    OP_REQUIRES(context, counts.dims() == 2,
                InvalidArgumentError("counts must be [ranks, variables]"));
    ranks = counts.dim_size(0);
    variables = counts.dim_size(1);
    const auto count = counts.matrix<int32_t>();
    outputs = static_cast<int64_t>(columns.size());
    std::vector<int64_t> column_output(variables, -1);
    for (int64_t i = 0; i < outputs; ++i) {
      OP_REQUIRES(context, columns[i] >= 0 && columns[i] < variables,
                  InvalidArgumentError("a column is outside counts"));
      column_output[columns[i]] = i;
    }
    index_start.assign(ranks * outputs, 0);
    value_start.assign(ranks * outputs, 0);
    int64_t index_offset = 0, value_offset = 0;
    for (int64_t r = 0; r < ranks; ++r) {
      for (int64_t v = 0; v < variables; ++v) {
        const int64_t n = count(r, v);
        OP_REQUIRES(context, n >= 0, InvalidArgumentError("a negative count"));
        const int64_t out = column_output[v];
        if (out >= 0) {
          index_start[r * outputs + out] = index_offset;
          value_start[r * outputs + out] = value_offset;
          value_offset += n;
        }
        index_offset += n;
      }
    }
    OP_REQUIRES(context, index_offset == indices.NumElements(),
                InvalidArgumentError(absl::StrCat("counts add up to ", index_offset, " entries, ",
                                                  indices.NumElements(), " indices arrived")));
    OP_REQUIRES(context, value_offset == values.NumElements(),
                InvalidArgumentError(absl::StrCat("counts add up to ", value_offset, " values, ",
                                                  values.NumElements(), " arrived")));
  }
};

// Up to this many ranks, ascending runs are merged (Entries::Merge) instead of tabled.
constexpr int64_t kMergedRanks = 8;

// The inputs both ops read: the entry runs, checked, and what each entry holds.
template <typename T>
struct Entries : EntryRuns {
  const int32_t* idx = nullptr;
  const T* val = nullptr;
  T divisor = T(1);

  // False (with the context's status set) where the inputs do not agree.
  bool Load(OpKernelContext* context, const std::vector<int64_t>& columns) {
    Read(context, columns);
    if (!context->status().ok()) return false;
    counts_ = context->input(2).flat<int32_t>().data();
    idx = context->input(0).flat<int32_t>().data();
    val = context->input(1).flat<T>().data();
    divisor = context->input(3).scalar<T>()();
    return true;
  }

  // Rank ``r``'s entries of output ``i`` (variable ``column``).
  struct Run {
    const int32_t* indices;
    const T* values;
    int64_t count;
  };
  Run RunOf(int64_t r, int64_t i, int64_t column) const {
    return {idx + index_start[r * outputs + i], val + value_start[r * outputs + i],
            counts_[r * variables + column]};
  }

  // How many entries of variable ``column`` arrived from all ranks.
  int64_t Arriving(int64_t column) const {
    int64_t total = 0;
    for (int64_t r = 0; r < ranks; ++r) total += counts_[r * variables + column];
    return total;
  }

  // Calls ``step(j, value)`` for each entry of output ``i`` (variable ``column`` of ``size``
  // entries), rank by rank in rank order; stops at an index outside the variable and returns
  // it, else kNoneOutside.
  template <typename Step>
  int64_t Walk(int64_t i, int64_t column, int64_t size, Step&& step) const {
    for (int64_t r = 0; r < ranks; ++r) {
      const Run run = RunOf(r, i, column);
      for (int64_t e = 0; e < run.count; ++e) {
        const int64_t j = run.indices[e];
        if (j < 0 || j >= size) return j;
        step(j, run.values[e]);
      }
    }
    return kNoneOutside;
  }

  // Whether every rank's entries of output ``i`` (variable ``column``) have strictly
  // ascending indices, as a magnitude cut's selection has (CompensateCut's ascending output).
  bool Ascending(int64_t i, int64_t column) const {
    for (int64_t r = 0; r < ranks; ++r) {
      const Run run = RunOf(r, i, column);
      for (int64_t e = 1; e < run.count; ++e) {
        if (run.indices[e] <= run.indices[e - 1]) return false;
      }
    }
    return true;
  }

  // Writes each index ``j`` of output ``i`` (variable ``column`` of ``size`` entries) in
  // ascending order to ``positions``, and 0 + its values rank by rank in rank order to
  // ``sums`` (room for every arriving entry), by merging the ranks' runs, which must ascend
  // (``Ascending``) and be at most kMergedRanks; returns how many it wrote, or stops at an
  // index outside the variable and sets ``*outside`` to it. Each step takes the least next
  // index and adds every rank's entry there with selects, not branches (which rank holds the
  // least index is a coin toss: a branch on it mispredicts every other entry).
  int64_t Merge(int64_t i, int64_t column, int64_t size, int32_t* positions, T* sums,
                int64_t* outside) const {
    constexpr int64_t kDone = std::numeric_limits<int64_t>::max();
    const int64_t n = ranks;
    const int32_t* next[kMergedRanks];
    const int32_t* end[kMergedRanks];
    const T* value[kMergedRanks];
    int64_t head[kMergedRanks];
    for (int64_t r = 0; r < n; ++r) {
      const Run run = RunOf(r, i, column);
      next[r] = run.indices;
      end[r] = run.indices + run.count;
      value[r] = run.values;
      head[r] = next[r] != end[r] ? *next[r] : kDone;
    }
    int64_t written = 0;
    *outside = kNoneOutside;
    while (true) {
      int64_t j = head[0];
      for (int64_t r = 1; r < n; ++r) j = std::min(j, head[r]);
      if (j == kDone) return written;
      if (j < 0 || j >= size) {
        *outside = j;
        return written;
      }
      T sum = T(0);
      for (int64_t r = 0; r < n; ++r) {
        const bool here = head[r] == j;
        sum = here ? sum + *value[r] : sum;
        next[r] += here;
        value[r] += here;
        head[r] = !here ? head[r] : (next[r] != end[r] ? *next[r] : kDone);
      }
      positions[written] = static_cast<int32_t>(j);
      sums[written] = sum;
      ++written;
    }
  }

 private:
  const int32_t* counts_ = nullptr;  // [ranks, variables], row-major
};

// The attributes both ops share.
class EntriesOp : public OpKernel {
 public:
  explicit EntriesOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("columns", &columns_));
    OP_REQUIRES_OK(context, context->GetAttr("num_elements", &num_elements_));
    OP_REQUIRES(context, columns_.size() == num_elements_.size(),
                InvalidArgumentError("columns and num_elements differ in length"));
  }

 protected:
  std::vector<int64_t> columns_;
  std::vector<int64_t> num_elements_;
};

template <typename T>
class ScatterMeanOp : public EntriesOp {
 public:
  using EntriesOp::EntriesOp;

  void Compute(OpKernelContext* context) override {
    Entries<T> entries;
    if (!entries.Load(context, columns_)) return;
    const int64_t outputs = entries.outputs;
    const T divisor = entries.divisor;

    OpOutputList averages;
    OP_REQUIRES_OK(context, context->output_list("averages", &averages));
    std::vector<T*> out(outputs);
    for (int64_t i = 0; i < outputs; ++i) {
      Tensor* tensor = nullptr;
      OP_REQUIRES_OK(context, averages.allocate(i, TensorShape({num_elements_[i]}), &tensor));
      out[i] = tensor->flat<T>().data();
    }
    auto* pool = context->device()->tensorflow_cpu_worker_threads();

    // Step 1: zeros, in chunks across the thread pool.
    const int64_t chunk = 1 << 16;
    std::vector<std::pair<int64_t, int64_t>> pieces;  // (output, first entry)
    for (int64_t i = 0; i < outputs; ++i)
      for (int64_t begin = 0; begin < num_elements_[i]; begin += chunk) pieces.emplace_back(i, begin);
    tensorflow::Shard(pool->num_threads, pool->workers, pieces.size(), chunk * sizeof(T),
                      [&](int64_t first, int64_t last) {
                        for (int64_t p = first; p < last; ++p) {
                          const int64_t i = pieces[p].first, begin = pieces[p].second;
                          const int64_t end = std::min(num_elements_[i], begin + chunk);
                          std::fill(out[i] + begin, out[i] + end, T(0));
                        }
                      });

    // Steps 2-3: one thread per output, entries in rank order.
    std::vector<int64_t> bad(outputs, kNoneOutside);  // an index outside, per output
    tensorflow::Shard(
        pool->num_threads, pool->workers, outputs, /*cost_per_unit=*/1 << 20,
        [&](int64_t first, int64_t last) {
          for (int64_t i = first; i < last; ++i) {
            const int64_t n = num_elements_[i];
            T* o = out[i];
            bad[i] = entries.Walk(i, columns_[i], n, [o](int64_t j, T value) { o[j] += value; });
            if (bad[i] != kNoneOutside || divisor == T(1)) continue;
            std::vector<uint64_t> divided((n + 63) / 64, 0);
            entries.Walk(i, columns_[i], n, [&divided, o, divisor](int64_t j, T) {
              uint64_t& word = divided[j >> 6];
              const uint64_t bit = uint64_t{1} << (j & 63);
              if (!(word & bit)) {
                word |= bit;
                o[j] /= divisor;
              }
            });
          }
        });
    RefuseOutside(context, bad, columns_, num_elements_);
  }
};

// Each arriving position's slot (its rank among the distinct positions, in arrival order), by
// open addressing with linear probing in a table of at least twice the entries: a few MB that
// stay in cache, where a sum per position of the variable would be one cache miss an entry.
class PositionTable {
 public:
  explicit PositionTable(int64_t entries) {
    int64_t capacity = 16;
    shift_ = 60;
    while (capacity < 2 * entries) {
      capacity <<= 1;
      --shift_;
    }
    mask_ = static_cast<uint64_t>(capacity - 1);
    keys_.assign(capacity, -1);
    slots_.resize(capacity);
  }

  // The slot of ``position``; a position not seen before gets ``next``.
  int32_t& SlotOf(int32_t position, int32_t next) {
    uint64_t at = static_cast<uint64_t>(position) * 0x9E3779B97F4A7C15ull >> shift_;
    while (keys_[at] != position) {
      if (keys_[at] < 0) {
        keys_[at] = position;
        slots_[at] = next;
        break;
      }
      at = (at + 1) & mask_;
    }
    return slots_[at];
  }

 private:
  uint64_t mask_ = 0;
  int shift_ = 60;  // Fibonacci hashing: the product's top log2(capacity) bits
  std::vector<int32_t> keys_;
  std::vector<int32_t> slots_;
};

template <typename T>
class MeanAtPositionsOp : public EntriesOp {
 public:
  using EntriesOp::EntriesOp;

  void Compute(OpKernelContext* context) override {
    Entries<T> entries;
    if (!entries.Load(context, columns_)) return;
    const int64_t outputs = entries.outputs;
    const T divisor = entries.divisor;

    std::vector<std::vector<int32_t>> positions(outputs);
    std::vector<std::vector<T>> sums(outputs);
    std::vector<int64_t> bad(outputs, kNoneOutside);
    auto* pool = context->device()->tensorflow_cpu_worker_threads();
    tensorflow::Shard(
        pool->num_threads, pool->workers, outputs, /*cost_per_unit=*/1 << 20,
        [&](int64_t first, int64_t last) {
          for (int64_t i = first; i < last; ++i) {
            const int64_t arriving = entries.Arriving(columns_[i]);
            std::vector<int32_t>& order = positions[i];
            std::vector<T>& sum = sums[i];
            // Step 2
            if (entries.ranks >= 1 && entries.ranks <= kMergedRanks &&
                entries.Ascending(i, columns_[i])) {
              order.resize(arriving);
              sum.resize(arriving);
              const int64_t distinct = entries.Merge(i, columns_[i], num_elements_[i],
                                                     order.data(), sum.data(), &bad[i]);
              order.resize(distinct);
              sum.resize(distinct);
              continue;
            }
            order.reserve(arriving);
            sum.reserve(arriving);
            PositionTable table(arriving);  // Step 1
            bad[i] = entries.Walk(i, columns_[i], num_elements_[i], [&](int64_t j, T value) {
              const int32_t next = static_cast<int32_t>(order.size());
              int32_t& slot = table.SlotOf(static_cast<int32_t>(j), next);
              if (slot == next) {
                order.push_back(static_cast<int32_t>(j));
                sum.push_back(T(0) + value);
              } else {
                sum[slot] += value;
              }
            });
          }
        });
    RefuseOutside(context, bad, columns_, num_elements_);
    if (!context->status().ok()) return;

    // Step 3
    OpOutputList position_list, averages;
    OP_REQUIRES_OK(context, context->output_list("positions", &position_list));
    OP_REQUIRES_OK(context, context->output_list("averages", &averages));
    for (int64_t i = 0; i < outputs; ++i) {
      const int64_t m = static_cast<int64_t>(positions[i].size());
      Tensor* where = nullptr;
      Tensor* mean = nullptr;
      OP_REQUIRES_OK(context, position_list.allocate(i, TensorShape({m}), &where));
      OP_REQUIRES_OK(context, averages.allocate(i, TensorShape({m}), &mean));
      int32_t* w = where->flat<int32_t>().data();
      T* a = mean->flat<T>().data();
      for (int64_t u = 0; u < m; ++u) {
        w[u] = positions[i][u];
        a[u] = divisor == T(1) ? sums[i][u] : sums[i][u] / divisor;
      }
    }
  }
};

#define REGISTER_ENTRIES_KERNELS(T)                                                        \
  REGISTER_KERNEL_BUILDER(                                                                 \
      Name("SparseHvdScatterMean").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),  \
      ScatterMeanOp<T>);                                                                   \
  REGISTER_KERNEL_BUILDER(                                                                 \
      Name("SparseHvdMeanAtPositions").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      MeanAtPositionsOp<T>);

REGISTER_ENTRIES_KERNELS(float)
REGISTER_ENTRIES_KERNELS(double)

}  // namespace sparse_hvd
