// What the sparse allreduce applies of its kept sums, and what goes back
// (sparse_hvd/exchanges/sparse_allreduce.py, steps 6 and 7).
//
// SparseHvdApplied (step 6): of the kept entries (ascending global ``kept``, their ``sums``
// and ``magnitudes``), those whose magnitude reaches their variable's ``cuts[v]`` (variable v
// holds the indices from ``starts[v]`` to the next start), as global indices, indices within
// their variables, sums, and a count per variable. TensorFlow's comparison, where, two
// gathers, the searches for each variable's slice, the split and the subtraction of each
// variable's start took about 7 ms of op time a step at 5% density and 4 workers on 2 cores
// (the 4.35M MLP). With ``divisor`` >= 1 the sums come as their averages, each sum over the
// divisor and a sum of 0 or -0 as +0: the bits of TensorFlow's ``where(sum == 0, 0,
// divide_no_nan(sum, divisor))``, whose four ops took 6.6-7.0 ms of op time a step there
// (two profiles). Here:
//
//   1. one walk over the kept entries, the variable advancing as the indices pass its end,
//      counting those that reach the variable's cut (an index below the first start, or kept
//      indices that do not ascend, are an error that names the place);
//   2. a second walk writes them, once the outputs' sizes are known (an average: the division
//      in the sum's type, in float for the 16-bit types, as Eigen divides them).
//
// SparseHvdUnapplied (step 7): each of ``values`` where its index in ``needles`` plus
// ``offset`` is absent from ``sorted`` (ascending, distinct), else 0: the entries a rank sent
// whose sums were not applied go back into its residual; an applied one goes back as 0.
// TensorFlow's searchsorted, gather and comparison took 4-7 ms a step for the MLP's 43,000
// sent entries at 4 workers on 2 cores; a membership op followed by TensorFlow's select and
// zeros over all variables at once took 2.3, 3.7 and 1.2 ms of op time a step at 5% density,
// and the split of the result per variable 3.7 ms in a later profile. Here, per variable:
//
//   1. ``sorted`` must ascend: checked first (else an error names the place);
//   2. if the needles ascend (a rank's selections are made in index order), one merge walk
//      from the first needle's place in ``sorted`` (a binary search): linear in their lengths;
//   3. otherwise a binary search per needle;
//   4. each output entry is its value or 0, written as the walk passes it.

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace sparse_hvd {

using absl::InvalidArgumentError;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

REGISTER_OP("SparseHvdApplied")
    .Input("kept: int32")
    .Input("sums: T")
    .Input("magnitudes: double")
    .Input("cuts: double")
    .Input("starts: int32")
    .Output("applied: int32")
    .Output("local: int32")
    .Output("applied_sums: T")
    .Output("counts: int32")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("divisor: int >= 0 = 0")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 0; i < 3; ++i) c->set_output(i, c->Vector(c->UnknownDim()));
      c->set_output(3, c->input(4));
      return tsl::OkStatus();
    });

REGISTER_OP("SparseHvdUnapplied")
    .Input("needles: int32")
    .Input("sorted: int32")
    .Input("values: T")
    .Input("offset: int32")
    .Output("owed: T")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      tensorflow::shape_inference::ShapeHandle shape;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(2), &shape));
      c->set_output(0, shape);
      return tsl::OkStatus();
    });

// The type a value of T is divided in: float for the 16-bit types (Eigen's own division).
template <typename T>
struct DivisionType {
  using type = float;
};
template <>
struct DivisionType<double> {
  using type = double;
};

template <typename T>
class AppliedOp : public OpKernel {
 public:
  explicit AppliedOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("divisor", &divisor_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& kept_tensor = context->input(0);
    const Tensor& sums_tensor = context->input(1);
    const Tensor& magnitudes_tensor = context->input(2);
    const Tensor& cuts_tensor = context->input(3);
    const Tensor& starts_tensor = context->input(4);
    const int64_t count = kept_tensor.NumElements();
    const int64_t variables = starts_tensor.NumElements();
    OP_REQUIRES(context, sums_tensor.NumElements() == count &&
                             magnitudes_tensor.NumElements() == count &&
                             cuts_tensor.NumElements() == variables && variables > 0,
                InvalidArgumentError(absl::StrCat(
                    "kept, sums and magnitudes must be alike in length (", count, ", ",
                    sums_tensor.NumElements(), ", ", magnitudes_tensor.NumElements(),
                    "), and cuts one per start (", cuts_tensor.NumElements(), ", ", variables,
                    ")")));
    const int32_t* kept = kept_tensor.flat<int32_t>().data();
    const T* sums = sums_tensor.flat<T>().data();
    const double* magnitudes = magnitudes_tensor.flat<double>().data();
    const double* cuts = cuts_tensor.flat<double>().data();
    const int32_t* starts = starts_tensor.flat<int32_t>().data();
    for (int64_t v = 1; v < variables; ++v) {
      OP_REQUIRES(context, starts[v - 1] <= starts[v],
                  InvalidArgumentError(absl::StrCat("starts must ascend: starts[", v - 1,
                                                    "] = ", starts[v - 1], ", starts[", v,
                                                    "] = ", starts[v])));
    }
    // Step 1
    Tensor* counts_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(3, starts_tensor.shape(), &counts_tensor));
    int32_t* counts = counts_tensor->flat<int32_t>().data();
    std::fill(counts, counts + variables, 0);
    int64_t v = 0, total = 0;
    for (int64_t i = 0; i < count; ++i) {
      OP_REQUIRES(context, kept[i] >= starts[0] && (i == 0 || kept[i - 1] < kept[i]),
                  InvalidArgumentError(absl::StrCat(
                      "kept must ascend from starts[0] = ", starts[0], ": kept[", i, "] = ",
                      kept[i], i > 0 ? absl::StrCat(" after ", kept[i - 1]) : "")));
      while (v + 1 < variables && kept[i] >= starts[v + 1]) ++v;
      if (magnitudes[i] >= cuts[v]) {
        ++counts[v];
        ++total;
      }
    }
    // Step 2
    Tensor *applied_tensor = nullptr, *local_tensor = nullptr, *values_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({total}), &applied_tensor));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({total}), &local_tensor));
    OP_REQUIRES_OK(context, context->allocate_output(2, TensorShape({total}), &values_tensor));
    int32_t* applied = applied_tensor->flat<int32_t>().data();
    int32_t* local = local_tensor->flat<int32_t>().data();
    T* values = values_tensor->flat<T>().data();
    v = 0;
    for (int64_t i = 0, j = 0; i < count; ++i) {
      while (v + 1 < variables && kept[i] >= starts[v + 1]) ++v;
      if (magnitudes[i] >= cuts[v]) {
        applied[j] = kept[i];
        local[j] = kept[i] - starts[v];
        values[j] = divisor_ == 0 ? sums[i] : Averaged(sums[i]);
        ++j;
      }
    }
  }

 private:
  T Averaged(T sum) const {
    using Wide = typename DivisionType<T>::type;
    const Wide wide = static_cast<Wide>(sum);
    return wide == Wide(0) ? T(0) : static_cast<T>(wide / static_cast<Wide>(divisor_));
  }

  int64_t divisor_ = 0;
};

template <typename T>
class UnappliedOp : public OpKernel {
 public:
  explicit UnappliedOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& needles = context->input(0);
    const Tensor& sorted = context->input(1);
    const Tensor& values = context->input(2);
    const int32_t offset = context->input(3).scalar<int32_t>()();
    OP_REQUIRES(context, needles.dims() == 1 && sorted.dims() == 1 && values.dims() == 1,
                InvalidArgumentError("needles, sorted and values must be 1-D"));
    const int64_t count = needles.NumElements();
    OP_REQUIRES(context, values.NumElements() == count,
                InvalidArgumentError(absl::StrCat("values must have one entry per needle: ",
                                                  values.NumElements(), " values, ", count,
                                                  " needles")));
    const int64_t length = sorted.NumElements();
    const int32_t* need = needles.flat<int32_t>().data();
    const int32_t* hay = sorted.flat<int32_t>().data();
    for (int64_t j = 1; j < length; ++j) {
      OP_REQUIRES(context, hay[j - 1] < hay[j],
                  InvalidArgumentError(absl::StrCat("sorted must ascend: sorted[", j - 1,
                                                    "] = ", hay[j - 1], ", sorted[", j,
                                                    "] = ", hay[j])));
    }
    Tensor* owed_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, values.shape(), &owed_tensor));
    const T* given = values.flat<T>().data();
    T* owed = owed_tensor->flat<T>().data();
    const T zero = T(0);
    if (std::is_sorted(need, need + count)) {
      int64_t j = count > 0 ? std::lower_bound(hay, hay + length, need[0] + offset) - hay : 0;
      for (int64_t i = 0; i < count; ++i) {
        const int32_t at = need[i] + offset;
        while (j < length && hay[j] < at) ++j;
        owed[i] = (j < length && hay[j] == at) ? zero : given[i];
      }
    } else {
      for (int64_t i = 0; i < count; ++i) {
        owed[i] = std::binary_search(hay, hay + length, need[i] + offset) ? zero : given[i];
      }
    }
  }
};

#define REGISTER(T)                                                                     \
  REGISTER_KERNEL_BUILDER(                                                              \
      Name("SparseHvdApplied").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),   \
      AppliedOp<T>);                                                                    \
  REGISTER_KERNEL_BUILDER(                                                              \
      Name("SparseHvdUnapplied").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      UnappliedOp<T>)
REGISTER(Eigen::half);
REGISTER(tensorflow::bfloat16);
REGISTER(float);
REGISTER(double);
#undef REGISTER

}  // namespace sparse_hvd
