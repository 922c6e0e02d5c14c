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

// The 16-bit types: one 16-byte load; each 32-bit word holds two elements, low half first,
// converted to a float pair by Pack8<T>::pair.
template <typename T>
struct Pack8Of16Bit {
  struct Raw {
    uint4 a;
  };
  __device__ __forceinline__ static Raw load(const T* p) {
    return {__ldg(reinterpret_cast<const uint4*>(p))};
  }
  __device__ __forceinline__ static void convert(const Raw& r, float (&out)[8]) {
    const uint32_t w[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = Pack8<T>::pair(w[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};

template <>
struct Pack8<__nv_bfloat16> : Pack8Of16Bit<__nv_bfloat16> {
  // A bfloat16 is the high half of a float32.
  __device__ __forceinline__ static float2 pair(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
};

template <>
struct Pack8<__half> : Pack8Of16Bit<__half> {
  __device__ __forceinline__ static float2 pair(uint32_t w) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
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

// T <-> float, one specialisation a storage type.
template <typename T>
struct FloatOf;

template <>
struct FloatOf<float> {
  __device__ __forceinline__ static float to(float x) { return x; }
  __device__ __forceinline__ static float from(float x) { return x; }
};

template <>
struct FloatOf<__nv_bfloat16> {
  __device__ __forceinline__ static float to(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
};

template <>
struct FloatOf<__half> {
  __device__ __forceinline__ static float to(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half from(float x) { return __float2half_rn(x); }
};

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  return FloatOf<T>::from(x);
}

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return FloatOf<T>::to(x);
}

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
