// Python bindings of the CUDA packing kernels: argument checks, device guard, current stream.
// Same functions, arguments and results as the CPU op (../cpu/lioncub_packing.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>  // std::vector arguments of the fused step

#include <vector>

#include "lioncub_packing.h"  // the dtype dispatch and argument checks shared with the CPU op
#include "lioncub_packing_cuda.h"

namespace {

using lioncub::check_bits;
using lioncub::check_input;
using lioncub::check_out;
using lioncub::cuda::InputKind;

// The device of this op's tensors, for the argument checks it shares with the CPU op.
constexpr at::DeviceType kDevice = at::kCUDA;

// The launchers take raw pointers and an InputKind: the kind of each dispatched element type.
template <typename T>
constexpr InputKind kind_of();
template <>
constexpr InputKind kind_of<float>() { return InputKind::kF32; }
template <>
constexpr InputKind kind_of<at::BFloat16>() { return InputKind::kBF16; }
template <>
constexpr InputKind kind_of<at::Half>() { return InputKind::kF16; }
template <>
constexpr InputKind kind_of<uint8_t>() { return InputKind::kU8; }
template <>
constexpr InputKind kind_of<int32_t>() { return InputKind::kI32; }

InputKind float_kind(const at::Tensor& t, const char* what)
{
    return LIONCUB_DISPATCH_FLOAT_TYPES(t.scalar_type(), what, [] { return kind_of<scalar_t>(); });
}

// `v2`: the second generation of kernels (#47, lioncub_bandwidth_kernels.cu), which the bindings without a suffix
// run; the bindings named *_v1 run the first (lioncub_packing_kernels.cu), for the benchmarks' "before".
void pack_signs_with(const at::Tensor& x, bool zero_is_positive, int64_t bits, const at::Tensor& out, bool v2)
{
    check_input(x, kDevice, "pack_signs");
    check_bits(bits, "pack_signs");
    check_out(out, kDevice, (x.numel() * bits + 7) / 8, "pack_signs");
    const InputKind kind =
        LIONCUB_DISPATCH_SIGN_TYPES(x.scalar_type(), "pack_signs", [] { return kind_of<scalar_t>(); });
    const c10::cuda::CUDAGuard guard(x.device());
    const auto launch = v2 ? lioncub::cuda::launch_pack_signs_v2 : lioncub::cuda::launch_pack_signs;
    launch(kind, x.data_ptr(), x.numel(), zero_is_positive, static_cast<int>(bits), out.data_ptr<uint8_t>(),
           out.numel(), c10::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void pack_signs(const at::Tensor& x, bool zero_is_positive, int64_t bits, const at::Tensor& out)
{
    pack_signs_with(x, zero_is_positive, bits, out, true);
}

void pack_signs_v1(const at::Tensor& x, bool zero_is_positive, int64_t bits, const at::Tensor& out)
{
    pack_signs_with(x, zero_is_positive, bits, out, false);
}

void unpack_signs_with(const at::Tensor& packed, const at::Tensor& out, bool v2)
{
    check_input(packed, kDevice, "unpack_signs");
    check_input(out, kDevice, "unpack_signs");
    lioncub::check_packed(packed, "unpack_signs");
    const int64_t n = out.numel();
    lioncub::check_holds_signs(packed, n, "unpack_signs");
    LIONCUB_DISPATCH_FLOAT_TYPES(out.scalar_type(), "unpack_signs", [&] {
        using Unit = lioncub::UnitBits<scalar_t>;
        const c10::cuda::CUDAGuard guard(packed.device());
        const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
        if (v2) {
            lioncub::cuda::launch_unpack_signs_v2(packed.data_ptr<uint8_t>(), (n + 7) / 8, n,
                                                  static_cast<int>(sizeof(scalar_t)), Unit::plus, Unit::minus,
                                                  out.data_ptr(), stream);
        } else {
            lioncub::cuda::launch_unpack_signs(packed.data_ptr<uint8_t>(), n, static_cast<int>(sizeof(scalar_t)),
                                               Unit::plus, Unit::minus, out.data_ptr(), stream);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
}

void unpack_signs(const at::Tensor& packed, const at::Tensor& out) { unpack_signs_with(packed, out, true); }

void unpack_signs_v1(const at::Tensor& packed, const at::Tensor& out) { unpack_signs_with(packed, out, false); }

// rows: (p, stride) uint8 with 1 <= p <= max_voters(), each holding at least numel bits (or b-bit fields).
int64_t check_voting_rows(const at::Tensor& rows, int64_t bits, int64_t numel, const char* what)
{
    check_input(rows, kDevice, what);
    lioncub::check_rows(rows, what);
    const int64_t p = rows.size(0);
    TORCH_CHECK(p >= 1 && p <= lioncub::cuda::max_voters(), what, ": need 1 <= p <= ", lioncub::cuda::max_voters(),
                " rows, got ", p);
    if (bits == 1) {
        lioncub::check_rows_hold_signs(rows, numel, what);
    } else {
        lioncub::check_rows_hold_fields(rows, bits, numel, what);
    }
    return p;
}

void vote_packed_signs_with(const at::Tensor& rows, int64_t numel, bool zero_is_positive, const at::Tensor& out,
                            bool v2)
{
    const int64_t p = check_voting_rows(rows, 1, numel, "vote_packed_signs");
    const int64_t stride = rows.size(1);
    check_out(out, kDevice, (numel + 7) / 8, "vote_packed_signs");
    const c10::cuda::CUDAGuard guard(rows.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    if (v2) {
        lioncub::cuda::launch_vote_v2(rows.data_ptr<uint8_t>(), p, stride, numel,
                                      lioncub::vote_threshold(p, zero_is_positive), out.data_ptr<uint8_t>(),
                                      out.numel(), stream);
    } else {
        lioncub::cuda::launch_vote(rows.data_ptr<uint8_t>(), p, stride, numel, zero_is_positive,
                                   out.data_ptr<uint8_t>(), out.numel(), stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void vote_packed_signs(const at::Tensor& rows, int64_t numel, bool zero_is_positive, const at::Tensor& out)
{
    vote_packed_signs_with(rows, numel, zero_is_positive, out, true);
}

void vote_packed_signs_v1(const at::Tensor& rows, int64_t numel, bool zero_is_positive, const at::Tensor& out)
{
    vote_packed_signs_with(rows, numel, zero_is_positive, out, false);
}

// The k-bit votes in one kernel: bit i of out is 1 where the sum of field i over the rows is >= threshold (a k-bit
// all-reduce's summed message is one row). out: at least ceil(numel / 8) bytes; the bytes past the positions are 0.
void vote_field_sums(const at::Tensor& rows, int64_t bits, int64_t numel, int64_t threshold, const at::Tensor& out)
{
    const char* what = "vote_field_sums";
    check_bits(bits, what);
    const int64_t p = check_voting_rows(rows, bits, numel, what);
    check_out(out, kDevice, (numel + 7) / 8, what);
    const c10::cuda::CUDAGuard guard(rows.device());
    lioncub::cuda::launch_vote_field_sums(rows.data_ptr<uint8_t>(), p, rows.size(1), static_cast<int>(bits), numel,
                                          threshold, out.data_ptr<uint8_t>(), out.numel(),
                                          c10::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void sum_fields(const at::Tensor& rows, int64_t bits, int64_t numel, const at::Tensor& out)
{
    check_input(rows, kDevice, "sum_fields");
    check_input(out, kDevice, "sum_fields");
    check_bits(bits, "sum_fields");
    lioncub::check_rows(rows, "sum_fields");
    TORCH_CHECK(out.scalar_type() == at::kInt && out.numel() == numel, "sum_fields: out must be int32 of numel");
    lioncub::check_rows_hold_fields(rows, bits, numel, "sum_fields");
    const c10::cuda::CUDAGuard guard(rows.device());
    lioncub::cuda::launch_sum_fields(rows.data_ptr<uint8_t>(), rows.size(0), rows.size(1), static_cast<int>(bits),
                                     numel, out.data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void pack_fields(const at::Tensor& values, int64_t bits, const at::Tensor& out)
{
    check_input(values, kDevice, "pack_fields");
    check_bits(bits, "pack_fields");
    check_out(out, kDevice, (values.numel() * bits + 7) / 8, "pack_fields");
    const InputKind kind =
        LIONCUB_DISPATCH_FIELD_TYPES(values.scalar_type(), "pack_fields", [] { return kind_of<scalar_t>(); });
    const c10::cuda::CUDAGuard guard(values.device());
    lioncub::cuda::launch_pack_fields(kind, values.data_ptr(), values.numel(), static_cast<int>(bits),
                                      out.data_ptr<uint8_t>(), out.numel(), c10::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void unpack_fields(const at::Tensor& packed, int64_t bits, const at::Tensor& out)
{
    check_input(packed, kDevice, "unpack_fields");
    check_input(out, kDevice, "unpack_fields");
    check_bits(bits, "unpack_fields");
    TORCH_CHECK(packed.scalar_type() == at::kByte && out.scalar_type() == at::kByte,
                "unpack_fields: uint8 tensors only");
    lioncub::check_holds_fields(packed, bits, out.numel(), "unpack_fields");
    const c10::cuda::CUDAGuard guard(packed.device());
    lioncub::cuda::launch_unpack_fields(packed.data_ptr<uint8_t>(), static_cast<int>(bits), out.numel(),
                                        out.data_ptr<uint8_t>(), c10::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// offsets (int64, nseg + 1) and scales (fp32, nseg) on the same device as c; packing.py checks
// that the offsets run from 0 to numel without decreasing.
void quantize_l1_pack(const at::Tensor& c, const at::Tensor& offsets, const at::Tensor& scales, int64_t levels,
                      int64_t bits, const at::Tensor& out)
{
    check_input(c, kDevice, "quantize_l1_pack");
    check_input(offsets, kDevice, "quantize_l1_pack");
    check_input(scales, kDevice, "quantize_l1_pack");
    lioncub::check_l1_arguments(offsets, scales, levels, bits, "quantize_l1_pack");
    check_out(out, kDevice, (c.numel() * bits + 7) / 8, "quantize_l1_pack");
    const InputKind kind = float_kind(c, "quantize_l1_pack");
    const c10::cuda::CUDAGuard guard(c.device());
    lioncub::cuda::launch_quantize_l1_pack(kind, c.data_ptr(), c.numel(), offsets.data_ptr<int64_t>(),
                                           scales.data_ptr<float>(), scales.numel(), static_cast<int>(levels),
                                           static_cast<int>(bits), out.data_ptr<uint8_t>(), out.numel(),
                                           c10::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// quantize_l1_pack with each segment's scale computed in the kernel from its mean |c| (means: fp32, nseg, on c's
// device), as ds_lioncub.comm.quantize.l1_scale computes it in torch.
void quantize_l1_means_pack(const at::Tensor& c, const at::Tensor& offsets, const at::Tensor& means, int64_t levels,
                            double clip, int64_t bits, const at::Tensor& out)
{
    const char* what = "quantize_l1_means_pack";
    check_input(c, kDevice, what);
    check_input(offsets, kDevice, what);
    check_input(means, kDevice, what);
    TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, what, ": bits must be 2, 4 or 8");
    TORCH_CHECK(levels >= 1 && 2 * levels <= (int64_t(1) << bits) - 1, what, ": levels ", levels, " do not fit ",
                bits, "-bit fields");
    TORCH_CHECK(offsets.scalar_type() == at::kLong && means.scalar_type() == at::kFloat &&
                    offsets.numel() == means.numel() + 1,
                what, ": offsets (int64, nseg+1) and means (fp32, nseg) disagree");
    check_out(out, kDevice, (c.numel() * bits + 7) / 8, what);
    const InputKind kind = float_kind(c, what);
    const c10::cuda::CUDAGuard guard(c.device());
    lioncub::cuda::launch_quantize_l1_means_pack(kind, c.data_ptr(), c.numel(), offsets.data_ptr<int64_t>(),
                                                 means.data_ptr<float>(), means.numel(), static_cast<int>(levels),
                                                 static_cast<float>(clip), static_cast<int>(bits),
                                                 out.data_ptr<uint8_t>(), out.numel(),
                                                 c10::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Option clip's sketch (see ../cpu/lioncub_packing.cpp for the order of the sums, which the kernel keeps): every
// piece in one launch. The pieces' addresses and layout go to the device in one copy from pinned memory, issued on
// the current stream (the caching host allocator keeps the pinned block until the copy is done).
void sketch_and_squares(const std::vector<at::Tensor>& pieces, const std::vector<int64_t>& columns,
                        const std::vector<int64_t>& starts, const at::Tensor& signs, int64_t period,
                        const at::Tensor& out)
{
    const char* what = "sketch_and_squares";
    check_input(out, kDevice, what);
    TORCH_CHECK(out.scalar_type() == at::kDouble && out.numel() >= 2, what,
                ": out must be a contiguous CUDA float64 tensor of bins + 1 >= 2 elements");
    check_input(signs, kDevice, what);
    lioncub::check_packed(signs, what);
    TORCH_CHECK(signs.device() == out.device(), what, ": signs and out must be on one device");
    TORCH_CHECK(period >= 1 && period <= (int64_t(1) << 30) && signs.numel() * 8 >= period + 64, what,
                ": signs must hold period + 64 bits, period at most 2**30");
    TORCH_CHECK(columns.size() == pieces.size() && starts.size() == pieces.size(), what,
                ": one column and one start per piece");
    const int64_t bins = out.numel() - 1;
    const int64_t count = static_cast<int64_t>(pieces.size());
    at::Tensor host = at::empty({lioncub::cuda::sketch_descriptor_length(count)},
                                at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    int64_t* counter = host.data_ptr<int64_t>();
    int64_t* row_start = counter + 1;
    int64_t* address = row_start + count + 1;
    int64_t* numel = address + count;
    int64_t* column = numel + count;
    int64_t* start = column + count;
    int64_t* kind = start + count;
    counter[0] = 0;
    row_start[0] = 0;
    for (int64_t p = 0; p < count; ++p) {
        const at::Tensor& piece = pieces[p];
        check_input(piece, kDevice, what);
        TORCH_CHECK(piece.device() == out.device(), what, ": piece ", p, " is not on out's device");
        TORCH_CHECK(columns[p] >= 0 && columns[p] < bins && starts[p] >= 0 && starts[p] < period, what, ": piece ", p,
                    " starts outside the bins or the period");
        kind[p] = static_cast<int64_t>(float_kind(piece, what));
        address[p] = reinterpret_cast<int64_t>(piece.data_ptr());
        numel[p] = piece.numel();
        column[p] = columns[p];
        start[p] = starts[p];
        row_start[p + 1] = row_start[p] + lioncub::cuda::sketch_rows_of(piece.numel(), columns[p], bins);
    }
    const int64_t total_rows = row_start[count];
    int64_t fold_size = 1;
    while (fold_size < bins) fold_size <<= 1;
    const c10::cuda::CUDAGuard guard(out.device());
    at::Tensor layout = host.to(out.device(), /*non_blocking=*/true);
    at::Tensor scratch = at::empty({fold_size}, out.options());
    lioncub::cuda::launch_sketch_and_squares(layout.data_ptr<int64_t>(), count, total_rows, bins,
                                             signs.data_ptr<uint8_t>(), period, out.data_ptr<double>(),
                                             scratch.data_ptr<double>(), fold_size,
                                             c10::cuda::getCurrentCUDAStream().stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The fused Lion step over the pieces of a bucket (see ../cpu/lioncub_packing.cpp for the semantics;
// scalars: beta1, 1 - beta1, beta2, 1 - beta2 per piece, rounded to fp32 here as torch rounds them).
void lion_direction_pack_signs(const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& grads,
                               const std::vector<double>& scalars, bool zero_is_positive, int64_t bits,
                               const at::Tensor& out)
{
    const char* what = "lion_direction_pack_signs";
    const int64_t total = lioncub::check_lion_pieces(exp_avgs, grads, scalars, bits, kDevice, what);
    check_out(out, kDevice, (total * bits + 7) / 8, what);
    const c10::cuda::CUDAGuard guard(out.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    C10_CUDA_CHECK(cudaMemsetAsync(out.data_ptr<uint8_t>(), 0, out.numel(), stream));
    int64_t offset = 0;
    for (size_t i = 0; i < exp_avgs.size(); ++i) {
        const double* sc = scalars.data() + 4 * i;
        lioncub::cuda::launch_lion_direction_pack(
            float_kind(exp_avgs[i], what), exp_avgs[i].data_ptr(), grads[i].data_ptr(), exp_avgs[i].numel(), offset,
            static_cast<float>(sc[0]), static_cast<float>(sc[1]), static_cast<float>(sc[2]), static_cast<float>(sc[3]),
            zero_is_positive, static_cast<int>(bits), out.data_ptr<uint8_t>(), out.numel(), stream);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        offset += exp_avgs[i].numel();
    }
}

// scalars: 1.0 if weight decay applies else 0.0, 1 - lr * wd, -lr per piece.
void apply_packed_signs(const at::Tensor& packed, const std::vector<at::Tensor>& params,
                        const std::vector<double>& scalars)
{
    const char* what = "apply_packed_signs";
    lioncub::check_apply_pieces(packed, params, scalars, kDevice, what);
    const c10::cuda::CUDAGuard guard(packed.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    int64_t offset = 0;
    for (size_t i = 0; i < params.size(); ++i) {
        const double* sc = scalars.data() + 3 * i;
        lioncub::cuda::launch_apply_packed_signs(float_kind(params[i], what), params[i].data_ptr(), params[i].numel(),
                                                 packed.data_ptr<uint8_t>(), offset, sc[0] != 0.0,
                                                 static_cast<float>(sc[1]), static_cast<float>(sc[2]), stream);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        offset += params[i].numel();
    }
}

std::string simd() { return "cuda"; }

}  // namespace

// The bindings touch no Python object while the kernels launch: they release the GIL.
using release_gil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.doc() = "ds_lioncub packing kernels (CUDA)";
    m.def("pack_signs", &pack_signs, py::arg("x"), py::arg("zero_is_positive"), py::arg("bits"), py::arg("out"),
          release_gil());
    m.def("unpack_signs", &unpack_signs, py::arg("packed"), py::arg("out"), release_gil());
    m.def("vote_packed_signs", &vote_packed_signs, py::arg("rows"), py::arg("numel"), py::arg("zero_is_positive"),
          py::arg("out"), release_gil());
    m.def("sum_fields", &sum_fields, py::arg("rows"), py::arg("bits"), py::arg("numel"), py::arg("out"), release_gil());
    m.def("pack_fields", &pack_fields, py::arg("values"), py::arg("bits"), py::arg("out"), release_gil());
    m.def("unpack_fields", &unpack_fields, py::arg("packed"), py::arg("bits"), py::arg("out"), release_gil());
    m.def("quantize_l1_pack", &quantize_l1_pack, py::arg("c"), py::arg("offsets"), py::arg("scales"),
          py::arg("levels"), py::arg("bits"), py::arg("out"), release_gil());
    m.def("lion_direction_pack_signs", &lion_direction_pack_signs, py::arg("exp_avgs"), py::arg("grads"),
          py::arg("scalars"), py::arg("zero_is_positive"), py::arg("bits"), py::arg("out"), release_gil());
    m.def("apply_packed_signs", &apply_packed_signs, py::arg("packed"), py::arg("params"), py::arg("scalars"),
          release_gil());
    // #47: the first generation's kernels, for the benchmarks' "before" (DS_LIONCUB_CUDA_KERNELS=v1), and the new
    // operations (the k-bit votes' field sums, the L1 scales from the means, option clip's sketch)
    m.def("pack_signs_v1", &pack_signs_v1, py::arg("x"), py::arg("zero_is_positive"), py::arg("bits"),
          py::arg("out"), release_gil());
    m.def("unpack_signs_v1", &unpack_signs_v1, py::arg("packed"), py::arg("out"), release_gil());
    m.def("vote_packed_signs_v1", &vote_packed_signs_v1, py::arg("rows"), py::arg("numel"),
          py::arg("zero_is_positive"), py::arg("out"), release_gil());
    m.def("vote_field_sums", &vote_field_sums, py::arg("rows"), py::arg("bits"), py::arg("numel"),
          py::arg("threshold"), py::arg("out"), release_gil());
    m.def("quantize_l1_means_pack", &quantize_l1_means_pack, py::arg("c"), py::arg("offsets"), py::arg("means"),
          py::arg("levels"), py::arg("clip"), py::arg("bits"), py::arg("out"), release_gil());
    m.def("sketch_and_squares", &sketch_and_squares, py::arg("pieces"), py::arg("columns"), py::arg("starts"),
          py::arg("signs"), py::arg("period"), py::arg("out"), release_gil());
    m.def("simd", &simd);
    m.attr("device") = "cuda";
    m.attr("max_voters") = lioncub::cuda::max_voters();
    m.attr("kernel_generation") = 2;
}
