// ds_lioncub packing kernels: layout and scalar helpers shared by the CPU (C++/OpenMP) and CUDA code; and, for
// the two ops' Python bindings only, their dtype dispatch (at the end of this file).
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

// ================================================================ bindings only: dtype dispatch
//
// The CPU op (../cpu/lioncub_packing.cpp) and the CUDA op's bindings (../cuda/lioncub_packing_cuda.cpp) take
// the same dtypes and must refuse the others with the same words: what follows is written once for both.
// The CUDA kernels (.cu, compiled by nvcc) need none of it and never see ATen through this header.
#if !defined(__CUDACC__)

#include <ATen/core/Tensor.h>

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

}  // namespace lioncub

#endif  // !defined(__CUDACC__)
