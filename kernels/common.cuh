// Shared by every kernel family: element types with exact conversions, 16-byte vector access, the
// alignment phase of an element-wise range, the grid-stride driver, and the batches' table.
//
// Every size and index is 64-bit: buffers of several GiB are ordinary here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace fsdp {

// Threads per block of every kernel; the host launches with the same number.
constexpr int kBlock = 256;

// Chunks (16-byte vectors of the widest operand) a thread takes in one round of an element-wise op;
// the host launches one round per thread (`elementwise_grid`; pack and unpack two, see `SpanBatch`;
// a small launch may run its op's `_wave` twin instead, see `kWaveRound`). A copy or a fill takes
// one (`kMoveRound`), the casts two (`kRound`), the accumulations and the optimizers as many as
// `arithmetic_round` gives, the sums as many as `kSumRound` (kernels/grad.cu). On an H200 at 1 GiB,
// against `cudaMemcpyAsync` in the same program: a copy at 0.98 with one, 0.94 with two; a cast
// from bf16 into f32 at 0.965 with two, 0.936 with one, 0.946 with four; `f32 = bf16` likewise, and
// `bf16 = bf16` at 0.941 with two, 0.895 with one; but `f32 += bf16` at 0.990 with one, 0.946 with
// two; `f32 = f32` at 0.978 with one, 0.928 with two; AdamW at 0.977 with one, 0.937 with two,
// 0.934 with four, and lower again when registers were capped for more blocks; SGD at 0.978 with
// one, 0.944 with two. Four chunks a round on a grid that fills the GPU once and strides over the
// rest (an earlier launch) ran them at 0.90-0.92, and so did a thread that loads its next round
// before it stores the last on such a grid (0.89-0.94 for copies, casts and accumulations).
// (BENCHMARKS.md has the crate's own bench.)
constexpr int kMoveRound = 1;
constexpr int kRound = 2;

// Chunks a thread takes in the one round of a `_wave` kernel: the twin of an op that loads one
// operand, launched (`one_wave` on the host) where the op's own round would take more than one
// wave of resident blocks but this one fits in a single wave. Every load of the launch is then in
// flight at once, where a second wave of blocks would start only as the first ends. On an H100 at
// 16 MiB, in the crate's bench: the copies at 1.03-1.05 of the driver's copy with it against
// 0.98-1.00, the casts into f32 and `f32 = bf16` at 0.98-1.01 against 0.90-0.92; at 1 GiB no
// launch runs it. An op that also loads its destination lost 1-3% with four chunks at 16 MiB
// (BENCHMARKS.md, "one wave").
constexpr int kWaveRound = 4;

// Chunks in a round of an arithmetic op that loads `loaded` operands: two where it loads one and
// converts to or from a 16-bit type (the conversions' instructions hide behind a second chunk's
// loads), else one (more loads of a round in flight cost more than they hide).
__host__ __device__ constexpr int arithmetic_round(int loaded, bool converts_16_bit) {
  return loaded == 1 && converts_16_bit ? 2 : 1;
}

// The blocks of kBlock threads an SM holds when each thread has at most 32 registers: a kernel
// launched with `__launch_bounds__(kBlock, kFullSm)` is compiled to fit. The batched
// accumulations (38-40 registers otherwise, 6 blocks an SM) ran at 0.972 of the copy at 1 GiB
// with it against 0.938; the f32 sum at one chunk a round at 0.952 with it against 0.718 without.
// AdamW, which needs more registers, lost 4-10% when capped for 4 or 6 blocks.
constexpr int kFullSm = 8;

// One element per step when the operands cannot be vectorized together; several steps in flight
// per thread so that scalar loads still overlap.
constexpr int kScalarUnroll = 4;

// Element types carry raw bits: moves never touch the values, and the conversions below follow
// Rust's `half` crate bit for bit, NaN payloads included (the hardware conversions return a
// canonical NaN, `half` keeps sign and payload and sets the quiet bit). The 16-bit types also
// convert a word's two elements together, exact but for a NaN: into floats by shifts (bf16) or
// the hardware's conversion of each (f16), from floats by the hardware's paired conversion (see
// `Convert`).
struct Bf16 {
  using Bits = uint16_t;
  static __device__ __forceinline__ float to_f32(uint32_t b) {
    const uint32_t quiet = (b & 0x7FFFu) > 0x7F80u ? 0x00400000u : 0u;
    return __uint_as_float((b << 16) | quiet);
  }
  static __device__ __forceinline__ uint32_t from_f32(float x) {
    const uint32_t u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
      return (u >> 16) | 0x0040u;
    }
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
  // What a NaN's magnitude plus this carries into the half's top bit, and nothing else does (see
  // `words_hold_nan`): its exponent is all ones and its mantissa not zero.
  static constexpr uint32_t kNanCarry = 0x007F007Fu;
  // The two elements of a word (the first in its low half) as floats: exact but for a NaN.
  static __device__ __forceinline__ float2 pair_to_f32(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  }
  // Two floats rounded into a word (the first in its low half): exact but for a NaN.
  static __device__ __forceinline__ uint32_t pair_from_f32(float first, float second) {
    uint32_t w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(second), "f"(first));
    return w;
  }
};

struct F16 {
  using Bits = uint16_t;
  static __device__ __forceinline__ float to_f32(uint32_t b) {
    if ((b & 0x7C00u) == 0x7C00u && (b & 0x03FFu) != 0) {
      return __uint_as_float(((b & 0x8000u) << 16) | 0x7FC00000u | ((b & 0x03FFu) << 13));
    }
    return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
  }
  static __device__ __forceinline__ uint32_t from_f32(float x) {
    const uint32_t u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
      return ((u >> 16) & 0x8000u) | 0x7E00u | ((u & 0x007FFFFFu) >> 13);
    }
    return __half_as_ushort(__float2half_rn(x));
  }
  static constexpr uint32_t kNanCarry = 0x03FF03FFu;
  static __device__ __forceinline__ float2 pair_to_f32(uint32_t w) {
    return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFFu))),
                       __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16))));
  }
  static __device__ __forceinline__ uint32_t pair_from_f32(float first, float second) {
    uint32_t w;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(second), "f"(first));
    return w;
  }
};

struct F32 {
  using Bits = uint32_t;
  static __device__ __forceinline__ float to_f32(uint32_t b) { return __uint_as_float(b); }
  static __device__ __forceinline__ uint32_t from_f32(float x) { return __float_as_uint(x); }
};

// Elements per 16-byte vector.
template <class Bits>
constexpr int kPerVector = 16 / static_cast<int>(sizeof(Bits));

// Elements per chunk of an element-wise op whose widest operand has elements of `Wide` (see
// `elementwise`).
template <class Wide>
constexpr int kChunk = kPerVector<Wide>;

// The vector accesses are written in PTX so that they are 128-bit (or 64-bit) global accesses even
// through addresses read from a table (a sum's sources, a batch's spans), which the compiler
// cannot prove global. Being
// volatile, they keep their source order (every load of a round before its stores, which matters
// when `dst` is also a source); the stores also clobber memory, so that no ordinary access moves
// across them. The loads do not, so that values such as a source address stay in registers across
// a round. The loads do not allocate in L1: no kernel reads a byte of an operand twice, and what is
// read again (a sum's table of sources) then stays in L1 instead of being evicted by the stream.
//
// The loads carry an L2 policy of evict-last (the stores are evict-first). At 1 GiB, after a
// launch that left other data in the L2, an H200 ran the casts between 16-bit types, from f32
// and the accumulations into bf16 at 0.97-1.05 of a copy with it, 0.93-0.95 without; an H100
// every kernel of the bench at 0.988-1.031 with it, 0.980-1.002 without. A kernel after one of
// these finds its L2-resident data about 3% slower; after 512 MiB of other reads, no slower
// (BENCHMARKS.md, "evict-last loads").
__device__ __forceinline__ uint64_t evict_last_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ uint4 load16(const void* p) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(evict_last_policy()));
  return v;
}

__device__ __forceinline__ uint2 load8(const void* p) {
  uint2 v;
  asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
               : "=r"(v.x), "=r"(v.y)
               : "l"(p), "l"(evict_last_policy()));
  return v;
}

// The stores are streaming (`.cs`, evict first): no kernel reads back what it wrote, and at 16 MiB
// and 1 GiB the ops ran as fast or faster with them. A consumer that would find the output still
// in the L2 right after (a buffer smaller than it) was not measured.
__device__ __forceinline__ void store16(void* p, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};"
               :
               : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void store8(void* p, uint2 v) {
  asm volatile("st.global.cs.v2.u32 [%0], {%1, %2};" : : "l"(p), "r"(v.x), "r"(v.y) : "memory");
}

// N consecutive elements as raw bits, in 32-bit words (two elements to a word for 16-bit types):
// one 16-byte vector, or 8 bytes (the address then aligned to that size); or one element when
// N == 1. Operands stay raw from load to store: narrow types take half the registers that way, and
// are converted only when they are used.
template <class Bits, int N>
struct Raw {
  static constexpr int kBytes = N * static_cast<int>(sizeof(Bits));
  static_assert(kBytes == 8 || kBytes == 16, "a chunk spans one vector, or 8 bytes");
  static constexpr int kWords = kBytes / 4;
  uint32_t w[kWords];
  __device__ __forceinline__ void load(const Bits* p) {
    if constexpr (kBytes == 8) {
      const uint2 v = load8(p);
      w[0] = v.x;
      w[1] = v.y;
    } else {
      const uint4 v = load16(p);
      w[0] = v.x;
      w[1] = v.y;
      w[2] = v.z;
      w[3] = v.w;
    }
  }
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int k = 0; k < kWords; ++k) w[k] = 0;
  }
  __device__ __forceinline__ void store(Bits* p) const {
    if constexpr (kBytes == 8) {
      store8(p, make_uint2(w[0], w[1]));
    } else {
      store16(p, make_uint4(w[0], w[1], w[2], w[3]));
    }
  }
};

template <class Bits>
struct Raw<Bits, 1> {
  Bits x;
  __device__ __forceinline__ void load(const Bits* p) { x = *p; }
  __device__ __forceinline__ void clear() { x = 0; }
  __device__ __forceinline__ void store(Bits* p) const { *p = x; }
};

// Whether any element of the W words of a 16-bit type T is a NaN: its magnitude plus
// `T::kNanCarry` carries into the top bit of its half, where no other value's does. Three
// instructions a word, and only the words live: a test of the converted floats held every float
// of the chunk until it was done, and took `cast_bf16_f16` on sm_90 from 32 registers to 36 (6
// blocks an SM).
template <class T, int W>
__device__ __forceinline__ bool words_hold_nan(const uint32_t (&w)[W]) {
  uint32_t carries = 0;
#pragma unroll
  for (int k = 0; k < W; ++k) carries |= (w[k] & 0x7FFF7FFFu) + T::kNanCarry;
  return (carries & 0x80008000u) != 0;
}

// Whether any of the N floats is a NaN: one unordered comparison a pair.
template <int N>
__device__ __forceinline__ bool any_nan(const float (&x)[N]) {
  static_assert(N % 2 == 0, "whole pairs");
  bool nan = false;
#pragma unroll
  for (int k = 0; k < N; k += 2) nan |= (x[k] != x[k]) | (x[k + 1] != x[k + 1]);
  return nan;
}

// How a kernel converts a chunk of a 16-bit type to and from floats. One element at a time,
// the NaN tests took more instructions than the conversions, and the casts between the 16-bit
// types and the bf16 sum were bound by their instructions on an H200 (BENCHMARKS.md, "paired
// conversions").
enum class Convert {
  // Two elements at a time where the chunk holds no NaN, else one at a time: exact.
  kPairs,
  // One at a time: exact. The `_wave` twins: with both ways in a round of four chunks at 32
  // registers, ptxas spilled 16-40 bytes a thread in the loops of those that write a 16-bit
  // type (those that write f32 did not, and were not measured with it).
  kEach,
  // Two at a time, untested: exact but for a NaN's payload and quiet bit, for operands of
  // arithmetic, whose result of a NaN is a NaN, quiet, either way. A sum's sources, converted as
  // they arrive between the round's loads: a test there branches, and each load after it waited
  // for the data before it (on an H100 the bf16 sum of two ran at 0.944 of the copy with it,
  // 1.026 without).
  kOperands,
};

// The N elements of `r`, of type T, as floats, as `C` says.
template <class T, int N, Convert C = Convert::kPairs>
__device__ __forceinline__ void to_floats(const Raw<typename T::Bits, N>& r, float (&x)[N]) {
  if constexpr (N == 1) {
    x[0] = T::to_f32(r.x);
  } else if constexpr (sizeof(typename T::Bits) == 4) {
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = T::to_f32(r.w[k]);
  } else if (C == Convert::kEach || (C == Convert::kPairs && words_hold_nan<T>(r.w))) {
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      x[2 * k] = T::to_f32(r.w[k] & 0xFFFFu);
      x[2 * k + 1] = T::to_f32(r.w[k] >> 16);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      const float2 pair = T::pair_to_f32(r.w[k]);
      x[2 * k] = pair.x;
      x[2 * k + 1] = pair.y;
    }
  }
}

// N floats rounded to T, into `r`.
template <class T, int N>
__device__ __forceinline__ void from_floats(const float (&x)[N], Raw<typename T::Bits, N>& r) {
  if constexpr (N == 1) {
    r.x = static_cast<typename T::Bits>(T::from_f32(x[0]));
  } else if constexpr (sizeof(typename T::Bits) == 4) {
#pragma unroll
    for (int k = 0; k < N; ++k) r.w[k] = T::from_f32(x[k]);
  } else {
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      r.w[k] = T::from_f32(x[2 * k]) | (T::from_f32(x[2 * k + 1]) << 16);
    }
  }
}

// As `from_floats`, a 16-bit type's two floats at a time where none of the N is a NaN: for
// floats that are all live at once anyway (a sum's accumulators), since the test holds every one
// of them until it is done.
template <class T, int N>
__device__ __forceinline__ void from_floats_paired(const float (&x)[N],
                                                   Raw<typename T::Bits, N>& r) {
  if constexpr (N > 1 && sizeof(typename T::Bits) == 2) {
    if (!any_nan(x)) {
#pragma unroll
      for (int k = 0; k < N / 2; ++k) r.w[k] = T::pair_from_f32(x[2 * k], x[2 * k + 1]);
      return;
    }
  }
  from_floats<T>(x, r);
}

// Stores N floats at `p` as elements of T.
template <class T, int N>
__device__ __forceinline__ void store_floats(typename T::Bits* p, const float (&x)[N]) {
  Raw<typename T::Bits, N> r;
  from_floats<T>(x, r);
  r.store(p);
}

// Where the vector body of an element-wise range starts: after `head` elements every operand is
// 16-byte aligned, if the operands agree on that point (`ok`); an operand that moves 8 bytes per
// chunk then stays 8-byte aligned. Each operand constrains the start modulo its elements per
// vector; the moduli are powers of two, so agreement is checked modulo the smaller one. Operands
// are assumed aligned to their element size (the host checks).
struct Phase {
  uint32_t head = 0;
  uint32_t mod = 1;
  bool ok = true;

  template <class Bits>
  __device__ __forceinline__ void add(const Bits* p) {
    constexpr uint32_t kPer = kPerVector<Bits>;
    const uint32_t past = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p) & 15u) / sizeof(Bits);
    const uint32_t first = (kPer - past) % kPer;
    const uint32_t common = kPer < mod ? kPer : mod;
    ok = ok && first % common == head % common;
    if (kPer > mod) {
      head = first;
      mod = kPer;
    }
  }
};

__device__ __forceinline__ uint64_t grid_thread() {
  return static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ uint64_t grid_threads() {
  return static_cast<uint64_t>(gridDim.x) * blockDim.x;
}

// The pieces of an element-wise range (see `elementwise`) a thread takes part in: its unaligned
// edges (head and tail, one element at a time), its aligned body (all of it, one element at a
// time, where the operands' alignment phases differ), or the whole range.
enum class Piece { kWhole, kEdges, kBody };

// A thread's place among the threads that stride over a range's pieces P.
template <Piece P>
struct Stride {
  uint64_t thread;
  uint64_t threads;
};

// The whole range over the grid: a kernel of one range.
__device__ __forceinline__ Stride<Piece::kWhole> grid_stride() {
  return {grid_thread(), grid_threads()};
}

// One span of a batch: `n` elements from `src` to `dst` (`fsdp_fusion`'s `Span`); a move with
// no source writes zeros.
struct Span {
  uint64_t src;
  uint64_t dst;
  uint64_t n;
};

// The spans of one launch, passed by value (904 bytes of the 4 KiB of parameters). The grid's
// first `first_block[0]` blocks take the spans' unaligned edges, a warp a span (warp w of block b
// takes span `b * kEdgeSpans + w`); span s's body runs on blocks `first_block[s]` up to
// `first_block[s + 1]`, as many as its length asks for, so that a small span beside a large one
// leaves no block idle and every block has work: a round a thread, or for pack and unpack two,
// one after the other (`MOVE_SPAN_ROUNDS` on the host: a block's lookup of its span then serves
// twice the bytes, and they ran at 0.97 of the copy at 1 GiB rather than 0.94); a `_wave` twin's
// blocks one round of `kWaveRound` chunks. With a span's edges taken by the first threads of its
// own blocks, those threads began their chunks' loads a memory latency after every other: on an
// H100 the layer's batched one-wave accumulation at 16 MiB ran up to 0.45 us longer (of 13), 0.2
// on average (BENCHMARKS.md, "a batch's edges on blocks of their own").
// `kBatchSpans` is `BATCH_SPANS` on the host, `kEdgeSpans` `EDGE_SPANS_PER_BLOCK`.
constexpr int kBatchSpans = 32;
constexpr int kEdgeSpans = kBlock / 32;
struct SpanBatch {
  Span spans[kBatchSpans];
  uint32_t first_block[kBatchSpans + 1];
};
static_assert(sizeof(SpanBatch) == 904, "the layout of the host's SpanBatch");

// The span whose body block `block` runs: the last whose first block is at or before it (a span
// with no block shares its next one's first block, so it is never the last; the places past the
// batch's spans hold the grid's size). Every warp of a block looks it up before its first load,
// at once with every other warp of the SM, so the lookup's instructions are what it costs: the
// group of kSpanGroup places first, by comparing the groups' first places, then the place within
// it, each comparison with a place of the parameters read into uniform registers. Counting all 31
// places, every warp issued three times the instructions: on an H100 the layer's batched one-wave
// accumulation at 16 MiB ran 0.1-0.4 us longer (of 13) in the same runs (BENCHMARKS.md, "a
// batch's edges on blocks of their own"); a binary search reads five places one after the
// other, and ran longer still ("a batch's span counted").
constexpr int kSpanGroup = 8;
static_assert(kBatchSpans % kSpanGroup == 0, "whole groups");
__device__ __forceinline__ int span_of(const SpanBatch& batch, uint32_t block) {
  int group = 0;
#pragma unroll
  for (int k = kSpanGroup; k < kBatchSpans; k += kSpanGroup) {
    group += batch.first_block[k] <= block ? 1 : 0;
  }
  const uint32_t* places = batch.first_block + group * kSpanGroup;
  int counts[2] = {0, 0};
#pragma unroll
  for (int k = 1; k < kSpanGroup; ++k) counts[k % 2] += places[k] <= block ? 1 : 0;
  return group * kSpanGroup + counts[0] + counts[1];
}

// Runs `run(span, at)` for the thread's part of `batch`: on the grid's first blocks, the edges
// of span `blockIdx.x * kEdgeSpans + warp` with `at` a lane of 32; on the rest, the body of the
// block's span with `at` the thread's place in the span's blocks. The two are separate
// instantiations of `run`, so that neither holds the other's registers: the batched kernels are
// compiled for a full SM, 32 a thread.
template <class Run>
__device__ __forceinline__ void for_span_part(const SpanBatch& batch, const Run& run) {
  if (blockIdx.x < batch.first_block[0]) {
    const uint32_t s = blockIdx.x * kEdgeSpans + threadIdx.x / 32;
    if (s < kBatchSpans) run(batch.spans[s], Stride<Piece::kEdges>{threadIdx.x % 32, 32});
    return;
  }
  const int s = span_of(batch, blockIdx.x);
  const uint64_t first = batch.first_block[s];
  const uint64_t blocks = batch.first_block[s + 1] - first;
  run(batch.spans[s],
      Stride<Piece::kBody>{(blockIdx.x - first) * blockDim.x + threadIdx.x, blocks * blockDim.x});
}

// One round of a thread: chunks c0, c0 + 32, ... (U of them) of N elements from element `start`,
// every load issued before the first store. An op reads its inputs in `steps()` passes (one,
// except for a sum over many sources), then computes and writes in `store`. `kChecked` skips the
// chunks past `chunks`; only the last round needs it.
template <int N, int U, bool kChecked, class Op>
__device__ __forceinline__ void run_round(const Op& op, uint64_t start, uint64_t chunks,
                                          uint64_t c0) {
  typename Op::template Regs<N> r[U];
  for (int s = 0; s < op.steps(); ++s) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint64_t c = c0 + u * 32;
      if (!kChecked || c < chunks) op.template load<N>(s, start + c * N, r[u]);
    }
  }
  // A point the loads are not moved below (a memory barrier among the warp's lanes; CUDA 13.0
  // emits it as a divergence check that also ends the basic block). Without it ptxas issued the
  // last loads of a 16-bit cast's round after converting the first chunks, which wait for the
  // first loads: the round paid the memory latency twice. A converged warp passes it in two
  // instructions. Every lane of a warp gets here equally often: the lanes run the same rounds.
  __syncwarp();
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint64_t c = c0 + u * 32;
    if (!kChecked || c < chunks) op.template store<N>(start + c * N, r[u]);
  }
}

// Runs `chunks` chunks of N elements from element `start`, in rounds of U chunks per thread. In a
// round each warp takes 32 U consecutive chunks, lane l the chunks l, l + 32, ...: every access
// instruction of the warp covers 32 consecutive chunks, and a thread's U accesses to an operand
// are one address plus constant offsets, so that a round holds one address per operand in
// registers rather than U. `threads` is a multiple of 32 (blocks of kBlock threads), and all lanes
// of a warp run the same rounds: a round is full for all of them or for none.
template <int N, int U, bool kResume, class Op>
__device__ __forceinline__ void run_chunks(const Op& op, uint64_t start, uint64_t chunks,
                                           uint64_t thread, uint64_t threads) {
  static_assert(kBlock % 32 == 0, "whole warps");
  if constexpr (U == 1) {
    // A round of one chunk a thread: a warp's rounds are unchecked while its 32 chunks are all in
    // range, and the round after them, where it starts in range, checked. The split below divides
    // by the grid's threads before a thread's first access (a call into the 64-bit division, or
    // its 32-bit path through a reciprocal), which a one-chunk round pays on every thread: on an
    // H100 the fill of 16 MiB (4096 blocks) issued 2.59 M instructions with it, 2.03 M without,
    // and ran at 0.890-0.909 of the copy against 0.900-0.933 (BENCHMARKS.md, "one chunk a round
    // without a division"). With more chunks a round the split stays: this loop gave the one-wave
    // twins, compiled to 32 registers, 8-116 bytes of spills a thread.
    const uint64_t lane = thread % 32;
    uint64_t warp = thread - lane;
    for (; warp + 32 <= chunks; warp += threads) {
      run_round<N, 1, false>(op, start, chunks, warp + lane);
    }
    if (warp < chunks) run_round<N, 1, true>(op, start, chunks, warp + lane);
    return;
  }
  const uint64_t round = threads * U;
  const uint64_t full = chunks / round * round;
  const uint64_t lane = thread % 32;
  const uint64_t first = (thread - lane) * U + lane;
  // The last round starts at `full + first`, where the loop's counter stops too. Which of the two
  // ptxas is given decides what it holds across the loop, and at 32 registers (the kernels
  // compiled for a full SM) that decides whether a thread spills: the counter (`kResume`) keeps
  // a batch's body from spilling, the sum a single range (each spilled 4-8 bytes a thread the
  // other way; the one-wave copy of 16 MiB ran 5% longer on an H100).
  uint64_t c0 = first;
  for (; c0 < full; c0 += round) {
    run_round<N, U, false>(op, start, chunks, c0);
  }
  if (full < chunks) run_round<N, U, true>(op, start, chunks, kResume ? c0 : full + first);
}

// Runs `op` over elements [0, n): the 16-byte aligned body in chunks of E elements, U chunks in
// flight per thread, and the unaligned head and tail (the edges) one element at a time;
// everything one element at a time, as the body, when the operands' alignment phases differ.
// `at` is the caller's place among the threads that take the pieces P.
//
// E is one 16-byte vector of the op's widest operand (kChunk), so that a narrower operand moves 8
// bytes per chunk. Each load or store instruction of a warp then covers one contiguous span of an
// operand, 512 or 256 bytes of whole 32-byte sectors. Chunks of a narrow operand's vector (two
// f32 vectors per 16 bytes of bf16) make each store instruction of a warp write half of every
// sector over 1 KiB, the other half coming from the next instruction; on an H200 the kernels that
// wrote f32 that way without reading it first ran at 53-78% of a copy.
template <int E, int U, class Op, Piece P>
__device__ __forceinline__ void elementwise(const Op& op, uint64_t n, const Phase& phase,
                                            const Stride<P>& at) {
  constexpr bool kEdges = P != Piece::kBody;
  constexpr bool kBody = P != Piece::kEdges;
  constexpr bool kResume = P == Piece::kBody;
  if (!phase.ok) {
    if constexpr (kBody) run_chunks<1, kScalarUnroll, kResume>(op, 0, n, at.thread, at.threads);
    return;
  }
  const uint64_t head = phase.head < n ? phase.head : n;
  const uint64_t chunks = (n - head) / E;
  const uint64_t tail = head + chunks * E;
  if constexpr (kEdges) {
    for (uint64_t k = at.thread; k < head + (n - tail); k += at.threads) {
      const uint64_t i = k < head ? k : tail + (k - head);
      typename Op::template Regs<1> r;
      for (int s = 0; s < op.steps(); ++s) op.template load<1>(s, i, r);
      op.template store<1>(i, r);
    }
  }
  if constexpr (kBody) run_chunks<E, U, kResume>(op, head, chunks, at.thread, at.threads);
}

// Copies elements: the op of copy, pack and unpack.
template <class Bits>
struct CopyOp {
  const Bits* src;
  Bits* dst;
  template <int N>
  using Regs = Raw<Bits, N>;
  __device__ __forceinline__ int steps() const { return 1; }
  template <int N>
  __device__ __forceinline__ void load(int, uint64_t i, Regs<N>& r) const {
    r.load(src + i);
  }
  template <int N>
  __device__ __forceinline__ void store(uint64_t i, const Regs<N>& r) const {
    r.store(dst + i);
  }
};

// Writes zeros: the op of fill_zero and of pack's padding.
template <class Bits>
struct ZeroOp {
  Bits* dst;
  template <int N>
  using Regs = Raw<Bits, N>;
  __device__ __forceinline__ int steps() const { return 1; }
  template <int N>
  __device__ __forceinline__ void load(int, uint64_t, Regs<N>& r) const {
    r.clear();
  }
  template <int N>
  __device__ __forceinline__ void store(uint64_t i, const Regs<N>& r) const {
    r.store(dst + i);
  }
};

template <class Bits, int U, Piece P>
__device__ __forceinline__ void copy_range(const Bits* src, Bits* dst, uint64_t n,
                                           const Stride<P>& at) {
  Phase phase;
  phase.add(src);
  phase.add(dst);
  elementwise<kChunk<Bits>, U>(CopyOp<Bits>{src, dst}, n, phase, at);
}

template <class Bits, int U, Piece P>
__device__ __forceinline__ void zero_range(Bits* dst, uint64_t n, const Stride<P>& at) {
  Phase phase;
  phase.add(dst);
  elementwise<kChunk<Bits>, U>(ZeroOp<Bits>{dst}, n, phase, at);
}

}  // namespace fsdp
