// ds_lioncub packing kernels: layout and scalar helpers shared by the CPU (C++/OpenMP) and CUDA code; and, for
// the two ops' Python bindings only, their dtype dispatch and argument checks (at the end of this file).
//
// Layout (the same as ds_lioncub/comm/packing.py, least significant bit first):
//   signs:  element 8*i + j is bit j of byte i; 1 means +1, 0 means -1; padding bits are 0.
//   fields: b-bit unsigned fields (b in 1, 2, 4, 8), element (8/b)*i + j in bits [j*b, (j+1)*b) of byte i.
// A "group" is 8 consecutive elements: it occupies exactly `bits` bytes whatever the field width.
//
// Tie rule (zero_is_positive): an element counts as +1 when x > 0, or x == 0 (either sign of zero)
// with zero_is_positive; NaN counts as -1 (torch: x >= 0 and x > 0 are both false for NaN).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LIONCUB_HD __host__ __device__ __forceinline__
#else
#define LIONCUB_HD inline
#endif

namespace lioncub {

// ---------------------------------------------------------------- sign tests on raw bits

// 16-bit floats: `inf_bits` is the bit pattern of +inf (0x7F80 for bf16, 0x7C00 for fp16); any
// magnitude above it is a NaN.
LIONCUB_HD bool half_bits_positive(uint16_t h, uint16_t inf_bits, bool zero_is_positive)
{
    const uint16_t magnitude = h & 0x7FFF;
    if (magnitude > inf_bits) return false;  // NaN
    if (magnitude == 0) return zero_is_positive;
    return (h & 0x8000) == 0;
}

LIONCUB_HD bool float_positive(float x, bool zero_is_positive)
{
    return zero_is_positive ? (x >= 0.0f) : (x > 0.0f);
}

// ---------------------------------------------------------------- majority threshold

// Number of +1 votes (out of p) at or above which the vote is +1: 2k >= p with zero_is_positive
// (a tie is +1), 2k > p otherwise.
LIONCUB_HD uint32_t vote_threshold(int64_t p, bool zero_is_positive)
{
    return zero_is_positive ? static_cast<uint32_t>((p + 1) / 2) : static_cast<uint32_t>(p / 2 + 1);
}

// Bit planes needed to count up to p: bit_length(p).
LIONCUB_HD int count_planes(int64_t p)
{
    int planes = 0;
    while (p > 0) {
        ++planes;
        p >>= 1;
    }
    return planes;
}

// ---------------------------------------------------------------- SWAR field (un)packing of one group

// 8 one-byte values (byte j of `v` is element j, already < 2**bits) -> the group's `bits` bytes,
// returned in the low `8*bits` bits (little endian: byte 0 first).
LIONCUB_HD uint64_t gather_fields(uint64_t v, int bits)
{
    switch (bits) {
        case 1: return (v * 0x0102040810204080ull) >> 56;
        case 2:
            v = (v | (v >> 6)) & 0x000F000F000F000Full;
            v = (v | (v >> 12)) & 0x000000FF000000FFull;
            return (v | (v >> 24)) & 0xFFFFull;
        case 4:
            v = (v | (v >> 4)) & 0x00FF00FF00FF00FFull;
            v = (v | (v >> 8)) & 0x0000FFFF0000FFFFull;
            return (v | (v >> 16)) & 0xFFFFFFFFull;
        default: return v;
    }
}

// Inverse of gather_fields: the group's `bits` bytes (low bits of `w`) -> 8 one-byte fields.
LIONCUB_HD uint64_t spread_fields(uint64_t w, int bits)
{
    switch (bits) {
        case 1:
            w &= 0xFFull;
            w = (w | (w << 28)) & 0x0000000F0000000Full;
            w = (w | (w << 14)) & 0x0003000300030003ull;
            return (w | (w << 7)) & 0x0101010101010101ull;
        case 2:
            w &= 0xFFFFull;
            w = (w | (w << 24)) & 0x000000FF000000FFull;
            w = (w | (w << 12)) & 0x000F000F000F000Full;
            return (w | (w << 6)) & 0x0303030303030303ull;
        case 4:
            w &= 0xFFFFFFFFull;
            w = (w | (w << 16)) & 0x0000FFFF0000FFFFull;
            w = (w | (w << 8)) & 0x00FF00FF00FF00FFull;
            return (w | (w << 4)) & 0x0F0F0F0F0F0F0F0Full;
        default: return w;
    }
}

// An 8-bit sign mask (bit j = element j) -> the group's `bits` bytes with field j = bit j.
LIONCUB_HD uint64_t mask_to_fields(uint32_t mask8, int bits)
{
    if (bits == 1) return mask8 & 0xFFu;
    return gather_fields(spread_fields(mask8, 1), bits);
}

LIONCUB_HD uint64_t repeat_byte(uint32_t byte) { return 0x0101010101010101ull * (byte & 0xFFu); }

// ---------------------------------------------------------------- L1 quantizer, one element

// field = clamp(round_half_even(c * scale), -L, L) + L, with NaN -> q = 0 (torch turns a NaN into
// INT_MIN on the int32 cast, whose low byte plus L is L). `rounded` is round_half_even(c * scale),
// computed by the caller with its platform's exact round-to-nearest-even instruction.
LIONCUB_HD uint32_t l1_field_from_rounded(float rounded, int32_t levels)
{
    if (rounded != rounded) return static_cast<uint32_t>(levels);
    const float top = static_cast<float>(levels);
    float q = rounded < -top ? -top : rounded;
    q = q > top ? top : q;
    return static_cast<uint32_t>(static_cast<int32_t>(q) + levels);
}

}  // namespace lioncub

// ================================================================ bindings only: dtype dispatch, argument checks
//
// The CPU op (../cpu/lioncub_packing.cpp) and the CUDA op's bindings (../cuda/lioncub_packing_cuda.cpp) take
// the same arguments and must refuse the same mistakes with the same words: what follows is written once for
// both. The CUDA kernels (.cu, compiled by nvcc) need none of it and never see ATen through this header.
#if !defined(__CUDACC__)

#include <ATen/core/Tensor.h>

#include <vector>

// ---------------------------------------------------------------- dtype dispatch
//
// LIONCUB_DISPATCH_<SET>(TYPE, NAME, BODY) runs BODY, a lambda taking no argument, with `scalar_t` naming the
// C++ element type of TYPE (an at::ScalarType), and gives back what BODY returns. TYPE is evaluated once. A
// dtype outside the set is refused as "NAME: unsupported dtype <TYPE>", the words every binding has used. One
// switch for every site, so that a set is the same wherever it is accepted and a new dtype is added once.
// bool and uint8 share uint8_t: a bool is one byte holding 0 or 1, which is all the sign and field kernels
// read (data_ptr<uint8_t>() would refuse a bool tensor: bodies take static_cast<const scalar_t*>(data_ptr())).

#define LIONCUB_DISPATCH_CASE(ENUM, CTYPE, ...) \
    case ENUM: {                                \
        using scalar_t = CTYPE;                 \
        return __VA_ARGS__();                   \
    }

#define LIONCUB_DISPATCH_SWITCH(TYPE, NAME, ...)                                              \
    [&] {                                                                                     \
        const at::ScalarType lioncub_dispatch_type = (TYPE);                                  \
        switch (lioncub_dispatch_type) {                                                      \
            __VA_ARGS__                                                                       \
            default: TORCH_CHECK(false, NAME, ": unsupported dtype ", lioncub_dispatch_type); \
        }                                                                                     \
    }()

// fp32, bf16 and fp16: gradients, momenta, parameters and updates.
#define LIONCUB_FLOAT_CASES(...)                                    \
    LIONCUB_DISPATCH_CASE(at::kFloat, float, __VA_ARGS__)           \
    LIONCUB_DISPATCH_CASE(at::kBFloat16, at::BFloat16, __VA_ARGS__) \
    LIONCUB_DISPATCH_CASE(at::kHalf, at::Half, __VA_ARGS__)

// bool and uint8, both as uint8_t.
#define LIONCUB_BYTE_CASES(...) \
    case at::kBool:             \
        LIONCUB_DISPATCH_CASE(at::kByte, uint8_t, __VA_ARGS__)

// The floating dtypes (quantize_l1_pack, unpack_signs, the fused Lion step).
#define LIONCUB_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...) \
    LIONCUB_DISPATCH_SWITCH(TYPE, NAME, LIONCUB_FLOAT_CASES(__VA_ARGS__))

// pack_signs: the floating dtypes (the sign of each element) and bool / uint8 0-or-1 (the element itself).
#define LIONCUB_DISPATCH_SIGN_TYPES(TYPE, NAME, ...) \
    LIONCUB_DISPATCH_SWITCH(TYPE, NAME, LIONCUB_FLOAT_CASES(__VA_ARGS__) LIONCUB_BYTE_CASES(__VA_ARGS__))

// pack_fields: bool / uint8 and int32 values (the low byte is the field).
#define LIONCUB_DISPATCH_FIELD_TYPES(TYPE, NAME, ...)                  \
    LIONCUB_DISPATCH_SWITCH(TYPE, NAME, LIONCUB_BYTE_CASES(__VA_ARGS__) \
                            LIONCUB_DISPATCH_CASE(at::kInt, int32_t, __VA_ARGS__))

namespace lioncub {

// The bit patterns of +1 and -1 in a floating dtype, of its width (what unpack_signs writes).
template <typename T>
struct UnitBits;
template <>
struct UnitBits<float> {
    using type = uint32_t;
    static constexpr uint32_t plus = 0x3F800000u, minus = 0xBF800000u;
};
template <>
struct UnitBits<at::BFloat16> {
    using type = uint16_t;
    static constexpr uint16_t plus = 0x3F80, minus = 0xBF80;
};
template <>
struct UnitBits<at::Half> {
    using type = uint16_t;
    static constexpr uint16_t plus = 0x3C00, minus = 0xBC00;
};

// ---------------------------------------------------------------- argument checks
//
// `device` is the binding's own (at::kCPU or at::kCUDA); `what` names the function in every message. The two
// ops were published with differently worded device refusals; each keeps its own, chosen here by `device`.

inline void check_input(const at::Tensor& t, at::DeviceType device, const char* what)
{
    if (device == at::kCUDA) {
        TORCH_CHECK(t.is_cuda() && t.is_contiguous(), what, ": tensors must be contiguous CUDA tensors");
    } else {
        TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, ": input must be a contiguous CPU tensor");
    }
}

// An output of packed bytes: contiguous uint8 on the binding's device, at least `min_bytes` long.
inline void check_out(const at::Tensor& out, at::DeviceType device, int64_t min_bytes, const char* what)
{
    if (device == at::kCUDA) {
        check_input(out, device, what);
        TORCH_CHECK(out.scalar_type() == at::kByte, what, ": out must be uint8");
    } else {
        TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kByte && out.is_contiguous(), what,
                    ": out must be a contiguous CPU uint8 tensor");
    }
    TORCH_CHECK(out.numel() >= min_bytes, what, ": out holds ", out.numel(), " bytes, needs ", min_bytes);
}

inline void check_bits(int64_t bits, const char* what)
{
    TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, what, ": bits must be 1, 2, 4 or 8");
}

inline void check_packed(const at::Tensor& packed, const char* what)
{
    TORCH_CHECK(packed.scalar_type() == at::kByte, what, ": packed must be uint8");
}

// `packed` holds at least n sign bits.
inline void check_holds_signs(const at::Tensor& packed, int64_t n, const char* what)
{
    TORCH_CHECK(packed.numel() * 8 >= n, what, ": ", packed.numel(), " bytes hold fewer than ", n, " signs");
}

// `packed` holds at least n fields of `bits` bits.
inline void check_holds_fields(const at::Tensor& packed, int64_t bits, int64_t n, const char* what)
{
    TORCH_CHECK(packed.numel() * 8 >= n * bits, what, ": packed holds fewer than ", n, " fields");
}

// rows: one packed message per row (the server's gathered messages).
inline void check_rows(const at::Tensor& rows, const char* what)
{
    TORCH_CHECK(rows.scalar_type() == at::kByte && rows.dim() == 2, what, ": rows must be 2-d uint8");
}

// Each row holds at least numel sign bits.
inline void check_rows_hold_signs(const at::Tensor& rows, int64_t numel, const char* what)
{
    TORCH_CHECK(rows.size(1) * 8 >= numel, what, ": rows of ", rows.size(1), " bytes hold fewer than ", numel,
                " signs");
}

// Each row holds at least numel fields of `bits` bits.
inline void check_rows_hold_fields(const at::Tensor& rows, int64_t bits, int64_t numel, const char* what)
{
    TORCH_CHECK(rows.size(1) * 8 >= numel * bits, what, ": rows hold fewer than ", numel, " fields");
}

// quantize_l1_pack's field width, levels and per-segment arguments (the values of offsets are the caller's,
// or, on CPU, the binding's to check).
inline void check_l1_arguments(const at::Tensor& offsets, const at::Tensor& scales, int64_t levels, int64_t bits,
                               const char* what)
{
    TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, what, ": bits must be 2, 4 or 8");
    TORCH_CHECK(levels >= 1 && 2 * levels <= (int64_t(1) << bits) - 1, what, ": levels ", levels, " do not fit ",
                bits, "-bit fields");
    TORCH_CHECK(offsets.scalar_type() == at::kLong && scales.scalar_type() == at::kFloat &&
                    offsets.numel() == scales.numel() + 1,
                what, ": offsets (int64, nseg+1) and scales (fp32, nseg) disagree");
}

// The pieces of the fused Lion direction step: one gradient of the same dtype and size and four scalars per
// momentum. Returns the number of elements of all the pieces together.
inline int64_t check_lion_pieces(const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& grads,
                                 const std::vector<double>& scalars, int64_t bits, at::DeviceType device,
                                 const char* what)
{
    check_bits(bits, what);
    TORCH_CHECK(exp_avgs.size() == grads.size() && scalars.size() == 4 * exp_avgs.size(), what,
                ": one gradient and four scalars per momentum");
    int64_t total = 0;
    for (size_t i = 0; i < exp_avgs.size(); ++i) {
        check_input(exp_avgs[i], device, what);
        check_input(grads[i], device, what);
        TORCH_CHECK(exp_avgs[i].scalar_type() == grads[i].scalar_type() && exp_avgs[i].numel() == grads[i].numel(),
                    what, ": a momentum and its gradient differ in dtype or size");
        total += exp_avgs[i].numel();
    }
    return total;
}

// The fused apply step: packed sign bits for all the parameters, three scalars per parameter.
inline void check_apply_pieces(const at::Tensor& packed, const std::vector<at::Tensor>& params,
                               const std::vector<double>& scalars, at::DeviceType device, const char* what)
{
    check_input(packed, device, what);
    check_packed(packed, what);
    TORCH_CHECK(scalars.size() == 3 * params.size(), what, ": three scalars per parameter");
    int64_t total = 0;
    for (const auto& p : params) {
        check_input(p, device, what);
        total += p.numel();
    }
    check_holds_signs(packed, total, what);
}

}  // namespace lioncub

#endif  // !defined(__CUDACC__)
