// Gradient arithmetic in f32 (operands f32 or 16-bit, results rounded once): scaled accumulation
// and the element-wise sum of many buffers.
//
// The arithmetic is written with round-to-nearest intrinsics so that nvcc cannot contract a
// multiply and an add into an FMA: the host computes each step separately, and so must we.
#include <type_traits>

#include "common.cuh"

namespace fsdp {

// The wider of two element types: an element-wise op's chunk is one vector of it (`kChunk`).
template <class A, class B>
using Wider = typename std::conditional<(sizeof(typename A::Bits) >= sizeof(typename B::Bits)),
                                        A, B>::type;

// `dst = scale * src`, or `dst = dst + scale * src` when `add`, as `accumulate_element`, computed
// in f32 and rounded to D once.
template <class S, class D, Convert C>
struct AccumulateOp {
  const typename S::Bits* src;
  typename D::Bits* dst;
  float scale;
  bool add;
  template <int N>
  struct Regs {
    Raw<typename S::Bits, N> s;
    Raw<typename D::Bits, N> d;
  };
  __device__ __forceinline__ int steps() const { return 1; }
  template <int N>
  __device__ __forceinline__ void load(int, uint64_t i, Regs<N>& r) const {
    r.s.load(src + i);
    if (add) r.d.load(dst + i);
  }
  template <int N>
  __device__ __forceinline__ void store(uint64_t i, const Regs<N>& r) const {
    float s[N];
    to_floats<S, N, C>(r.s, s);
    float out[N];
    if (add) {
      to_floats<D, N, C>(r.d, out);
#pragma unroll
      for (int k = 0; k < N; ++k) out[k] = __fadd_rn(out[k], __fmul_rn(scale, s[k]));
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) out[k] = __fmul_rn(scale, s[k]);
    }
    store_floats<D>(dst + i, out);
  }
};

// The thread's part, at `at`.
template <class S, class D, Piece P>
__device__ __forceinline__ void accumulate(const typename S::Bits* src, typename D::Bits* dst,
                                           uint64_t n, float scale, bool add, const Stride<P>& at) {
  Phase phase;
  phase.add(src);
  phase.add(dst);
  // A chunk is one vector of the wider type; an addition also loads the destination.
  constexpr int kE = kChunk<typename Wider<S, D>::Bits>;
  constexpr bool kConverts = sizeof(typename S::Bits) == 2 || sizeof(typename D::Bits) == 2;
  const AccumulateOp<S, D, Convert::kPairs> op{src, dst, scale, add};
  if (add) {
    elementwise<kE, arithmetic_round(2, kConverts)>(op, n, phase, at);
  } else {
    elementwise<kE, arithmetic_round(1, kConverts)>(op, n, phase, at);
  }
}

// `dst = scale * src` (no addition) at kWaveRound chunks a thread: the `_wave` twin's work.
template <class S, class D, Piece P>
__device__ __forceinline__ void accumulate_wave(const typename S::Bits* src, typename D::Bits* dst,
                                                uint64_t n, float scale, const Stride<P>& at) {
  Phase phase;
  phase.add(src);
  phase.add(dst);
  elementwise<kChunk<typename Wider<S, D>::Bits>, kWaveRound>(
      AccumulateOp<S, D, Convert::kEach>{src, dst, scale, false}, n, phase, at);
}

// `dst = ((scale * src0 + scale * src1) + scale * src2) + ...` in f32, rounded to T once: step k
// reads source k, so every chunk of a round has its load of one source in flight together. `dst`
// may be one of the sources: each element is read from every source before it is written, by the
// same thread. Scaling each source before the sum keeps a mean finite where the plain sum would
// overflow; a scale of 1 changes no bit.
template <class T>
struct SumOp {
  const typename T::Bits* const* srcs;
  int count;
  typename T::Bits* dst;
  float scale;
  template <int N>
  struct Regs {
    float acc[N];
  };
  __device__ __forceinline__ int steps() const { return count; }
  template <int N>
  __device__ __forceinline__ void load(int step, uint64_t i, Regs<N>& r) const {
    Raw<typename T::Bits, N> raw;
    raw.load(srcs[step] + i);
    float x[N];
    to_floats<T, N, Convert::kOperands>(raw, x);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float scaled = __fmul_rn(scale, x[k]);
      r.acc[k] = step == 0 ? scaled : __fadd_rn(r.acc[k], scaled);
    }
  }
  template <int N>
  __device__ __forceinline__ void store(uint64_t i, const Regs<N>& r) const {
    Raw<typename T::Bits, N> out;
    from_floats_paired<T>(r.acc, out);
    out.store(dst + i);
  }
};

// Chunks in a round of a sum of T: one of f32 (it loads two sources or more, as
// `arithmetic_round`), two of bf16, whose conversions of every source's values hide behind the
// second chunk's loads. On an H200 at 1 GiB a sum of two f32 ran at 0.957 of the copy with one
// chunk at 32 registers against 0.929 with two at 41; a sum of two bf16 at 0.853 with one chunk
// at 32 registers against 0.918 with two at 45 (the chunk and the registers not measured apart).
template <class T>
constexpr int kSumRound = sizeof(typename T::Bits) == 4 ? arithmetic_round(2, false) : kRound;

template <class T>
__device__ __forceinline__ void reduce_sum(const typename T::Bits* const* srcs, int count,
                                           typename T::Bits* dst, uint64_t n, float scale) {
  Phase phase;
  phase.add(dst);
  for (int k = 0; k < count; ++k) phase.add(srcs[k]);
  elementwise<kChunk<typename T::Bits>, kSumRound<T>>(SumOp<T>{srcs, count, dst, scale}, n, phase,
                                                      grid_stride());
}

}  // namespace fsdp

using fsdp::kBlock;

#define FSDP_ACCUMULATE(name, S, D)                                                        \
  extern "C" __global__ void __launch_bounds__(kBlock) accumulate_##name(                  \
      const S::Bits* src, D::Bits* dst, uint64_t n, float scale, uint32_t add) {           \
    fsdp::accumulate<S, D>(src, dst, n, scale, add != 0, fsdp::grid_stride());             \
  }

// Many accumulations of one dtype pair in one launch, each as `accumulate_<name>` computes it,
// on blocks of its own.
#define FSDP_ACCUMULATE_MANY(name, S, D)                                                   \
  extern "C" __global__ void __launch_bounds__(kBlock, fsdp::kFullSm) accumulate_many_##name( \
      const fsdp::SpanBatch batch, float scale, uint32_t add) {                            \
    fsdp::for_span_part(batch, [&](const fsdp::Span& span, const auto& at) {               \
      fsdp::accumulate<S, D>(reinterpret_cast<const S::Bits*>(span.src),                   \
                             reinterpret_cast<D::Bits*>(span.dst), span.n, scale, add != 0, \
                             at);                                                          \
    });                                                                                    \
  }

// The `_wave` twins (see `kWaveRound`) of both, for `dst = scale * src` only: an addition also
// loads the destination, and lost 1-3% with more chunks a thread.
#define FSDP_ACCUMULATE_WAVE(name, S, D)                                                      \
  extern "C" __global__ void __launch_bounds__(kBlock, fsdp::kFullSm) accumulate_wave_##name( \
      const S::Bits* src, D::Bits* dst, uint64_t n, float scale) {                          \
    fsdp::accumulate_wave<S, D>(src, dst, n, scale, fsdp::grid_stride());                    \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(kBlock, fsdp::kFullSm)                        \
      accumulate_many_wave_##name(const fsdp::SpanBatch batch, float scale) {                \
    fsdp::for_span_part(batch, [&](const fsdp::Span& span, const auto& at) {                 \
      fsdp::accumulate_wave<S, D>(reinterpret_cast<const S::Bits*>(span.src),                \
                                  reinterpret_cast<D::Bits*>(span.dst), span.n, scale, at);  \
    });                                                                                      \
  }

FSDP_ACCUMULATE_WAVE(bf16_f32, fsdp::Bf16, fsdp::F32)
FSDP_ACCUMULATE_WAVE(f16_f32, fsdp::F16, fsdp::F32)
FSDP_ACCUMULATE_WAVE(f32_f32, fsdp::F32, fsdp::F32)
FSDP_ACCUMULATE_WAVE(bf16_bf16, fsdp::Bf16, fsdp::Bf16)
FSDP_ACCUMULATE_WAVE(f16_bf16, fsdp::F16, fsdp::Bf16)
FSDP_ACCUMULATE_WAVE(f32_bf16, fsdp::F32, fsdp::Bf16)

FSDP_ACCUMULATE_MANY(bf16_f32, fsdp::Bf16, fsdp::F32)
FSDP_ACCUMULATE_MANY(f16_f32, fsdp::F16, fsdp::F32)
FSDP_ACCUMULATE_MANY(f32_f32, fsdp::F32, fsdp::F32)
FSDP_ACCUMULATE_MANY(bf16_bf16, fsdp::Bf16, fsdp::Bf16)
FSDP_ACCUMULATE_MANY(f16_bf16, fsdp::F16, fsdp::Bf16)
FSDP_ACCUMULATE_MANY(f32_bf16, fsdp::F32, fsdp::Bf16)

FSDP_ACCUMULATE(bf16_f32, fsdp::Bf16, fsdp::F32)
FSDP_ACCUMULATE(f16_f32, fsdp::F16, fsdp::F32)
FSDP_ACCUMULATE(f32_f32, fsdp::F32, fsdp::F32)
FSDP_ACCUMULATE(bf16_bf16, fsdp::Bf16, fsdp::Bf16)
FSDP_ACCUMULATE(f16_bf16, fsdp::F16, fsdp::Bf16)
FSDP_ACCUMULATE(f32_bf16, fsdp::F32, fsdp::Bf16)

// The f32 sum compiled for a full SM (see `kFullSm`); the bf16 one as before, which ran faster
// than at one chunk and 32 registers (see `kSumRound`).
#define FSDP_REDUCE_SUM(name, T, bounds)                                                     \
  extern "C" __global__ void bounds reduce_sum_##name(                                       \
      const T::Bits* const* srcs, uint32_t count, T::Bits* dst, uint64_t n, float scale) {   \
    fsdp::reduce_sum<T>(srcs, static_cast<int>(count), dst, n, scale);                       \
  }

FSDP_REDUCE_SUM(f32, fsdp::F32, __launch_bounds__(kBlock, fsdp::kFullSm))
FSDP_REDUCE_SUM(bf16, fsdp::Bf16, __launch_bounds__(kBlock))

// `*counter += ` the number of non-finite (infinite or NaN) f32 values of `src[0..n)`. Each thread
// counts its grid-stride share, each warp adds its threads' counts, and one lane per warp adds
// the warp's to the counter: integer additions, so the count does not depend on their order.
extern "C" __global__ void __launch_bounds__(kBlock)
    count_nonfinite_f32(const uint32_t* src, uint64_t n, unsigned long long* counter) {
  unsigned long long mine = 0;
  const uint64_t stride = fsdp::grid_threads();
  for (uint64_t i = fsdp::grid_thread(); i < n; i += stride) {
    mine += (src[i] & 0x7F800000u) == 0x7F800000u;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    mine += __shfl_down_sync(0xFFFFFFFFu, mine, offset);
  }
  if ((threadIdx.x & 31u) == 0 && mine != 0) atomicAdd(counter, mine);
}

// `*sum_squares +=` the sum of the squares of `src[0..n)`, in f64, and `*max_bits =` the largest
// of the old value and every `|src[i]|`'s bits: for non-negative floats the bits order as the
// values do, and a NaN (its sign cleared) orders above infinity, so a NaN shows in the maximum.
extern "C" __global__ void __launch_bounds__(kBlock) norm_partials_f32(
    const float* src, uint64_t n, double* sum_squares, unsigned int* max_bits) {
  double sum = 0.0;
  unsigned int top = 0;
  const uint64_t stride = fsdp::grid_threads();
  for (uint64_t i = fsdp::grid_thread(); i < n; i += stride) {
    const float x = src[i];
    sum += static_cast<double>(x) * static_cast<double>(x);
    top = max(top, __float_as_uint(x) & 0x7FFFFFFFu);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    sum += __shfl_down_sync(0xFFFFFFFFu, sum, offset);
    top = max(top, __shfl_down_sync(0xFFFFFFFFu, top, offset));
  }
  if ((threadIdx.x & 31u) == 0) {
    atomicAdd(sum_squares, sum);
    atomicMax(max_bits, top);
  }
}
