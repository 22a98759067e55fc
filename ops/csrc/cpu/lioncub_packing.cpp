// ds_lioncub packing kernels for CPU: C++ with at::parallel_for (OpenMP) and AVX2/F16C where the
// compiler targets it (-march=native, as DeepSpeed's CPU ops; AVX-512 too for option clip's sketch); a
// portable scalar path otherwise.
//
// Every kernel is bit-exact with the pure torch path in ds_lioncub/comm/packing.py (layout and tie
// rule: ../includes/lioncub_packing.h). Inputs are flat and contiguous; the caller (packing.py)
// allocates the outputs, so these functions only fill them.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>  // lighter than torch/extension.h: a 4x faster JIT build
#include <pybind11/stl.h>  // std::vector arguments of the fused step kernels

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>
#include <cmath>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "lioncub_packing.h"

namespace {

using lioncub::check_bits;
using lioncub::check_input;
using lioncub::check_out;
using lioncub::gather_fields;
using lioncub::mask_to_fields;
using lioncub::spread_fields;

// The device of this op's tensors, for the argument checks it shares with the CUDA bindings.
constexpr at::DeviceType kDevice = at::kCPU;

constexpr int64_t kGroupGrain = 1 << 14;  // groups of 8 elements per parallel task (128K elements)

inline uint64_t load_u64(const uint8_t* p)
{
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
}

inline void store_bytes(uint8_t* p, uint64_t v, int n) { std::memcpy(p, &v, n); }  // little endian

// ================================================================ sign masks, 32 elements at a time

#if defined(__AVX2__)
// The sign bits of 8 fp32 lanes under the tie rule. The compares are ordered (_OQ): a NaN lane is false, so
// it counts as -1, as the scalar float_positive does.
inline uint32_t sign_bits_8(__m256 v, bool zip)
{
    const __m256 zero = _mm256_setzero_ps();
    const __m256 c = zip ? _mm256_cmp_ps(v, zero, _CMP_GE_OQ) : _mm256_cmp_ps(v, zero, _CMP_GT_OQ);
    return static_cast<uint32_t>(_mm256_movemask_ps(c));
}

// The sign mask of 32 elements, 8 lanes at a time; widen8(k) gives elements 8k .. 8k+7 as fp32. Widening
// bf16 or fp16 to fp32 is exact and keeps the sign, zeros, infinities and NaNs, so the three float types
// share this one block and differ only in their load.
template <typename Widen8>
inline uint32_t sign_mask_32(Widen8 widen8, bool zip)
{
    uint32_t m = 0;
    for (int k = 0; k < 4; ++k) m |= sign_bits_8(widen8(k), zip) << (8 * k);
    return m;
}
#endif

template <typename T>
struct SignMask;

template <>
struct SignMask<float> {
    static uint32_t scalar(const float* x, int n, bool zip)
    {
        uint32_t m = 0;
        for (int j = 0; j < n; ++j) m |= static_cast<uint32_t>(lioncub::float_positive(x[j], zip)) << j;
        return m;
    }
    static uint32_t block32(const float* x, bool zip)
    {
#if defined(__AVX2__)
        return sign_mask_32([x](int k) { return _mm256_loadu_ps(x + 8 * k); }, zip);
#else
        return scalar(x, 32, zip);
#endif
    }
};

template <>
struct SignMask<at::BFloat16> {
    static uint32_t scalar(const at::BFloat16* x, int n, bool zip)
    {
        uint32_t m = 0;
        for (int j = 0; j < n; ++j)
            m |= static_cast<uint32_t>(lioncub::half_bits_positive(x[j].x, 0x7F80, zip)) << j;
        return m;
    }
    static uint32_t block32(const at::BFloat16* x, bool zip)
    {
#if defined(__AVX2__)
        const auto widen8 = [x](int k) {
            // bf16 -> fp32 is exact: the bf16 bits are the top half of the fp32 bits.
            const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * k));
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        };
        return sign_mask_32(widen8, zip);
#else
        return scalar(x, 32, zip);
#endif
    }
};

template <>
struct SignMask<at::Half> {
    static uint32_t scalar(const at::Half* x, int n, bool zip)
    {
        uint32_t m = 0;
        for (int j = 0; j < n; ++j)
            m |= static_cast<uint32_t>(lioncub::half_bits_positive(x[j].x, 0x7C00, zip)) << j;
        return m;
    }
    static uint32_t block32(const at::Half* x, bool zip)
    {
#if defined(__AVX2__) && defined(__F16C__)
        const auto widen8 = [x](int k) {
            return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * k)));
        };
        return sign_mask_32(widen8, zip);
#else
        return scalar(x, 32, zip);
#endif
    }
};

// bool / uint8 0-or-1 input: bit 0 of each byte is the sign bit (True = +1).
template <>
struct SignMask<uint8_t> {
    static uint32_t scalar(const uint8_t* x, int n, bool)
    {
        uint32_t m = 0;
        for (int j = 0; j < n; ++j) m |= static_cast<uint32_t>(x[j] & 1u) << j;
        return m;
    }
    static uint32_t block32(const uint8_t* x, bool)
    {
#if defined(__AVX2__)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        return static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(v, 7)));
#else
        uint32_t m = 0;
        for (int k = 0; k < 4; ++k)
            m |= static_cast<uint32_t>(gather_fields(load_u64(x + 8 * k) & 0x0101010101010101ull, 1)) << (8 * k);
        return m;
#endif
    }
};

// Writes the `bits` bytes of the group whose 8 sign bits are `mask8`.
inline void store_mask_group(uint8_t* out, uint32_t mask8, int bits)
{
    if (bits == 1) {
        *out = static_cast<uint8_t>(mask8);
    } else {
        store_bytes(out, mask_to_fields(mask8, bits), bits);
    }
}

// Writes the 4 groups (4 * `bits` bytes from `out`) whose 32 sign bits are `mask32`, group k in bits 8k ..
// 8k+7: one 4-byte store for 1-bit fields (the mask is already their layout), group by group otherwise.
inline void store_mask_block32(uint8_t* out, uint32_t mask32, int bits)
{
    if (bits == 1) {
        std::memcpy(out, &mask32, 4);
    } else {
        for (int k = 0; k < 4; ++k) store_mask_group(out + k * bits, (mask32 >> (8 * k)) & 0xFFu, bits);
    }
}

template <typename T>
void pack_signs_impl(const T* x, int64_t n, bool zip, int bits, uint8_t* out, int64_t nbytes)
{
    const int64_t full_groups = n / 8;
    at::parallel_for(0, full_groups, kGroupGrain, [&](int64_t g0, int64_t g1) {
        int64_t g = g0;
        for (; g + 4 <= g1; g += 4) store_mask_block32(out + g * bits, SignMask<T>::block32(x + 8 * g, zip), bits);
        for (; g < g1; ++g) store_mask_group(out + g * bits, SignMask<T>::scalar(x + 8 * g, 8, zip), bits);
    });
    int64_t written = full_groups * bits;
    const int rest = static_cast<int>(n - 8 * full_groups);
    if (rest > 0) {
        const uint64_t w = mask_to_fields(SignMask<T>::scalar(x + 8 * full_groups, rest, zip), bits);
        const int64_t take = std::min<int64_t>(bits, nbytes - written);
        store_bytes(out + written, w, static_cast<int>(take));
        written += take;
    }
    if (nbytes > written) std::memset(out + written, 0, nbytes - written);
}

// x: fp32 / bf16 / fp16 / bool (or uint8 0/1); fields of width `bits` holding 1 for +1, 0 for -1.
void pack_signs(const at::Tensor& x, bool zero_is_positive, int64_t bits, const at::Tensor& out)
{
    check_input(x, kDevice, "pack_signs");
    check_bits(bits, "pack_signs");
    const int64_t n = x.numel();
    check_out(out, kDevice, (n * bits + 7) / 8, "pack_signs");
    uint8_t* o = out.data_ptr<uint8_t>();
    const int b = static_cast<int>(bits);
    LIONCUB_DISPATCH_SIGN_TYPES(x.scalar_type(), "pack_signs", [&] {
        pack_signs_impl(static_cast<const scalar_t*>(x.data_ptr()), n, zero_is_positive, b, o, out.numel());
    });
}

// ================================================================ unpack signs to +1 / -1

template <typename Bits>
void unpack_signs_scalar(const uint8_t* packed, int64_t i0, int64_t i1, Bits plus, Bits minus, Bits* out)
{
    for (int64_t i = i0; i < i1; ++i) out[i] = ((packed[i >> 3] >> (i & 7)) & 1) ? plus : minus;
}

// A fresh multi-megabyte output costs more in first-touch page faults than in writing it (10x on
// the VM the benchmarks ran on). Asking for transparent huge pages on its 2 MiB-aligned interior,
// before the first write, makes that 512x fewer faults. Advice only: ignored where THP is off.
constexpr uintptr_t kHugePage = uintptr_t(2) << 20;

void advise_huge_pages(void* data, int64_t bytes)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes < int64_t(16) << 20) return;  // smaller ones mostly come back from malloc's heap, faulted in
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes)) & ~(kHugePage - 1);
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
    (void)data;
    (void)bytes;
#endif
}

// Outputs this large go out with non-temporal stores: they exceed the caches anyway, and streaming
// them skips the read-for-ownership of every output line (up to 2x less memory traffic).
constexpr int64_t kStreamBytes = int64_t(16) << 20;

#if defined(__AVX2__)
template <bool kStream>
inline void store256(void* p, __m256i v)
{
    if (kStream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
    } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
    }
}

template <bool kStream>
inline void unpack_bytes_32(const uint8_t* packed, int64_t b0, int64_t b1, uint32_t minus, uint32_t* out)
{
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
    const __m256i neg = _mm256_set1_epi32(static_cast<int>(minus));
    // four packed bytes (32 signs) per broadcast; byte k is tested against bits 8k .. 8k+7
    const __m256i bit1 = _mm256_slli_epi32(bit, 8), bit2 = _mm256_slli_epi32(bit, 16);
    const __m256i bit3 = _mm256_slli_epi32(bit, 24);
    int64_t b = b0;
    for (; b + 4 <= b1; b += 4) {
        uint32_t word;
        std::memcpy(&word, packed + b, 4);
        const __m256i w = _mm256_set1_epi32(static_cast<int>(word));
        // -1.0 with its sign bit cleared where the bit is set gives +1.0.
        const __m256i s0 = _mm256_cmpeq_epi32(_mm256_and_si256(w, bit), bit);
        const __m256i s1 = _mm256_cmpeq_epi32(_mm256_and_si256(w, bit1), bit1);
        const __m256i s2 = _mm256_cmpeq_epi32(_mm256_and_si256(w, bit2), bit2);
        const __m256i s3 = _mm256_cmpeq_epi32(_mm256_and_si256(w, bit3), bit3);
        store256<kStream>(out + 8 * b, _mm256_xor_si256(neg, _mm256_and_si256(s0, sign)));
        store256<kStream>(out + 8 * b + 8, _mm256_xor_si256(neg, _mm256_and_si256(s1, sign)));
        store256<kStream>(out + 8 * b + 16, _mm256_xor_si256(neg, _mm256_and_si256(s2, sign)));
        store256<kStream>(out + 8 * b + 24, _mm256_xor_si256(neg, _mm256_and_si256(s3, sign)));
    }
    for (; b < b1; ++b) {
        const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(packed[b]), bit), bit);
        store256<kStream>(out + 8 * b, _mm256_xor_si256(neg, _mm256_and_si256(set, sign)));
    }
    if (kStream) _mm_sfence();
}
#endif

// unpack_signs_raw: the sign bits as the raw +1 / -1 patterns of 4-byte (fp32) or 2-byte (bf16, fp16) elements.
void unpack_signs_raw(const uint8_t* packed, int64_t n, uint32_t plus, uint32_t minus, uint32_t* out)
{
    const int64_t full_bytes = n / 8;
    const bool stream = n * 4 >= kStreamBytes && reinterpret_cast<uintptr_t>(out) % 32 == 0;
    at::parallel_for(0, full_bytes, kGroupGrain, [&](int64_t b0, int64_t b1) {
        int64_t b = b0;
#if defined(__AVX2__)
        if (stream) {
            unpack_bytes_32<true>(packed, b0, b1, minus, out);
        } else {
            unpack_bytes_32<false>(packed, b0, b1, minus, out);
        }
        b = b1;
#endif
        unpack_signs_scalar(packed, 8 * b, 8 * b1, plus, minus, out);
    });
    unpack_signs_scalar(packed, 8 * full_bytes, n, plus, minus, out);
}

#if defined(__AVX2__)
template <bool kStream>
inline void unpack_pairs_16(const uint8_t* packed, int64_t b0, int64_t b1, uint16_t minus, uint16_t* out)
{
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          static_cast<short>(0x8000));
    const __m256i sign = _mm256_set1_epi16(static_cast<short>(0x8000));
    const __m256i neg = _mm256_set1_epi16(static_cast<short>(minus));
    for (int64_t b = b0; b < b1; ++b) {
        uint16_t word;
        std::memcpy(&word, packed + 2 * b, 2);
        const __m256i set =
            _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<short>(word)), bit), bit);
        store256<kStream>(out + 16 * b, _mm256_xor_si256(neg, _mm256_and_si256(set, sign)));
    }
    if (kStream) _mm_sfence();
}
#endif

void unpack_signs_raw(const uint8_t* packed, int64_t n, uint16_t plus, uint16_t minus, uint16_t* out)
{
    const int64_t full_pairs = n / 16;  // 16 elements (two packed bytes) per 256-bit store
    const bool stream = n * 2 >= kStreamBytes && reinterpret_cast<uintptr_t>(out) % 32 == 0;
    at::parallel_for(0, full_pairs, kGroupGrain, [&](int64_t b0, int64_t b1) {
        int64_t b = b0;
#if defined(__AVX2__)
        if (stream) {
            unpack_pairs_16<true>(packed, b0, b1, minus, out);
        } else {
            unpack_pairs_16<false>(packed, b0, b1, minus, out);
        }
        b = b1;
#endif
        unpack_signs_scalar(packed, 16 * b, 16 * b1, plus, minus, out);
    });
    unpack_signs_scalar(packed, 16 * full_pairs, n, plus, minus, out);
}

// out: fp32 / bf16 / fp16 with out.numel() elements, from the first out.numel() bits of `packed`.
void unpack_signs(const at::Tensor& packed, const at::Tensor& out)
{
    check_input(packed, kDevice, "unpack_signs");
    lioncub::check_packed(packed, "unpack_signs");
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous(), "unpack_signs: out must be contiguous on CPU");
    const int64_t n = out.numel();
    lioncub::check_holds_signs(packed, n, "unpack_signs");
    const uint8_t* p = packed.data_ptr<uint8_t>();
    advise_huge_pages(out.data_ptr(), n * static_cast<int64_t>(out.element_size()));
    LIONCUB_DISPATCH_FLOAT_TYPES(out.scalar_type(), "unpack_signs", [&] {
        using Unit = lioncub::UnitBits<scalar_t>;  // the overload of the dtype's width
        unpack_signs_raw(p, n, Unit::plus, Unit::minus, static_cast<typename Unit::type*>(out.data_ptr()));
    });
}

// ================================================================ fused 1-bit vote (server step)

constexpr int kMaxPlanes = 32;
constexpr int kVoteLanes = 8;                   // uint64 words per block
constexpr int64_t kVoteBlock = 8 * kVoteLanes;  // bytes per block

// Counts the set bits of p rows per bit position with bit-sliced adders (plane k holds bit k of
// every count) and writes the packed vote (count >= threshold). No unpacked bits are materialised.
inline void vote_block(const uint8_t* rows, int64_t stride, int64_t p, int planes, uint32_t threshold,
                       int64_t block_bytes, uint8_t* out)
{
    uint64_t P[kMaxPlanes][kVoteLanes];
    for (int k = 0; k < planes; ++k)
        for (int l = 0; l < kVoteLanes; ++l) P[k][l] = 0;
    for (int64_t r = 0; r < p; ++r) {
        const uint8_t* src = rows + r * stride;
        uint64_t x[kVoteLanes];
        if (block_bytes == kVoteBlock) {
            std::memcpy(x, src, kVoteBlock);
        } else {
            std::memset(x, 0, sizeof(x));
            std::memcpy(x, src, block_bytes);
        }
        for (int k = 0; k < planes; ++k) {
            for (int l = 0; l < kVoteLanes; ++l) {
                const uint64_t carry = P[k][l] & x[l];
                P[k][l] ^= x[l];
                x[l] = carry;
            }
        }
    }
    // count >= threshold, from the most significant plane down.
    uint64_t gt[kVoteLanes], eq[kVoteLanes];
    for (int l = 0; l < kVoteLanes; ++l) {
        gt[l] = 0;
        eq[l] = ~0ull;
    }
    for (int k = planes - 1; k >= 0; --k) {
        if ((threshold >> k) & 1u) {
            for (int l = 0; l < kVoteLanes; ++l) eq[l] &= P[k][l];
        } else {
            for (int l = 0; l < kVoteLanes; ++l) {
                gt[l] |= eq[l] & P[k][l];
                eq[l] &= ~P[k][l];
            }
        }
    }
    uint64_t result[kVoteLanes];
    for (int l = 0; l < kVoteLanes; ++l) result[l] = gt[l] | eq[l];
    std::memcpy(out, result, block_bytes);
}

#if defined(__AVX2__)
// The same bit-sliced count and comparison on two 256-bit vectors (64 bytes) at a time. PLANES is a
// compile-time constant for the usual voter counts (p < 64), so the planes live in registers.
template <int PLANES>
inline void vote_block_avx2(const uint8_t* rows, int64_t stride, int64_t p, int planes_rt, uint32_t threshold,
                            uint8_t* out)
{
    constexpr bool kFixed = PLANES > 0;
    const int planes = kFixed ? PLANES : planes_rt;
    __m256i P0[kFixed ? PLANES : kMaxPlanes], P1[kFixed ? PLANES : kMaxPlanes];
    for (int k = 0; k < planes; ++k) P0[k] = P1[k] = _mm256_setzero_si256();
    for (int64_t r = 0; r < p; ++r) {
        const uint8_t* src = rows + r * stride;
        __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
        for (int k = 0; k < planes; ++k) {
            const __m256i c0 = _mm256_and_si256(P0[k], x0), c1 = _mm256_and_si256(P1[k], x1);
            P0[k] = _mm256_xor_si256(P0[k], x0);
            P1[k] = _mm256_xor_si256(P1[k], x1);
            x0 = c0;
            x1 = c1;
        }
    }
    __m256i gt0 = _mm256_setzero_si256(), gt1 = gt0;
    __m256i eq0 = _mm256_set1_epi8(-1), eq1 = eq0;
    for (int k = planes - 1; k >= 0; --k) {
        if ((threshold >> k) & 1u) {
            eq0 = _mm256_and_si256(eq0, P0[k]);
            eq1 = _mm256_and_si256(eq1, P1[k]);
        } else {
            gt0 = _mm256_or_si256(gt0, _mm256_and_si256(eq0, P0[k]));
            gt1 = _mm256_or_si256(gt1, _mm256_and_si256(eq1, P1[k]));
            eq0 = _mm256_andnot_si256(P0[k], eq0);
            eq1 = _mm256_andnot_si256(P1[k], eq1);
        }
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_or_si256(gt0, eq0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_or_si256(gt1, eq1));
}

using VoteBlockFn = void (*)(const uint8_t*, int64_t, int64_t, int, uint32_t, uint8_t*);

inline VoteBlockFn vote_block_avx2_for(int planes)
{
    switch (planes) {
        case 1: return vote_block_avx2<1>;
        case 2: return vote_block_avx2<2>;
        case 3: return vote_block_avx2<3>;
        case 4: return vote_block_avx2<4>;
        case 5: return vote_block_avx2<5>;
        case 6: return vote_block_avx2<6>;
        default: return vote_block_avx2<0>;
    }
}
#endif

// rows: (p, stride) uint8, each row a packed sign message; out: the packed vote of the first
// `numel` positions, padding bits and bytes zero.
void vote_packed_signs(const at::Tensor& rows, int64_t numel, bool zero_is_positive, const at::Tensor& out)
{
    check_input(rows, kDevice, "vote_packed_signs");
    lioncub::check_rows(rows, "vote_packed_signs");
    const int64_t p = rows.size(0), stride = rows.size(1);
    const int64_t nbytes = (numel + 7) / 8;
    TORCH_CHECK(p >= 1 && p < (int64_t(1) << 31), "vote_packed_signs: need 1 <= p < 2**31 rows, got ", p);
    lioncub::check_rows_hold_signs(rows, numel, "vote_packed_signs");  // 8 * stride >= numel: stride >= nbytes
    check_out(out, kDevice, nbytes, "vote_packed_signs");
    const uint8_t* src = rows.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    const int planes = lioncub::count_planes(p);
    const uint32_t threshold = lioncub::vote_threshold(p, zero_is_positive);
    const int64_t blocks = (nbytes + kVoteBlock - 1) / kVoteBlock;
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (kVoteBlock * p));
#if defined(__AVX2__)
    const VoteBlockFn block_fn = vote_block_avx2_for(planes);
#endif
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
            const int64_t start = b * kVoteBlock;
            const int64_t block_bytes = std::min(kVoteBlock, nbytes - start);
#if defined(__AVX2__)
            if (block_bytes == kVoteBlock) {
                block_fn(src + start, stride, p, planes, threshold, dst + start);
                continue;
            }
#endif
            vote_block(src + start, stride, p, planes, threshold, block_bytes, dst + start);
        }
    });
    if (numel % 8) dst[nbytes - 1] &= static_cast<uint8_t>((1u << (numel % 8)) - 1);
    if (out.numel() > nbytes) std::memset(dst + nbytes, 0, out.numel() - nbytes);
}

// ================================================================ per-position sums of b-bit fields

// out[i] = sum over rows of field i (int32); for bits == 1 the number of +1 votes.
void sum_fields(const at::Tensor& rows, int64_t bits, int64_t numel, const at::Tensor& out)
{
    check_input(rows, kDevice, "sum_fields");
    lioncub::check_rows(rows, "sum_fields");
    check_bits(bits, "sum_fields");
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == at::kInt && out.numel() == numel,
                "sum_fields: out must be a contiguous CPU int32 tensor of numel elements");
    const int64_t p = rows.size(0), stride = rows.size(1);
    lioncub::check_rows_hold_fields(rows, bits, numel, "sum_fields");
    const uint8_t* src = rows.data_ptr<uint8_t>();
    int32_t* dst = out.data_ptr<int32_t>();
    advise_huge_pages(dst, numel * 4);
    const int b = static_cast<int>(bits);
    const int per_byte = 8 / b;
    const uint32_t mask = (1u << b) - 1;
    constexpr int64_t kChunk = 2048;  // elements per task step: the accumulators stay in L1
    const int64_t chunks = (numel + kChunk - 1) / kChunk;
    at::parallel_for(0, chunks, std::max<int64_t>(1, 32 / std::max<int64_t>(p, 1)), [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
            const int64_t e0 = c * kChunk, e1 = std::min(numel, e0 + kChunk);
            int32_t* acc = dst + e0;
            std::fill(acc, acc + (e1 - e0), 0);
            for (int64_t r = 0; r < p; ++r) {
                const uint8_t* row = src + r * stride;
                int64_t e = e0;
#if defined(__AVX2__)
                if (b == 1) {
                    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
                    for (; e + 8 <= e1; e += 8) {
                        const __m256i set =
                            _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(row[e >> 3]), bit), bit);
                        __m256i* a = reinterpret_cast<__m256i*>(dst + e);
                        _mm256_storeu_si256(a, _mm256_sub_epi32(_mm256_loadu_si256(a), set));
                    }
                }
#endif
                for (; e < e1; ++e)
                    dst[e] += static_cast<int32_t>((row[e / per_byte] >> ((e % per_byte) * b)) & mask);
            }
        }
    });
}

// ================================================================ b-bit fields from uint8 / int32 values

template <typename T>
inline uint64_t load_group(const T* v, int n, uint64_t field_mask)
{
    uint64_t w = 0;
    for (int j = 0; j < n; ++j) w |= (static_cast<uint64_t>(static_cast<uint8_t>(v[j])) & field_mask) << (8 * j);
    return w;
}

template <>
inline uint64_t load_group<uint8_t>(const uint8_t* v, int n, uint64_t field_mask)
{
    if (n == 8) return load_u64(v) & lioncub::repeat_byte(static_cast<uint32_t>(field_mask));
    uint64_t w = 0;
    std::memcpy(&w, v, n);
    return w & lioncub::repeat_byte(static_cast<uint32_t>(field_mask));
}

template <typename T>
void pack_fields_impl(const T* v, int64_t n, int bits, uint8_t* out, int64_t nbytes)
{
    const uint64_t field_mask = (1u << bits) - 1;
    const int64_t full_groups = n / 8;
    if (bits == 1 && std::is_same<T, uint8_t>::value) {
        pack_signs_impl(reinterpret_cast<const uint8_t*>(v), n, true, 1, out, nbytes);
        return;
    }
    at::parallel_for(0, full_groups, kGroupGrain, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g)
            store_bytes(out + g * bits, gather_fields(load_group(v + 8 * g, 8, field_mask), bits), bits);
    });
    int64_t written = full_groups * bits;
    const int rest = static_cast<int>(n - 8 * full_groups);
    if (rest > 0) {
        const uint64_t w = gather_fields(load_group(v + 8 * full_groups, rest, field_mask), bits);
        const int64_t take = std::min<int64_t>(bits, nbytes - written);
        store_bytes(out + written, w, static_cast<int>(take));
        written += take;
    }
    if (nbytes > written) std::memset(out + written, 0, nbytes - written);
}

// values: uint8 / bool / int32 (the low byte is the value), each < 2**bits; fields beyond 2**bits-1 are masked.
void pack_fields(const at::Tensor& values, int64_t bits, const at::Tensor& out)
{
    check_input(values, kDevice, "pack_fields");
    check_bits(bits, "pack_fields");
    const int64_t n = values.numel();
    check_out(out, kDevice, (n * bits + 7) / 8, "pack_fields");
    uint8_t* o = out.data_ptr<uint8_t>();
    const int b = static_cast<int>(bits);
    LIONCUB_DISPATCH_FIELD_TYPES(values.scalar_type(), "pack_fields", [&] {
        pack_fields_impl(static_cast<const scalar_t*>(values.data_ptr()), n, b, o, out.numel());
    });
}

// out: uint8 of out.numel() fields from `packed`.
void unpack_fields(const at::Tensor& packed, int64_t bits, const at::Tensor& out)
{
    check_input(packed, kDevice, "unpack_fields");
    lioncub::check_packed(packed, "unpack_fields");
    check_bits(bits, "unpack_fields");
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == at::kByte,
                "unpack_fields: out must be a contiguous CPU uint8 tensor");
    const int64_t n = out.numel();
    lioncub::check_holds_fields(packed, bits, n, "unpack_fields");
    const uint8_t* src = packed.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    advise_huge_pages(dst, n);
    const int b = static_cast<int>(bits);
    const int64_t full_groups = n / 8;
    at::parallel_for(0, full_groups, kGroupGrain, [&](int64_t g0, int64_t g1) {
        if (b == 8) {
            std::memcpy(dst + 8 * g0, src + 8 * g0, 8 * (g1 - g0));
            return;
        }
        for (int64_t g = g0; g < g1; ++g) {
            uint64_t w = 0;
            std::memcpy(&w, src + g * b, b);
            const uint64_t v = spread_fields(w, b);
            std::memcpy(dst + 8 * g, &v, 8);
        }
    });
    const int rest = static_cast<int>(n - 8 * full_groups);
    if (rest > 0) {
        uint64_t w = 0;
        std::memcpy(&w, src + full_groups * b, std::min<int64_t>(b, packed.numel() - full_groups * b));
        const uint64_t v = spread_fields(w, b);
        std::memcpy(dst + 8 * full_groups, &v, rest);
    }
}

// ================================================================ L1 quantize + pack

// Fields q + L of q = clamp(round_half_even(c * scale), -L, L) for elements [e0, e1) of one
// segment (one scale), into field bytes f[0 .. e1-e0).
template <typename T>
inline void l1_fields(const T* c, int64_t count, float scale, int32_t levels, uint8_t* f)
{
    int64_t i = 0;
#if defined(__AVX2__)
    if (std::is_same<T, float>::value) {
        const float* x = reinterpret_cast<const float*>(c);
        const __m256 s = _mm256_set1_ps(scale);
        const __m256 top = _mm256_set1_ps(static_cast<float>(levels));
        const __m256 bottom = _mm256_set1_ps(-static_cast<float>(levels));
        const __m256i shift = _mm256_set1_epi32(levels);
        const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                                              12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
        for (; i + 8 <= count; i += 8) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), s);
            const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
            __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm256_andnot_ps(nan, r);  // NaN -> 0
            r = _mm256_min_ps(_mm256_max_ps(r, bottom), top);
            const __m256i q = _mm256_add_epi32(_mm256_cvtps_epi32(r), shift);
            const __m256i bytes = _mm256_shuffle_epi8(q, pick);
            const uint32_t lo = static_cast<uint32_t>(_mm256_extract_epi32(bytes, 0));
            const uint32_t hi = static_cast<uint32_t>(_mm256_extract_epi32(bytes, 4));
            const uint64_t w = static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
            std::memcpy(f + i, &w, 8);
        }
    }
#endif
    for (; i < count; ++i) {
        const float v = static_cast<float>(c[i]) * scale;
        f[i] = static_cast<uint8_t>(lioncub::l1_field_from_rounded(std::nearbyint(v), levels));
    }
}

template <typename T>
void quantize_l1_pack_impl(const T* c, int64_t n, const int64_t* offsets, const float* scales, int64_t nseg,
                           int32_t levels, int bits, uint8_t* out, int64_t nbytes)
{
    constexpr int64_t kChunk = 4096;  // elements per step; a multiple of 8, so chunks start on a byte
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    const int64_t per_chunk_bytes = kChunk * bits / 8;
    at::parallel_for(0, chunks, 16, [&](int64_t c0, int64_t c1) {
        alignas(64) uint8_t fields[kChunk];
        for (int64_t ch = c0; ch < c1; ++ch) {
            const int64_t e0 = ch * kChunk, e1 = std::min(n, e0 + kChunk);
            // the segment holding e0: offsets is non-decreasing, offsets[0] = 0, offsets[nseg] = n.
            int64_t s = std::upper_bound(offsets, offsets + nseg + 1, e0) - offsets - 1;
            int64_t e = e0;
            while (e < e1) {
                while (offsets[s + 1] <= e) ++s;
                const int64_t end = std::min(e1, offsets[s + 1]);
                l1_fields(c + e, end - e, scales[s], levels, fields + (e - e0));
                e = end;
            }
            const int64_t count = e1 - e0;
            const int64_t groups = (count + 7) / 8;
            if (count % 8) std::memset(fields + count, 0, 8 - count % 8);
            uint8_t* o = out + ch * per_chunk_bytes;
            if (bits == 8) {
                std::memcpy(o, fields, count);
                continue;
            }
            const int64_t chunk_bytes = (count * bits + 7) / 8;
            for (int64_t g = 0; g < groups; ++g) {
                const uint64_t w = gather_fields(load_u64(fields + 8 * g), bits);
                store_bytes(o + g * bits, w, static_cast<int>(std::min<int64_t>(bits, chunk_bytes - g * bits)));
            }
        }
    });
    const int64_t used = (n * bits + 7) / 8;
    if (nbytes > used) std::memset(out + used, 0, nbytes - used);
}

// c: fp32 / bf16 / fp16 flat update; offsets: int64 [nseg + 1] segment boundaries (0 .. n);
// scales: fp32 [nseg], L / (clip * mu) of each segment as torch computes it (0 for mu == 0).
void quantize_l1_pack(const at::Tensor& c, const at::Tensor& offsets, const at::Tensor& scales, int64_t levels,
                      int64_t bits, const at::Tensor& out)
{
    check_input(c, kDevice, "quantize_l1_pack");
    check_input(offsets, kDevice, "quantize_l1_pack");
    check_input(scales, kDevice, "quantize_l1_pack");
    lioncub::check_l1_arguments(offsets, scales, levels, bits, "quantize_l1_pack");
    const int64_t n = c.numel();
    const int64_t nseg = scales.numel();
    const int64_t* off = offsets.data_ptr<int64_t>();
    TORCH_CHECK(off[0] == 0 && off[nseg] == n, "quantize_l1_pack: offsets must run from 0 to numel");
    for (int64_t s = 0; s < nseg; ++s)
        TORCH_CHECK(off[s] <= off[s + 1], "quantize_l1_pack: offsets must not decrease");
    check_out(out, kDevice, (n * bits + 7) / 8, "quantize_l1_pack");
    const float* sc = scales.data_ptr<float>();
    uint8_t* o = out.data_ptr<uint8_t>();
    const int b = static_cast<int>(bits);
    const int32_t L = static_cast<int32_t>(levels);
    LIONCUB_DISPATCH_FLOAT_TYPES(c.scalar_type(), "quantize_l1_pack", [&] {
        quantize_l1_pack_impl(c.data_ptr<scalar_t>(), n, off, sc, nseg, L, b, o, out.numel());
    });
}

// ================================================================ fused Lion step: direction + momentum + sign pack

// The scalars of one bucket piece, rounded as torch rounds them (see ds_lioncub/lion.py):
//   c  = copy_(m).mul_(beta1).add_(g, alpha=1-beta1)  in fp32:  fma(g, a1, fl(m * b1))
//   m' = m.mul_(beta2).add_(g, alpha=1-beta2)         fp32 m:   fma(g, a2, fl(m * b2))
// torch's CPU add_ with alpha is a fused multiply-add (vector body and scalar tail alike), and a
// Python float scalar becomes an fp32 scalar for fp32 tensors. bf16/fp16 momentum and gradients are
// widened to fp32 exactly for c, so c follows the same formula; their momentum update is NOT done
// here: torch's bf16/fp16 add_ with alpha rounds differently in its vectorised body and in its
// scalar remainder (measured), and which elements fall in which depends on torch's thread split and
// CPU capability, so the caller runs torch's own update_momentum for those pieces.
// The caller passes 1-beta1 and 1-beta2 as Python computed them (doubles).
struct DirectionScalars {
    float b1, a1, b2, a2;
};

inline DirectionScalars direction_scalars(const double* beta1_beta2)
{
    return DirectionScalars{static_cast<float>(beta1_beta2[0]), static_cast<float>(beta1_beta2[1]),
                            static_cast<float>(beta1_beta2[2]), static_cast<float>(beta1_beta2[3])};
}

// Element i's sign bit of c; fp32 momentum is updated in place, 16-bit momentum left to the caller.
template <typename T>
inline bool lion_element(T* m, const T* g, int64_t i, const DirectionScalars& s, bool zip)
{
    const float mf = static_cast<float>(m[i]);
    const float gf = static_cast<float>(g[i]);
    if constexpr (std::is_same<T, float>::value) m[i] = std::fma(gf, s.a2, mf * s.b2);
    return lioncub::float_positive(std::fma(gf, s.a1, mf * s.b1), zip);
}

// Up to 32 elements one by one; bit j of the result is element j's sign bit.
template <typename T>
inline uint32_t lion_scalar(T* m, const T* g, int n, const DirectionScalars& s, bool zip)
{
    uint32_t mask = 0;
    for (int j = 0; j < n; ++j) mask |= static_cast<uint32_t>(lion_element(m, g, j, s, zip)) << j;
    return mask;
}

template <typename T>
inline uint32_t lion_block32(T* m, const T* g, const DirectionScalars& s, bool zip)
{
    return lion_scalar(m, g, 32, s, zip);
}

#if defined(__AVX2__) && defined(__FMA__)
template <>
inline uint32_t lion_block32<float>(float* m, const float* g, const DirectionScalars& s, bool zip)
{
    const __m256 b1 = _mm256_set1_ps(s.b1), a1 = _mm256_set1_ps(s.a1);
    const __m256 b2 = _mm256_set1_ps(s.b2), a2 = _mm256_set1_ps(s.a2);
    // c of elements 8k .. 8k+7 for the shared sign block, their momentum updated in place on the way
    const auto direction8 = [&](int k) {
        const __m256 mv = _mm256_loadu_ps(m + 8 * k);
        const __m256 gv = _mm256_loadu_ps(g + 8 * k);
        // the same operand order as torch's vectorised add: fmadd(other, alpha, self)
        const __m256 c = _mm256_fmadd_ps(gv, a1, _mm256_mul_ps(mv, b1));
        _mm256_storeu_ps(m + 8 * k, _mm256_fmadd_ps(gv, a2, _mm256_mul_ps(mv, b2)));
        return c;
    };
    return sign_mask_32(direction8, zip);
}
#endif

// Sign fields of one bucket, written group by group (8 elements = `bits` bytes). Pieces start at any
// element, so the group a piece ends in may be finished by the next piece: its bits wait in `carry`.
struct SignFieldWriter {
    uint8_t* out;
    int bits;
    int64_t nbytes;
    int64_t offset = 0;  // elements written or waiting so far
    uint32_t carry = 0;  // sign bits of the open group, elements offset/8*8 .. offset-1

    void finish()
    {
        int64_t written = (offset / 8) * bits;
        if (offset % 8) {
            const int64_t take = std::min<int64_t>(bits, nbytes - written);
            store_bytes(out + written, mask_to_fields(carry, bits), static_cast<int>(take));
            written += take;
        }
        if (nbytes > written) std::memset(out + written, 0, nbytes - written);
    }
};

template <typename T>
void lion_piece(T* m, const T* g, int64_t n, const DirectionScalars& s, bool zip, SignFieldWriter& w)
{
    // head: finish the group the previous piece left open
    const int64_t open = w.offset % 8;
    const int64_t head = open == 0 ? 0 : std::min<int64_t>(n, 8 - open);
    if (head > 0) {
        w.carry |= lion_scalar(m, g, static_cast<int>(head), s, zip) << open;
        if (open + head == 8) {
            store_mask_group(w.out + (w.offset / 8) * w.bits, w.carry, w.bits);
            w.carry = 0;
        }
    }
    // body: whole groups, in parallel
    const int64_t groups = (n - head) / 8;
    T* mb = m + head;
    const T* gb = g + head;
    uint8_t* ob = w.out + ((w.offset + head) / 8) * w.bits;
    const int bits = w.bits;
    at::parallel_for(0, groups, kGroupGrain, [&](int64_t g0, int64_t g1) {
        int64_t q = g0;
        for (; q + 4 <= g1; q += 4)
            store_mask_block32(ob + q * bits, lion_block32(mb + 8 * q, gb + 8 * q, s, zip), bits);
        for (; q < g1; ++q) store_mask_group(ob + q * bits, lion_scalar(mb + 8 * q, gb + 8 * q, 8, s, zip), bits);
    });
    // tail: opens a new group
    const int64_t done = head + 8 * groups;
    if (n > done) w.carry = lion_scalar(m + done, g + done, static_cast<int>(n - done), s, zip);
    w.offset += n;
}

// For each piece i: c = Lion's pre-sign update of (exp_avgs[i], grads[i]) and, for fp32, exp_avgs[i]
// updated in place (bf16/fp16: see DirectionScalars); the sign fields of all the c's, one after the other,
// packed as pack_signs packs them into out (zero fields past the last element). c is never stored.
// scalars: 4 per piece (beta1, 1 - beta1, beta2, 1 - beta2). exp_avgs and grads: contiguous, the same dtype
// per piece (fp32, bf16 or fp16).
void lion_direction_pack_signs(const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& grads,
                               const std::vector<double>& scalars, bool zero_is_positive, int64_t bits,
                               const at::Tensor& out)
{
    const char* what = "lion_direction_pack_signs";
    const int64_t total = lioncub::check_lion_pieces(exp_avgs, grads, scalars, bits, kDevice, what);
    check_out(out, kDevice, (total * bits + 7) / 8, what);
    SignFieldWriter w{out.data_ptr<uint8_t>(), static_cast<int>(bits), out.numel()};
    for (size_t i = 0; i < exp_avgs.size(); ++i) {
        const double* sc = scalars.data() + 4 * i;
        const int64_t n = exp_avgs[i].numel();
        LIONCUB_DISPATCH_FLOAT_TYPES(exp_avgs[i].scalar_type(), what, [&] {
            lion_piece(exp_avgs[i].data_ptr<scalar_t>(), grads[i].data_ptr<scalar_t>(), n, direction_scalars(sc),
                       zero_is_positive, w);
        });
    }
    w.finish();
}

// ================================================================ fused Lion step: unpack the vote + apply

// p = p * (1 - lr*wd) - lr * s for s = +1/-1, as apply_update's mul_ then add_(delta, alpha=-lr):
// the decay product is rounded (to p's dtype) before the add, never fused with it (this file is built
// with -ffp-contract=off); -lr * s is exact, so torch's fused add is a plain add. bf16/fp16 params
// compute in fp32 and round to the dtype after each of the two operations.
struct ApplyScalars {
    bool has_decay;
    float decay, neg_lr;
};

template <typename T>
inline void apply_element(T* p, int64_t i, bool plus, const ApplyScalars& s)
{
    const float step = plus ? s.neg_lr : -s.neg_lr;
    float v = static_cast<float>(p[i]);
    if (s.has_decay) v = static_cast<float>(T(v * s.decay));
    p[i] = T(v + step);
}

template <typename T>
inline void apply_scalar(T* p, int64_t i0, int64_t i1, const uint8_t* packed, int64_t bit0, const ApplyScalars& s)
{
    for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = bit0 + i;
        apply_element(p, i, ((packed[b >> 3] >> (b & 7)) & 1u) != 0, s);
    }
}

// Elements [8*q0, 8*q1) of p, whose bits are whole bytes bytes[q0 .. q1).
template <typename T>
inline void apply_groups(T* p, int64_t q0, int64_t q1, const uint8_t* bytes, const ApplyScalars& s)
{
    int64_t q = q0;
#if defined(__AVX2__)
    if (std::is_same<T, float>::value) {
        float* x = reinterpret_cast<float*>(p);
        const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        const __m256 minus_step = _mm256_set1_ps(-s.neg_lr);  // the step of a -1 vote: +lr
        const __m256 plus_step = _mm256_set1_ps(s.neg_lr);    // the step of a +1 vote: -lr
        const __m256 decay = _mm256_set1_ps(s.decay);
        for (; q < q1; ++q) {
            const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bytes[q]), bit), bit);
            const __m256 step = _mm256_blendv_ps(minus_step, plus_step, _mm256_castsi256_ps(set));
            __m256 v = _mm256_loadu_ps(x + 8 * q);
            if (s.has_decay) v = _mm256_mul_ps(v, decay);
            _mm256_storeu_ps(x + 8 * q, _mm256_add_ps(v, step));
        }
    }
#endif
    for (; q < q1; ++q) apply_scalar(p + 8 * q, 0, 8, bytes + q, 0, s);
}

template <typename T>
void apply_piece(T* p, int64_t n, const uint8_t* packed, int64_t offset, const ApplyScalars& s)
{
    const int64_t open = offset % 8;
    const int64_t head = open == 0 ? 0 : std::min<int64_t>(n, 8 - open);
    apply_scalar(p, 0, head, packed, offset, s);
    const int64_t groups = (n - head) / 8;
    T* pb = p + head;
    const uint8_t* bytes = packed + (offset + head) / 8;
    at::parallel_for(0, groups, kGroupGrain, [&](int64_t q0, int64_t q1) { apply_groups(pb, q0, q1, bytes, s); });
    apply_scalar(p, head + 8 * groups, n, packed, offset, s);
}

// For each piece i (one after the other in the sign bits of `packed`): params[i] = params[i] * decay - lr * s.
// scalars: 3 per piece (1.0 if weight decay applies else 0.0, 1 - lr*wd, -lr). params: contiguous fp32,
// bf16 or fp16.
void apply_packed_signs(const at::Tensor& packed, const std::vector<at::Tensor>& params,
                        const std::vector<double>& scalars)
{
    const char* what = "apply_packed_signs";
    lioncub::check_apply_pieces(packed, params, scalars, kDevice, what);
    const uint8_t* bits = packed.data_ptr<uint8_t>();
    int64_t offset = 0;
    for (size_t i = 0; i < params.size(); ++i) {
        const double* sc = scalars.data() + 3 * i;
        const ApplyScalars s{sc[0] != 0.0, static_cast<float>(sc[1]), static_cast<float>(sc[2])};
        const int64_t n = params[i].numel();
        LIONCUB_DISPATCH_FLOAT_TYPES(params[i].scalar_type(), what, [&] {
            apply_piece(params[i].data_ptr<scalar_t>(), n, bits, offset, s);
        });
        offset += n;
    }
}

// ================================================================ option clip's sketch (ds_lioncub/step/clipping.py)
//
// Element i of a piece goes to bin (column + i) mod K with sign bit (start + i) mod period of `signs` (1 = +1,
// the pack_signs layout). Each bin adds its elements' signed fp32 values (bf16 and fp16 widened exactly) in fp64,
// one after another in element order, the pieces in the order given, continuing from what `out` holds; a second
// row of K bins adds their squares (exact in fp64) the same way, and those K sums are folded pairwise
// (sketch_fold). Every addition's operands are thus fixed, whatever the SIMD width or the thread split: the
// threads own disjoint ranges of bins, the lanes of a vector add into distinct bins, and where a block of rows
// is added at once each bin still adds them one row after another (in a register, before one store: the bins'
// loads and stores, not the gradient's reads, would otherwise bound the kernel).

constexpr int kSketchRows = 4;                  // rows added per load and store of the bins
constexpr uintptr_t kSketchPrefetchBytes = 2048;  // how far ahead in each row the kernel prefetches

#if defined(__AVX512F__)
constexpr int kSketchWidth = 16;  // elements per step: one vector of fp32, two of fp64 (a multiple of 8)
inline __m512 sketch_load(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 sketch_load(const at::BFloat16* x)
{
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 sketch_load(const at::Half* x)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
template <typename T>
constexpr bool kSketchVector = std::is_same<T, float>::value || std::is_same<T, at::BFloat16>::value ||
                               std::is_same<T, at::Half>::value;

// Adds the signed values and squares of x[0 .. 16) (signs from bit 0 of `bits`) into the accumulators.
template <typename T>
inline void sketch_vector_add(const T* x, uint64_t bits, __m512d* s, __m512d* q)
{
    const __m512i v = _mm512_castps_si512(sketch_load(x));
    const __mmask16 minus = static_cast<__mmask16>(~bits & 0xFFFFu);  // the lanes whose sign is -1 flip
    const __m512 signed_v =
        _mm512_castsi512_ps(_mm512_mask_xor_epi32(v, minus, v, _mm512_set1_epi32(static_cast<int>(0x80000000u))));
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(signed_v));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(signed_v), 1)));
    s[0] = _mm512_add_pd(s[0], lo);
    s[1] = _mm512_add_pd(s[1], hi);
    q[0] = _mm512_fmadd_pd(lo, lo, q[0]);  // the square is exact, so fusing its add rounds as the add alone
    q[1] = _mm512_fmadd_pd(hi, hi, q[1]);
}
// fp32: each half converted straight from memory, its signs flipped in fp64 (the same value: a sign flip is exact
// either side of the widening), which saves the shuffle of a 16-lane register into halves.
template <>
inline void sketch_vector_add<float>(const float* x, uint64_t bits, __m512d* s, __m512d* q)
{
    const __m512i sign = _mm512_set1_epi64(static_cast<long long>(0x8000000000000000ull));
    const uint64_t minus = ~bits;  // the lanes whose sign is -1 flip
    for (int h = 0; h < 2; ++h) {
        const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + 8 * h));
        const __m512i vi = _mm512_castpd_si512(v);
        const __m512d signed_v = _mm512_castsi512_pd(
            _mm512_mask_xor_epi64(vi, static_cast<__mmask8>((minus >> (8 * h)) & 0xFFu), vi, sign));
        s[h] = _mm512_add_pd(s[h], signed_v);
        q[h] = _mm512_fmadd_pd(v, v, q[h]);
    }
}
inline void sketch_vector_load(const double* p, __m512d* v)
{
    v[0] = _mm512_loadu_pd(p);
    v[1] = _mm512_loadu_pd(p + 8);
}
inline void sketch_vector_store(double* p, const __m512d* v)
{
    _mm512_storeu_pd(p, v[0]);
    _mm512_storeu_pd(p + 8, v[1]);
}
using SketchAccumulator = __m512d;
#elif defined(__AVX2__)
constexpr int kSketchWidth = 8;
inline __m256 sketch_load(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 sketch_load(const at::BFloat16* x)
{
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#if defined(__F16C__)
inline __m256 sketch_load(const at::Half* x)
{
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}
#endif
template <typename T>
constexpr bool kSketchVector = std::is_same<T, float>::value || std::is_same<T, at::BFloat16>::value
#if defined(__F16C__)
                               || std::is_same<T, at::Half>::value
#endif
    ;

template <typename T>
inline void sketch_vector_add(const T* x, uint64_t bits, __m256d* s, __m256d* q)
{
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i b = _mm256_set1_epi32(static_cast<int>(bits & 0xFFu));
    // all ones in the lanes whose sign is -1: their sign bit flips
    const __m256i minus = _mm256_cmpeq_epi32(_mm256_and_si256(b, bit), _mm256_setzero_si256());
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
    const __m256 v = _mm256_xor_ps(sketch_load(x), _mm256_and_ps(_mm256_castsi256_ps(minus), sign));
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    s[0] = _mm256_add_pd(s[0], lo);
    s[1] = _mm256_add_pd(s[1], hi);
    q[0] = _mm256_add_pd(q[0], _mm256_mul_pd(lo, lo));
    q[1] = _mm256_add_pd(q[1], _mm256_mul_pd(hi, hi));
}
inline void sketch_vector_load(const double* p, __m256d* v)
{
    v[0] = _mm256_loadu_pd(p);
    v[1] = _mm256_loadu_pd(p + 4);
}
inline void sketch_vector_store(double* p, const __m256d* v)
{
    _mm256_storeu_pd(p, v[0]);
    _mm256_storeu_pd(p + 4, v[1]);
}
using SketchAccumulator = __m256d;
#endif

// Rows 0 .. kRows-1 of x (`stride` elements apart), columns [0, n) of each, into bins [0, n) of `sums` and
// `squares`: bin j adds x[j], x[stride + j], ... one row after another. Row r's signs are the consecutive bits
// from table position t[r] (the caller splits the columns where a row's position would pass the period's end).
template <typename T, int kRows>
void sketch_rows_straight(const T* x, int64_t stride, int64_t n, const uint8_t* signs, const int64_t* t,
                          double* sums, double* squares)
{
    const uint8_t* bytes[kRows];
    int shift[kRows];
    for (int r = 0; r < kRows; ++r) {
        bytes[r] = signs + (t[r] >> 3);
        shift[r] = static_cast<int>(t[r] & 7);
    }
    int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    if constexpr (kSketchVector<T>) {
        for (; j + kSketchWidth <= n; j += kSketchWidth) {
            SketchAccumulator s[2], q[2];
            sketch_vector_load(sums + j, s);
            sketch_vector_load(squares + j, q);
            for (int r = 0; r < kRows; ++r) {
                const T* at = x + r * stride + j;
                // kRows streams a stride apart: the hardware prefetcher alone leaves the kernel waiting on memory
                // (8 Mi elements: 0.20 -> 0.13 ns per element); a prefetch past the end is dropped, never faults
                _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(at) + kSketchPrefetchBytes),
                             _MM_HINT_T0);
                // the row's next signs: bits shift .. shift + kSketchWidth - 1 of the 64 read
                sketch_vector_add(at, load_u64(bytes[r] + (j >> 3)) >> shift[r], s, q);
            }
            sketch_vector_store(sums + j, s);
            sketch_vector_store(squares + j, q);
        }
    }
#endif
    for (; j < n; ++j) {
        for (int r = 0; r < kRows; ++r) {
            const float v = static_cast<float>(x[r * stride + j]);
            const int64_t bit = t[r] + j;
            const double d = static_cast<double>(((signs[bit >> 3] >> (bit & 7)) & 1u) ? v : -v);
            sums[j] += d;
            squares[j] += d * d;  // exact: a float's square fits a double's 53 bits (no fma: -ffp-contract=off)
        }
    }
}

// sketch_rows_straight for rows whose first table positions are first[r] < period: the columns are cut wherever a
// row's position reaches the period's end (more than once in a row longer than the period), and each part starts
// its rows at their positions modulo the period.
template <typename T, int kRows>
void sketch_rows(const T* x, int64_t stride, int64_t n, const uint8_t* signs, int64_t period, const int64_t* first,
                 double* sums, double* squares)
{
    for (int64_t a = 0; a < n;) {
        int64_t t[kRows];
        int64_t b = n;
        for (int r = 0; r < kRows; ++r) {
            t[r] = (first[r] + a) % period;
            b = std::min(b, a + period - t[r]);
        }
        sketch_rows_straight<T, kRows>(x + a, stride, b - a, signs, t, sums + a, squares + a);
        a = b;
    }
}

// The elements of one piece whose bins fall in [b0, b1): the first row fills bins column .. K-1, each next
// one 0 .. K-1 (whole rows kSketchRows at a time), the last maybe fewer; a row's part inside the range is added.
template <typename T>
void sketch_piece(const T* x, int64_t n, int64_t column, int64_t start, const uint8_t* signs, int64_t period,
                  int64_t bins, int64_t b0, int64_t b1, double* sums, double* squares)
{
    int64_t i = 0;  // the element at the start of the current row (bin c)
    int64_t c = column;
    while (i < n) {
        const int64_t whole = c == 0 ? (n - i) / bins : 0;  // whole rows from here
        const int rows = whole >= kSketchRows ? kSketchRows : 1;
        const int64_t length = std::min(bins - c, n - i);
        const int64_t lo = std::max(c, b0), hi = std::min(c + length, b1);
        if (lo < hi) {
            int64_t first[kSketchRows];
            for (int r = 0; r < rows; ++r) first[r] = (start + i + r * bins + (lo - c)) % period;
            const T* at = x + i + (lo - c);
            if (rows == kSketchRows) {
                sketch_rows<T, kSketchRows>(at, bins, hi - lo, signs, period, first, sums + lo, squares + lo);
            } else {
                sketch_rows<T, 1>(at, bins, hi - lo, signs, period, first, sums + lo, squares + lo);
            }
        }
        i += rows == kSketchRows ? rows * bins : length;
        c = 0;
    }
}

// The sum of v: padded with zeros to the next power of two, then v[i] += v[i + h] for h = half, a quarter, ..., 1.
double sketch_fold(std::vector<double> v)
{
    size_t size = 1;
    while (size < v.size()) size <<= 1;
    v.resize(size, 0.0);
    for (size_t h = size / 2; h >= 1; h /= 2)
        for (size_t i = 0; i < h; ++i) v[i] = v[i] + v[i + h];
    return v[0];
}

constexpr int64_t kSketchParallel = int64_t(1) << 18;  // elements below which one thread sketches alone
constexpr int64_t kSketchBinGrain = 512;                // bins per parallel task at least

// out (fp64, K + 1): bins 0 .. K-1 add the sketch of the pieces, out[K] the fold of their squares' bins.
// pieces: fp32 / bf16 / fp16, contiguous; columns[p] < K and starts[p] < period for each; signs: uint8 holding
// period + 64 bits, the last 64 a copy of the first 64.
void sketch_and_squares(const std::vector<at::Tensor>& pieces, const std::vector<int64_t>& columns,
                        const std::vector<int64_t>& starts, const at::Tensor& signs, int64_t period,
                        const at::Tensor& out)
{
    const char* what = "sketch_and_squares";
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kDouble && out.is_contiguous() && out.numel() >= 2,
                what, ": out must be a contiguous CPU float64 tensor of bins + 1 >= 2 elements");
    check_input(signs, kDevice, what);
    lioncub::check_packed(signs, what);
    TORCH_CHECK(period >= 1 && signs.numel() * 8 >= period + 64, what, ": signs must hold period + 64 bits");
    TORCH_CHECK(columns.size() == pieces.size() && starts.size() == pieces.size(), what,
                ": one column and one start per piece");
    const int64_t bins = out.numel() - 1;
    int64_t total = 0;
    for (size_t p = 0; p < pieces.size(); ++p) {
        check_input(pieces[p], kDevice, what);
        TORCH_CHECK(columns[p] >= 0 && columns[p] < bins && starts[p] >= 0 && starts[p] < period, what,
                    ": piece ", p, " starts outside the bins or the period");
        LIONCUB_DISPATCH_FLOAT_TYPES(pieces[p].scalar_type(), what, [] {});  // refuses other dtypes, here
        total += pieces[p].numel();
    }
    const uint8_t* table = signs.data_ptr<uint8_t>();
    double* sums = out.data_ptr<double>();
    std::vector<double> squares(bins, 0.0);
    at::parallel_for(0, bins, total >= kSketchParallel ? kSketchBinGrain : bins, [&](int64_t b0, int64_t b1) {
        for (size_t p = 0; p < pieces.size(); ++p) {
            const at::Tensor& piece = pieces[p];
            LIONCUB_DISPATCH_FLOAT_TYPES(piece.scalar_type(), what, [&] {
                sketch_piece(static_cast<const scalar_t*>(piece.data_ptr()), piece.numel(), columns[p], starts[p],
                             table, period, bins, b0, b1, sums, squares.data());
            });
        }
    });
    sums[bins] = sums[bins] + sketch_fold(std::move(squares));
}

std::string simd()
{
    std::string s;
#if defined(__AVX2__)
    s += "avx2";
#if defined(__F16C__)
    s += "+f16c";
#endif
#if defined(__AVX512F__)
    s += "+avx512f (the clip's sketch)";
#endif
#else
    s += "scalar";
#endif
    return s;
}

}  // namespace

// The kernels touch no Python object: they release the GIL while they run.
using release_gil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.doc() = "ds_lioncub packing kernels (CPU)";
    m.def("pack_signs", &pack_signs, "sign fields (1 = +1) of x into out", py::arg("x"), py::arg("zero_is_positive"),
          py::arg("bits"), py::arg("out"), release_gil());
    m.def("unpack_signs", &unpack_signs, "+1/-1 into out from packed sign bits", py::arg("packed"), py::arg("out"),
          release_gil());
    m.def("vote_packed_signs", &vote_packed_signs, "fused count -> vote -> pack over (p, nbytes) rows",
          py::arg("rows"), py::arg("numel"), py::arg("zero_is_positive"), py::arg("out"), release_gil());
    m.def("sum_fields", &sum_fields, "int32 per-position sums of b-bit fields over rows", py::arg("rows"),
          py::arg("bits"), py::arg("numel"), py::arg("out"), release_gil());
    m.def("pack_fields", &pack_fields, "b-bit fields into out", py::arg("values"), py::arg("bits"), py::arg("out"),
          release_gil());
    m.def("unpack_fields", &unpack_fields, "b-bit fields into uint8 out", py::arg("packed"), py::arg("bits"),
          py::arg("out"), release_gil());
    m.def("quantize_l1_pack", &quantize_l1_pack, "L1 quantize (per-segment scales) and pack", py::arg("c"),
          py::arg("offsets"), py::arg("scales"), py::arg("levels"), py::arg("bits"), py::arg("out"), release_gil());
    m.def("lion_direction_pack_signs", &lion_direction_pack_signs,
          "fused Lion direction + momentum update + sign pack over bucket pieces", py::arg("exp_avgs"),
          py::arg("grads"), py::arg("scalars"), py::arg("zero_is_positive"), py::arg("bits"), py::arg("out"),
          release_gil());
    m.def("apply_packed_signs", &apply_packed_signs, "fused unpack of voted signs + Lion parameter update",
          py::arg("packed"), py::arg("params"), py::arg("scalars"), release_gil());
    m.def("sketch_and_squares", &sketch_and_squares,
          "option clip's sketch: signed sums and squares of pieces into bins, added to out (fp64, bins + 1)",
          py::arg("pieces"), py::arg("columns"), py::arg("starts"), py::arg("signs"), py::arg("period"),
          py::arg("out"), release_gil());
    m.def("simd", &simd, "instruction set the kernels were compiled for");
    m.attr("device") = "cpu";
}
