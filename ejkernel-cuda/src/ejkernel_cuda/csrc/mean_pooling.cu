// Mean pooling over the tokens of each sequence, dense or packed, forward and backward.
//
// Sequence n is the token rows [start_n, end_n) of x [T, D]: (n * L, (n + 1) * L) for a dense
// [B, L, D] input seen as [B * L, D] (uniform_len = L), offsets[n], offsets[n + 1] for packed
// input (offsets already clipped to [0, T] by the caller).
//
// Forward, two kernels: _mean_pooling_fwd_kernel reduces one split of one sequence's rows for
// 32 * VEC columns (a CTA of 32 x 8 threads, 16-byte loads, UNROLL rows in flight per thread)
// into a float32 partial sum; _mean_pooling_finalize_kernel adds the splits and divides by
// the length (an empty sequence gives 0). Backward, _mean_pooling_bwd_kernel: token t of
// sequence n receives d_out[n] / length_n (zero outside every sequence), found by a binary
// search of the offsets; pure streaming writes.
#include <type_traits>

#include "common.cuh"

namespace ejk {
namespace {

constexpr int kCols = 32;  // threads along the columns
constexpr int kRows = 8;   // threads along the tokens
constexpr int kUnroll = 4;

__device__ __forceinline__ void sequence_bounds(const int32_t* offsets, int64_t uniform_len,
                                                int64_t n, int64_t* start, int64_t* end) {
  if (offsets) {
    *start = offsets[n];
    *end = offsets[n + 1];
  } else {
    *start = n * uniform_len;
    *end = (n + 1) * uniform_len;
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void load_cols(const T* p, float (&out)[VEC]) {
  if constexpr (VEC == 1) {
    out[0] = to_float<T>(p[0]);
  } else {
    load16<T>(p, out);
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kCols* kRows)
    _mean_pooling_fwd_kernel(const T* __restrict__ x, const int32_t* __restrict__ offsets,
                             int64_t uniform_len, int num_seqs, int d, int col_blocks,
                             int num_splits, float* __restrict__ partial) {
  const int col_block = blockIdx.x % col_blocks;
  const int rest = blockIdx.x / col_blocks;
  const int n = rest % num_seqs;
  const int split = rest / num_seqs;
  const int col = (col_block * kCols + threadIdx.x) * VEC;

  int64_t start, end;
  sequence_bounds(offsets, uniform_len, n, &start, &end);
  const int64_t len = end > start ? end - start : 0;
  const int64_t chunk = (len + num_splits - 1) / num_splits;
  const int64_t s_lo = start + split * chunk;
  const int64_t s_hi = min(end, s_lo + chunk);

  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
  if (col < d) {
    for (int64_t t0 = s_lo + threadIdx.y; t0 < s_hi; t0 += kRows * kUnroll) {
      float vals[kUnroll][VEC];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t t = t0 + u * kRows;
        if (t < s_hi) {
          load_cols<T, VEC>(x + t * d + col, vals[u]);
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i) vals[u][i] = 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += vals[u][i];
      }
    }
  }

  __shared__ float sm[kRows][kCols * VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) sm[threadIdx.y][threadIdx.x * VEC + i] = acc[i];
  __syncthreads();
  for (int c = threadIdx.y * kCols + threadIdx.x; c < kCols * VEC; c += kCols * kRows) {
    const int out_col = col_block * kCols * VEC + c;
    if (out_col >= d) continue;
    float sum = 0.f;
#pragma unroll
    for (int y = 0; y < kRows; ++y) sum += sm[y][c];
    partial[(static_cast<int64_t>(split) * num_seqs + n) * d + out_col] = sum;
  }
}

template <typename T>
__global__ void _mean_pooling_finalize_kernel(const float* __restrict__ partial,
                                              const int32_t* __restrict__ offsets,
                                              int64_t uniform_len, int num_seqs, int d,
                                              int num_splits, T* __restrict__ out) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(num_seqs) * d) return;
  const int64_t n = idx / d;
  int64_t start, end;
  sequence_bounds(offsets, uniform_len, n, &start, &end);
  const int64_t len = end > start ? end - start : 0;
  float sum = 0.f;
  for (int s = 0; s < num_splits; ++s) sum += partial[static_cast<int64_t>(s) * num_seqs * d + idx];
  out[idx] = from_float<T>(len > 0 ? sum / static_cast<float>(len) : 0.f);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kCols* kRows)
    _mean_pooling_bwd_kernel(const T* __restrict__ d_out, const int32_t* __restrict__ offsets,
                             int64_t uniform_len, int num_seqs, int64_t num_tokens, int d,
                             int col_blocks, T* __restrict__ dx) {
  const int col_block = blockIdx.x % col_blocks;
  const int64_t row_block = blockIdx.x / col_blocks;
  const int col = (col_block * kCols + threadIdx.x) * VEC;
  if (col >= d) return;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t t = (row_block * kUnroll + u) * kRows + threadIdx.y;
    if (t >= num_tokens) break;
    float vals[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) vals[i] = 0.f;
    int64_t n = -1, len = 0;
    if (offsets) {
      if (t >= offsets[0] && t < offsets[num_seqs]) {
        int lo = 0, hi = num_seqs - 1;  // the last n with offsets[n] <= t
        while (lo < hi) {
          const int mid = (lo + hi + 1) / 2;
          if (offsets[mid] <= t) lo = mid; else hi = mid - 1;
        }
        n = lo;
        len = offsets[n + 1] - offsets[n];
      }
    } else {
      n = t / uniform_len;
      len = uniform_len;
    }
    if (n >= 0 && len > 0) {
      const float inv = 1.f / static_cast<float>(len);
      load_cols<T, VEC>(d_out + n * d + col, vals);
#pragma unroll
      for (int i = 0; i < VEC; ++i) vals[i] *= inv;
    }
    T* p = dx + t * d + col;
    if constexpr (VEC == 1) {
      p[0] = from_float<T>(vals[0]);
    } else {
      store16<T>(p, vals);
    }
  }
}

template <typename T, int VEC>
void launch_fwd(const T* x, const int32_t* offsets, int64_t uniform_len, int num_seqs, int d,
                int num_splits, float* partial, T* out, cudaStream_t stream) {
  const int col_blocks = ceil_div(d, kCols * VEC);
  const int64_t blocks = static_cast<int64_t>(col_blocks) * num_seqs * num_splits;
  _mean_pooling_fwd_kernel<T, VEC><<<static_cast<unsigned>(blocks), dim3(kCols, kRows), 0, stream>>>(
      x, offsets, uniform_len, num_seqs, d, col_blocks, num_splits, partial);
  const int64_t total = static_cast<int64_t>(num_seqs) * d;
  _mean_pooling_finalize_kernel<T><<<ceil_div(total, 256), 256, 0, stream>>>(
      partial, offsets, uniform_len, num_seqs, d, num_splits, out);
}

template <typename T, int VEC>
void launch_bwd(const T* d_out, const int32_t* offsets, int64_t uniform_len, int num_seqs,
                int64_t num_tokens, int d, T* dx, cudaStream_t stream) {
  const int col_blocks = ceil_div(d, kCols * VEC);
  const int64_t row_blocks = (num_tokens + kRows * kUnroll - 1) / (kRows * kUnroll);
  const int64_t blocks = row_blocks * col_blocks;
  _mean_pooling_bwd_kernel<T, VEC><<<static_cast<unsigned>(blocks), dim3(kCols, kRows), 0, stream>>>(
      d_out, offsets, uniform_len, num_seqs, num_tokens, d, col_blocks, dx);
}

// The row width of ``in`` (its last dim), and launch(vec) with 16-byte vectors of T
// (std::integral_constant<int, kVec<T>>) when they tile the row, single elements otherwise.
template <typename T, typename Launch>
ffi::Error by_row_width(ffi::AnyBuffer in, const char* what, Launch&& launch) {
  const auto dims = in.dimensions();
  const int d = static_cast<int>(dims[dims.size() - 1]);
  if (d % kVec<T> == 0) {
    launch(d, std::integral_constant<int, kVec<T>>{});
  } else {
    launch(d, std::integral_constant<int, 1>{});
  }
  return launch_status(what);
}

template <typename T>
ffi::Error fwd_typed(ffi::AnyBuffer x, const int32_t* offsets, int64_t uniform_len, int num_seqs,
                     int num_splits, float* partial, ffi::AnyBuffer out, cudaStream_t stream) {
  const T* xp = static_cast<const T*>(x.untyped_data());
  T* op = static_cast<T*>(out.untyped_data());
  return by_row_width<T>(x, "ejkernel_mean_pooling_fwd", [&](int d, auto vec) {
    launch_fwd<T, vec()>(xp, offsets, uniform_len, num_seqs, d, num_splits, partial, op, stream);
  });
}

template <typename T>
ffi::Error bwd_typed(ffi::AnyBuffer d_out, const int32_t* offsets, int64_t uniform_len,
                     int num_seqs, int64_t num_tokens, ffi::AnyBuffer dx, cudaStream_t stream) {
  const T* gp = static_cast<const T*>(d_out.untyped_data());
  T* xp = static_cast<T*>(dx.untyped_data());
  return by_row_width<T>(d_out, "ejkernel_mean_pooling_bwd", [&](int d, auto vec) {
    launch_bwd<T, vec()>(gp, offsets, uniform_len, num_seqs, num_tokens, d, xp, stream);
  });
}

ffi::Error MeanPoolingFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> offsets,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::Buffer<ffi::F32>> partial, int64_t uniform_len,
                              int64_t num_splits) {
  const auto od = out->dimensions();  // [N, D]
  if (od.size() != 2 || x.dimensions().size() != 2 || num_splits < 1) {
    return ffi::Error::InvalidArgument("ejkernel_mean_pooling_fwd: unexpected shapes");
  }
  const int num_seqs = static_cast<int>(od[0]);
  if (num_seqs == 0 || od[1] == 0) return ffi::Error::Success();
  const int32_t* offs = uniform_len > 0 ? nullptr : offsets.typed_data();
  const int splits = static_cast<int>(num_splits);
  float* part = partial->typed_data();
  switch (x.element_type()) {
    case ffi::BF16: return fwd_typed<__nv_bfloat16>(x, offs, uniform_len, num_seqs, splits, part, *out, stream);
    case ffi::F16: return fwd_typed<__half>(x, offs, uniform_len, num_seqs, splits, part, *out, stream);
    case ffi::F32: return fwd_typed<float>(x, offs, uniform_len, num_seqs, splits, part, *out, stream);
    default: return ffi::Error::InvalidArgument("ejkernel_mean_pooling_fwd: unsupported dtype");
  }
}

ffi::Error MeanPoolingBwdImpl(cudaStream_t stream, ffi::AnyBuffer d_out,
                              ffi::Buffer<ffi::S32> offsets, ffi::Result<ffi::AnyBuffer> dx,
                              int64_t uniform_len) {
  const auto gd = d_out.dimensions();  // [N, D]
  const auto xd = dx->dimensions();    // [T, D]
  if (gd.size() != 2 || xd.size() != 2) {
    return ffi::Error::InvalidArgument("ejkernel_mean_pooling_bwd: unexpected shapes");
  }
  const int num_seqs = static_cast<int>(gd[0]);
  const int64_t num_tokens = xd[0];
  if (num_tokens == 0 || xd[1] == 0) return ffi::Error::Success();
  const int32_t* offs = uniform_len > 0 ? nullptr : offsets.typed_data();
  switch (d_out.element_type()) {
    case ffi::BF16: return bwd_typed<__nv_bfloat16>(d_out, offs, uniform_len, num_seqs, num_tokens, *dx, stream);
    case ffi::F16: return bwd_typed<__half>(d_out, offs, uniform_len, num_seqs, num_tokens, *dx, stream);
    case ffi::F32: return bwd_typed<float>(d_out, offs, uniform_len, num_seqs, num_tokens, *dx, stream);
    default: return ffi::Error::InvalidArgument("ejkernel_mean_pooling_bwd: unsupported dtype");
  }
}

}  // namespace
}  // namespace ejk

XLA_FFI_DEFINE_HANDLER_SYMBOL(EjkMeanPoolingFwd, ejk::MeanPoolingFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x [T, D]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // offsets [N + 1]
                                  .Ret<xla::ffi::AnyBuffer>()              // out [N, D]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // partial sums
                                  .Attr<int64_t>("uniform_len")
                                  .Attr<int64_t>("num_splits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EjkMeanPoolingBwd, ejk::MeanPoolingBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // d_out [N, D]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // offsets [N + 1]
                                  .Ret<xla::ffi::AnyBuffer>()              // dx [T, D]
                                  .Attr<int64_t>("uniform_len"));
