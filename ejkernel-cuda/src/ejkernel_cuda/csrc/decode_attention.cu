// Decode attention (one query token per row) over a paged or dense KV cache: split-K flash
// decoding (Dao et al., "Flash-Decoding for long-context inference", 2023).
//
// Row r attends to the keys at positions [lo[r], hi[r]) of its cache; the caller folds the
// sliding window and the clamping into lo/hi. Position t of row r lives in cache row
//   page * page_size + t % page_size,  page = table[r, t / page_size]   (paged)
//   r * page_size + t                                                    (dense, no table)
// so a dense cache [B, Sk, Hkv, D] is the paged layout with page_size = Sk and page r for row r.
//
// Kernel 1 (_decode_split_kernel): one CTA per (row, split, block of HPC query heads that
// share one KV head; GQA: every K/V read serves HPC heads), the head blocks of one (row, split)
// adjacent in the launch order so the CTAs running together read whole [Hkv, D] cache rows
// rather than one head's slice of many rows. TPT threads hold one key row (8 elements each,
// 16-byte copies); the CTA's 128 threads form NG = 128 / TPT token groups, each running its own
// online softmax over every NG-th token. K/V stream through a ring of STAGES shared-memory
// slots of UNROLL tokens per group, filled with asynchronous copies (cp.async) STAGES - 1 steps
// ahead of use; each thread reads back only the bytes it copied, so the ring needs no CTA
// barrier and the loads in flight cost no registers. The groups merge through shared memory;
// the CTA writes an unnormalised partial (acc, max, sum) in float32 with logits in log2 units.
// Kernel 2 (_decode_merge_kernel): one CTA per (row, query head) merges the splits and the
// attention sinks; a row with no visible key gives zeros.
#include <atomic>

#include "common.cuh"

namespace ejk {
namespace {

constexpr int kDecodeThreads = 128;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Shape of one CTA's work: token groups, tokens per group per ring slot, ring depth.
template <typename T, int TPT, int HPC>
struct DecodeTile {
  static_assert(HPC <= 4, "at most 4 query heads per CTA (the register cap)");
  static constexpr int NG = kDecodeThreads / TPT;
  static constexpr int UNROLL = 4;
  static constexpr int DMAX = TPT * 8;
  static constexpr int CHUNKS = static_cast<int>(sizeof(typename Pack8<T>::Raw)) / 16;
  // Measured on an H100 (bf16, D 128, 4 heads per CTA): four resident CTAs of 3 slots beat
  // three of 4 slots by 15 %: the softmax and the shuffles need the warps more than the
  // copies need depth. The register cap (128 a thread) follows from MIN_BLOCKS.
  static constexpr int STAGES = CHUNKS == 1 ? 3 : 2;
  static constexpr int MIN_BLOCKS = CHUNKS == 1 ? 4 : 3;
  // Ring: [STAGES][UNROLL][K, V][CHUNKS][thread] 16-byte chunks (a warp's chunks contiguous).
  static constexpr int RING_BYTES = STAGES * UNROLL * 2 * CHUNKS * kDecodeThreads * 16;
  // The groups' merge reuses the ring: max and sum [NG][HPC], acc [NG][HPC][DMAX].
  static constexpr int MERGE_BYTES = (2 * NG * HPC + NG * HPC * DMAX) * 4;
  static constexpr int SMEM_BYTES = RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES;
};

template <typename T, int TPT, int HPC>
__global__ void __launch_bounds__(kDecodeThreads, DecodeTile<T, TPT, HPC>::MIN_BLOCKS)
    _decode_split_kernel(const T* __restrict__ q, const T* __restrict__ k_cache,
                         const T* __restrict__ v_cache, const int32_t* __restrict__ lo_arr,
                         const int32_t* __restrict__ hi_arr, const int32_t* __restrict__ table,
                         int table_stride, int page_size, int page_shift, int num_pages, int hq,
                         int hkv, int d, float q_scale, float soft_cap, int num_splits,
                         float* __restrict__ o_part, float* __restrict__ ml_part) {
  using Tile = DecodeTile<T, TPT, HPC>;
  constexpr int NG = Tile::NG, UNROLL = Tile::UNROLL, STAGES = Tile::STAGES;
  constexpr int CHUNKS = Tile::CHUNKS, DMAX = Tile::DMAX;
  using P = Pack8<T>;
  extern __shared__ uint4 smem[];

  const int head_blocks = hq / HPC;
  const int rs = blockIdx.x / head_blocks;  // (row, split), head blocks adjacent
  const int h0 = (blockIdx.x - rs * head_blocks) * HPC;
  const int r = rs / num_splits;
  const int split = rs - r * num_splits;
  const int kvh = h0 / (hq / hkv);
  const int lane = threadIdx.x % TPT;
  const int group = threadIdx.x / TPT;
  const bool active = lane * 8 < d;

  const int lo = lo_arr[r];
  const int hi = hi_arr[r];
  const int len = max(hi - lo, 0);
  const int chunk = (len + num_splits - 1) / num_splits;
  const int s_lo = lo + split * chunk;
  const int s_hi = min(hi, s_lo + chunk);

  float qr[HPC][8];
#pragma unroll
  for (int h = 0; h < HPC; ++h) {
    if (active) {
      const T* qp = q + (static_cast<int64_t>(r) * hq + h0 + h) * d + lane * 8;
#pragma unroll
      for (int j = 0; j < 8; ++j) qr[h][j] = to_float<T>(qp[j]) * q_scale;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) qr[h][j] = 0.f;
    }
  }

  float m[HPC], l[HPC], acc[HPC][8];
#pragma unroll
  for (int h = 0; h < HPC; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[h][j] = 0.f;
  }

  const int64_t head_offset = static_cast<int64_t>(kvh) * d + lane * 8;
  const int32_t* row_table = table ? table + static_cast<int64_t>(r) * table_stride : nullptr;
  const int page_mask = page_shift >= 0 ? (1 << page_shift) - 1 : 0;
  // Cache row of position t (-1 past the split).
  auto row_of = [&](int t) -> int64_t {
    if (t >= s_hi) return -1;
    if (!row_table) return static_cast<int64_t>(r) * page_size + t;
    int page_idx, offset;
    if (page_shift >= 0) {
      page_idx = t >> page_shift;
      offset = t & page_mask;
    } else {
      page_idx = t / page_size;
      offset = t - page_idx * page_size;
    }
    const int page = min(max(__ldg(row_table + page_idx), 0), num_pages - 1);
    return static_cast<int64_t>(page) * page_size + offset;
  };
  auto chunk_at = [&](int stage, int u, int kv, int c) -> uint4* {
    return smem + (((stage * UNROLL + u) * 2 + kv) * CHUNKS + c) * kDecodeThreads + threadIdx.x;
  };

  // Ring slot `stage` <- this thread's chunks of the step starting at t0. The cache rows of the
  // next issue are looked up right after, so block-table latency hides behind the copies.
  constexpr int STEP = NG * UNROLL;
  int64_t rows[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) rows[u] = row_of(s_lo + u * NG + group);
  auto issue = [&](int stage, int t0) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (rows[u] >= 0 && active) {
        const int64_t off = rows[u] * hkv * d + head_offset;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
          cp_async16(chunk_at(stage, u, 0, c), k_cache + off + c * (8 / CHUNKS));
          cp_async16(chunk_at(stage, u, 1, c), v_cache + off + c * (8 / CHUNKS));
        }
      }
    }
    cp_async_commit();
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) rows[u] = row_of(t0 + STEP + u * NG + group);
  };
  auto raw_at = [&](int stage, int u, int kv) {
    typename P::Raw raw;
    uint4* words = reinterpret_cast<uint4*>(&raw);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) words[c] = *chunk_at(stage, u, kv, c);
    return raw;
  };
  // Row u of a stage as floats (kv 0: the key, 1: the value), zeros where ``ok`` is false.
  auto floats_at = [&](int stage, int u, int kv, bool ok, float(&out)[8]) {
    if (ok) {
      P::convert(raw_at(stage, u, kv), out);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) out[j] = 0.f;
    }
  };

  const int steps = (s_hi - s_lo + STEP - 1) / STEP;
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) issue(st, s_lo + st * STEP);

  for (int i = 0; i < steps; ++i) {
    const int t0 = s_lo + i * STEP;
    const int stage = i % STAGES;
    issue((i + STAGES - 1) % STAGES, t0 + (STAGES - 1) * STEP);
    cp_async_wait<STAGES - 1>();

    float s[UNROLL][HPC];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const bool valid = t0 + u * NG + group < s_hi;
      float kf[8];
      floats_at(stage, u, 0, valid && active, kf);
#pragma unroll
      for (int h = 0; h < HPC; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) dot = fmaf(qr[h][j], kf[j], dot);
#pragma unroll
        for (int off = TPT / 2; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off, TPT);
        if (soft_cap > 0.f) dot = soft_cap * tanhf(dot / soft_cap) * kLog2e;
        s[u][h] = valid ? dot : -INFINITY;
      }
    }

#pragma unroll
    for (int h = 0; h < HPC; ++h) {
      float m_new = m[h];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) m_new = fmaxf(m_new, s[u][h]);
      if (m_new == -INFINITY) continue;  // nothing visible yet in this group
      const float alpha = exp2f(m[h] - m_new);
      m[h] = m_new;
      l[h] *= alpha;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[h][j] *= alpha;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) s[u][h] = exp2f(s[u][h] - m_new);
    }

#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const bool valid = t0 + u * NG + group < s_hi;
      float vf[8];
      floats_at(stage, u, 1, valid && active, vf);
#pragma unroll
      for (int h = 0; h < HPC; ++h) {
        if (m[h] == -INFINITY) continue;
        const float p = s[u][h];
        l[h] += p;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[h][j] = fmaf(p, vf[j], acc[h][j]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring becomes the merge buffer

  // Merge the NG token groups of this CTA.
  float(*sm_m)[HPC] = reinterpret_cast<float(*)[HPC]>(smem);
  float(*sm_l)[HPC] = sm_m + NG;
  float(*sm_acc)[HPC][DMAX] = reinterpret_cast<float(*)[HPC][DMAX]>(sm_l + NG);
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < HPC; ++h) {
      sm_m[group][h] = m[h];
      sm_l[group][h] = l[h];
    }
  }
#pragma unroll
  for (int h = 0; h < HPC; ++h) {
#pragma unroll
    for (int j = 0; j < 8; ++j) sm_acc[group][h][lane * 8 + j] = acc[h][j];
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < HPC * d; idx += kDecodeThreads) {
    const int h = idx / d;
    const int j = idx - h * d;
    float mx = -INFINITY;
#pragma unroll
    for (int g = 0; g < NG; ++g) mx = fmaxf(mx, sm_m[g][h]);
    float a = 0.f, sum = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int g = 0; g < NG; ++g) {
        const float w = exp2f(sm_m[g][h] - mx);
        a = fmaf(w, sm_acc[g][h][j], a);
        sum = fmaf(w, sm_l[g][h], sum);
      }
    }
    const int64_t slot = (static_cast<int64_t>(r) * hq + h0 + h) * num_splits + split;
    o_part[slot * d + j] = a;
    if (j == 0) {
      ml_part[slot * 2] = mx;
      ml_part[slot * 2 + 1] = sum;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kDecodeThreads)
    _decode_merge_kernel(const float* __restrict__ o_part, const float* __restrict__ ml_part,
                         const float* __restrict__ aux, int num_aux, int hq, int d,
                         int num_splits, T* __restrict__ out) {
  const int64_t rh = blockIdx.x;  // row * hq + head
  const int head = static_cast<int>(rh % hq);
  const float* ml = ml_part + rh * num_splits * 2;
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, ml[2 * s]);
  T* o = out + rh * d;
  if (mx == -INFINITY) {  // no visible key: zeros, sinks or not
    for (int j = threadIdx.x; j < d; j += blockDim.x) o[j] = from_float<T>(0.f);
    return;
  }
  const float* sinks = aux ? aux + static_cast<int64_t>(head) * num_aux : nullptr;
  float m_all = mx;
  for (int i = 0; i < num_aux; ++i) m_all = fmaxf(m_all, sinks[i] * kLog2e);
  float denom = 0.f;
  for (int s = 0; s < num_splits; ++s) denom += ml[2 * s + 1] * exp2f(ml[2 * s] - m_all);
  for (int i = 0; i < num_aux; ++i) denom += exp2f(sinks[i] * kLog2e - m_all);
  const float inv = 1.f / denom;
  const float* op = o_part + rh * num_splits * d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    float a = 0.f;
    for (int s = 0; s < num_splits; ++s) {
      const float w = exp2f(ml[2 * s] - m_all);
      if (w != 0.f) a = fmaf(w, op[static_cast<int64_t>(s) * d + j], a);
    }
    o[j] = from_float<T>(a * inv);
  }
}

struct DecodeArgs {
  const void *q, *k, *v;
  const int32_t *lo, *hi, *table;
  const float* aux;
  int rows, hq, hkv, d, table_stride, page_size, page_shift, num_pages, num_splits, num_aux;
  float q_scale, soft_cap;
  void* out;
  float *o_part, *ml_part;
};

template <typename T, int TPT, int HPC>
void launch_split(const DecodeArgs& a, cudaStream_t stream) {
  using Tile = DecodeTile<T, TPT, HPC>;
  auto* kernel = &_decode_split_kernel<T, TPT, HPC>;
  // Above 48 KiB a kernel must opt in to its dynamic shared memory, once per device.
  static std::atomic<uint64_t> opted_in{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (!(opted_in.load(std::memory_order_relaxed) & bit)) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::SMEM_BYTES);
    opted_in.fetch_or(bit);
  }
  const int ctas = a.rows * a.num_splits * (a.hq / HPC);
  kernel<<<ctas, kDecodeThreads, Tile::SMEM_BYTES, stream>>>(
      static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v), a.lo,
      a.hi, a.table, a.table_stride, a.page_size, a.page_shift, a.num_pages, a.hq, a.hkv, a.d,
      a.q_scale, a.soft_cap, a.num_splits, a.o_part, a.ml_part);
}

template <typename T, int TPT>
void dispatch_heads(const DecodeArgs& a, int hpc, cudaStream_t stream) {
  switch (hpc) {
    case 4: return launch_split<T, TPT, 4>(a, stream);
    case 2: return launch_split<T, TPT, 2>(a, stream);
    default: return launch_split<T, TPT, 1>(a, stream);
  }
}

template <typename T>
ffi::Error launch_decode(const DecodeArgs& a, cudaStream_t stream) {
  // Query heads per CTA: the largest of 4, 2, 1 that divides the GQA group (larger groups run
  // as adjacent CTAs, whose second read of a K/V row hits L2).
  const int group = a.hq / a.hkv;
  const int hpc = group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
  const int vecs = a.d / 8;
  if (vecs <= 8) {
    dispatch_heads<T, 8>(a, hpc, stream);
  } else if (vecs <= 16) {
    dispatch_heads<T, 16>(a, hpc, stream);
  } else {
    dispatch_heads<T, 32>(a, hpc, stream);
  }
  _decode_merge_kernel<T><<<a.rows * a.hq, kDecodeThreads, 0, stream>>>(
      a.o_part, a.ml_part, a.aux, a.num_aux, a.hq, a.d, a.num_splits, static_cast<T*>(a.out));
  return launch_status("ejkernel_decode_attention");
}

ffi::Error DecodeAttentionImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                               ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> lo,
                               ffi::Buffer<ffi::S32> hi, ffi::Buffer<ffi::S32> table,
                               ffi::Buffer<ffi::F32> aux, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::Buffer<ffi::F32>> o_part,
                               ffi::Result<ffi::Buffer<ffi::F32>> ml_part, float softmax_scale,
                               float soft_cap, int64_t num_splits, int64_t paged,
                               int64_t has_aux) {
  const auto qd = q.dimensions();    // [R, Hq, D]
  const auto kd = k_cache.dimensions();  // [P, page_size, Hkv, D]
  const auto td = table.dimensions();    // [R, max_pages]
  const auto ad = aux.dimensions();      // [Hq, n]
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || ad.size() != 2) {
    return ffi::Error::InvalidArgument("ejkernel_decode_attention: unexpected ranks");
  }
  DecodeArgs a{};
  a.q = q.untyped_data();
  a.k = k_cache.untyped_data();
  a.v = v_cache.untyped_data();
  a.lo = lo.typed_data();
  a.hi = hi.typed_data();
  a.table = paged ? table.typed_data() : nullptr;
  a.aux = has_aux ? aux.typed_data() : nullptr;
  a.rows = static_cast<int>(qd[0]);
  a.hq = static_cast<int>(qd[1]);
  a.d = static_cast<int>(qd[2]);
  a.num_pages = static_cast<int>(kd[0]);
  a.page_size = static_cast<int>(kd[1]);
  a.hkv = static_cast<int>(kd[2]);
  a.table_stride = static_cast<int>(td[1]);
  a.page_shift = -1;
  if (paged && (a.page_size & (a.page_size - 1)) == 0) {
    a.page_shift = 0;
    while ((1 << a.page_shift) < a.page_size) ++a.page_shift;
  }
  a.num_splits = static_cast<int>(num_splits);
  a.num_aux = has_aux ? static_cast<int>(ad[1]) : 0;
  a.soft_cap = soft_cap;
  a.q_scale = soft_cap > 0.f ? softmax_scale : softmax_scale * kLog2e;
  a.out = out->untyped_data();
  a.o_part = o_part->typed_data();
  a.ml_part = ml_part->typed_data();
  if (a.d % 8 != 0 || a.d > 256 || a.hkv == 0 || a.hq % a.hkv != 0 || a.num_splits < 1) {
    return ffi::Error::InvalidArgument("ejkernel_decode_attention: unsupported shape");
  }
  if (a.rows == 0) return ffi::Error::Success();
  switch (q.element_type()) {
    case ffi::BF16: return launch_decode<__nv_bfloat16>(a, stream);
    case ffi::F16: return launch_decode<__half>(a, stream);
    case ffi::F32: return launch_decode<float>(a, stream);
    default: return ffi::Error::InvalidArgument("ejkernel_decode_attention: unsupported dtype");
  }
}

}  // namespace
}  // namespace ejk

XLA_FFI_DEFINE_HANDLER_SYMBOL(EjkDecodeAttention, ejk::DecodeAttentionImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()          // query
                                  .Arg<xla::ffi::AnyBuffer>()          // key cache
                                  .Arg<xla::ffi::AnyBuffer>()          // value cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // lo
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // hi
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // block table
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // sinks [Hq, n]
                                  .Ret<xla::ffi::AnyBuffer>()              // out
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // partial acc
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // partial max, sum
                                  .Attr<float>("softmax_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("num_splits")
                                  .Attr<int64_t>("paged")
                                  .Attr<int64_t>("has_aux"));
