// Shared helpers of the ejkernel CUDA kernels: 16-byte vector loads converted to float,
// stores back to the storage type, and the error plumbing of the XLA FFI handlers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ejk {

namespace ffi = xla::ffi;

constexpr float kLog2e = 1.4426950408889634f;

// Eight consecutive elements of T: read raw with 16-byte loads (one for 16-bit types, two for
// float32) so loads can be issued early and kept in few registers, converted to float on use.
template <typename T>
struct Pack8;

template <>
struct Pack8<__nv_bfloat16> {
  struct Raw {
    uint4 a;
  };
  __device__ __forceinline__ static Raw load(const __nv_bfloat16* p) {
    return {__ldg(reinterpret_cast<const uint4*>(p))};
  }
  __device__ __forceinline__ static void convert(const Raw& r, float (&out)[8]) {
    const uint32_t w[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
};

template <>
struct Pack8<__half> {
  struct Raw {
    uint4 a;
  };
  __device__ __forceinline__ static Raw load(const __half* p) {
    return {__ldg(reinterpret_cast<const uint4*>(p))};
  }
  __device__ __forceinline__ static void convert(const Raw& r, float (&out)[8]) {
    const uint32_t w[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};

template <>
struct Pack8<float> {
  struct Raw {
    float4 a, b;
  };
  __device__ __forceinline__ static Raw load(const float* p) {
    const float4* v = reinterpret_cast<const float4*>(p);
    return {__ldg(v), __ldg(v + 1)};
  }
  __device__ __forceinline__ static void convert(const Raw& r, float (&out)[8]) {
    out[0] = r.a.x, out[1] = r.a.y, out[2] = r.a.z, out[3] = r.a.w;
    out[4] = r.b.x, out[5] = r.b.y, out[6] = r.b.z, out[7] = r.b.w;
  }
};

template <typename T>
__device__ __forceinline__ typename Pack8<T>::Raw zero_raw() {
  typename Pack8<T>::Raw r;
  memset(&r, 0, sizeof(r));
  return r;
}

// Elements of T per 16-byte vector.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

// 16 bytes of T <-> float[kVec<T>].
template <typename T>
__device__ __forceinline__ void load16(const T* p, float (&out)[kVec<T>]);

template <>
__device__ __forceinline__ void load16<float>(const float* p, float (&out)[4]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
}

template <>
__device__ __forceinline__ void load16<__nv_bfloat16>(const __nv_bfloat16* p, float (&out)[8]) {
  Pack8<__nv_bfloat16>::convert(Pack8<__nv_bfloat16>::load(p), out);
}

template <>
__device__ __forceinline__ void load16<__half>(const __half* p, float (&out)[8]) {
  Pack8<__half>::convert(Pack8<__half>::load(p), out);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

// float[kVec<T>] -> 16 bytes of T.
template <typename T>
__device__ __forceinline__ void store16(T* p, const float (&in)[kVec<T>]) {
  union {
    uint4 raw;
    T elems[kVec<T>];
  } u;
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) u.elems[i] = from_float<T>(in[i]);
  *reinterpret_cast<uint4*>(p) = u.raw;
}

inline ffi::Error launch_status(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace ejk
