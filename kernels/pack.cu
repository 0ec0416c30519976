// Data movement: copy, zero-fill, cast, and batches of moves (pack params into a padded flat
// buffer, unpack them).
#include "common.cuh"

namespace fsdp {

template <class S, class D, Convert C>
struct CastOp {
  const typename S::Bits* src;
  typename D::Bits* dst;
  template <int N>
  using Regs = Raw<typename S::Bits, N>;
  __device__ __forceinline__ int steps() const { return 1; }
  template <int N>
  __device__ __forceinline__ void load(int, uint64_t i, Regs<N>& r) const {
    r.load(src + i);
  }
  // Between the 16-bit types a chunk with no NaN converts a word at a time, with no test of the
  // floats: none of them is a NaN.
  template <int N>
  __device__ __forceinline__ void store(uint64_t i, const Regs<N>& r) const {
    constexpr bool kBetween16Bit = sizeof(typename S::Bits) == 2 && sizeof(typename D::Bits) == 2;
    if constexpr (N > 1 && kBetween16Bit && C == Convert::kPairs) {
      if (!words_hold_nan<S>(r.w)) {
        Raw<typename D::Bits, N> out;
#pragma unroll
        for (int k = 0; k < N / 2; ++k) {
          const float2 pair = S::pair_to_f32(r.w[k]);
          out.w[k] = D::pair_from_f32(pair.x, pair.y);
        }
        out.store(dst + i);
        return;
      }
    }
    // A cast between the 16-bit types that gets here has a NaN in its chunk (or is a one-wave
    // twin): one element at a time, with no second test.
    constexpr Convert kRest = kBetween16Bit ? Convert::kEach : C;
    float x[N];
    to_floats<S, N, kRest>(r, x);
    store_floats<D>(dst + i, x);
  }
};

template <class S, class D, int U, Convert C>
__device__ __forceinline__ void cast(const typename S::Bits* src, typename D::Bits* dst,
                                     uint64_t n) {
  // A chunk is one vector of the wider type (see `elementwise`): the fewer elements per vector.
  constexpr int kS = kPerVector<typename S::Bits>;
  constexpr int kD = kPerVector<typename D::Bits>;
  Phase phase;
  phase.add(src);
  phase.add(dst);
  elementwise<(kS < kD ? kS : kD), U>(CastOp<S, D, C>{src, dst}, n, phase, grid_stride());
}

}  // namespace fsdp

using fsdp::kBlock;

extern "C" __global__ void __launch_bounds__(kBlock) fill_zero_bytes(uint8_t* dst, uint64_t bytes) {
  fsdp::zero_range<uint8_t, fsdp::kMoveRound>(dst, bytes, fsdp::grid_stride());
}

// `copy_<name>`, and `move_many_<name>`: the spans of a batch on blocks of their own, each
// copied, or zero-filled when it has no source (pack and unpack, whose params can be of any
// sizes side by side); each with its `_wave` twin (see `kWaveRound`), compiled for a full SM so
// that its wave is as large as the copy's.
#define FSDP_MOVES_ROUND(prefix, T, U, bounds)                                                    \
  extern "C" __global__ void bounds copy_##prefix(const T::Bits* src, T::Bits* dst, uint64_t n) { \
    fsdp::copy_range<T::Bits, U>(src, dst, n, fsdp::grid_stride());                              \
  }                                                                                               \
  extern "C" __global__ void bounds move_many_##prefix(const fsdp::SpanBatch batch) {             \
    fsdp::for_span_part(batch, [&](const fsdp::Span& span, const auto& at) {                      \
      T::Bits* dst = reinterpret_cast<T::Bits*>(span.dst);                                        \
      if (span.src != 0) {                                                                        \
        fsdp::copy_range<T::Bits, U>(reinterpret_cast<const T::Bits*>(span.src), dst, span.n, at); \
      } else {                                                                                    \
        fsdp::zero_range<T::Bits, U>(dst, span.n, at);                                            \
      }                                                                                           \
    });                                                                                           \
  }

#define FSDP_MOVES(name, T)                                                          \
  FSDP_MOVES_ROUND(name, T, fsdp::kMoveRound, __launch_bounds__(kBlock))             \
  FSDP_MOVES_ROUND(wave_##name, T, fsdp::kWaveRound, __launch_bounds__(kBlock, fsdp::kFullSm))

FSDP_MOVES(bf16, fsdp::Bf16)
FSDP_MOVES(f16, fsdp::F16)
FSDP_MOVES(f32, fsdp::F32)

#define FSDP_CAST(sname, S, dname, D)                                             \
  extern "C" __global__ void __launch_bounds__(kBlock)                            \
      cast_##sname##_##dname(const S::Bits* src, D::Bits* dst, uint64_t n) {      \
    fsdp::cast<S, D, fsdp::kRound, fsdp::Convert::kPairs>(src, dst, n);           \
  }                                                                               \
  extern "C" __global__ void __launch_bounds__(kBlock, fsdp::kFullSm)             \
      cast_wave_##sname##_##dname(const S::Bits* src, D::Bits* dst, uint64_t n) { \
    fsdp::cast<S, D, fsdp::kWaveRound, fsdp::Convert::kEach>(src, dst, n);        \
  }

FSDP_CAST(bf16, fsdp::Bf16, f16, fsdp::F16)
FSDP_CAST(bf16, fsdp::Bf16, f32, fsdp::F32)
FSDP_CAST(f16, fsdp::F16, bf16, fsdp::Bf16)
FSDP_CAST(f16, fsdp::F16, f32, fsdp::F32)
FSDP_CAST(f32, fsdp::F32, bf16, fsdp::Bf16)
FSDP_CAST(f32, fsdp::F32, f16, fsdp::F16)
