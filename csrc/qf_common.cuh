// Shared device helpers for the qatfactory kernels (included by every csrc/*.cu).
// No CUDA headers: bf16/fp16/e4m3 conversions are inline PTX (sm_89+), so NVRTC needs no
// include path beyond csrc/ and nvcc needs nothing at all.
#pragma once
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define QF_DEV __device__ __forceinline__

// ------------------------------------------------------------------ element conversions
QF_DEV float bf16_to_f32(u32 h) { return __uint_as_float((h & 0xFFFFu) << 16); }
QF_DEV float f16_to_f32(u32 h) {
    float f;
    asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "r"(h));
    return f;
}
// The 16-bit result is widened to 32 bits inside the asm: with a bare "=h" output, ptxas
// 13.0 stored the wrong byte of it through st.u8 (q5_0's fp16 d came out with a zero low
// byte on the H200 while every ALU use of the same register was right).
QF_DEV u32 f32_to_bf16(float f) {
    u32 r;
    asm("{ .reg .b16 h; cvt.rn.bf16.f32 h, %1; cvt.u32.u16 %0, h; }" : "=r"(r) : "f"(f));
    return r;
}
QF_DEV u32 f32_to_f16(float f) {
    u32 r;
    asm("{ .reg .b16 h; cvt.rn.f16.f32 h, %1; cvt.u32.u16 %0, h; }" : "=r"(r) : "f"(f));
    return r;
}
// float -> E4M3 byte, RNE, |v| > 448 -> 448, NaN -> 0x7F (cvt.rn.satfinite; formats.md 0.2)
QF_DEV u8 f32_to_e4m3(float v) {
    u32 r;
    asm("{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, %1, %2; cvt.u32.u16 %0, t; }"
        : "=r"(r) : "f"(0.0f), "f"(v));
    return (u8)(r & 0xFFu);
}
QF_DEV float e4m3_to_f32(u8 b) {
    u32 e = (b >> 3) & 0xF, m = b & 7;
    float v;
    if ((b & 0x7F) == 0x7F) v = __uint_as_float(0x7FC00000u);
    else if (e == 0) v = (float)m * 0.001953125f;                  // m * 2^-9, exact
    else v = __uint_as_float(((e + 120u) << 23) | (m << 20));       // 2^(e-7) * (1 + m/8)
    return (b & 0x80) ? -v : v;
}
QF_DEV float e8m0_to_f32(u32 e) {
    if (e == 255u) return __uint_as_float(0x7FC00000u);
    return e == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(e << 23);
}

// E2M1 rounding of a magnitude a >= 0, as a float on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}.
// Adding then subtracting C = 1.5 * 2^(E+22) rounds a to a multiple of the grid step 2^(E-1)
// of its binade (E = clamp(floor(log2 a), 0, 3)) with the FPU's round-half-even, and the
// parity of the multiple is the parity of the E2M1 code, so this is exactly the RNE threshold
// rule (a <= .25 -> 0, < .75 -> .5, <= 1.25 -> 1, ...; checked against it on every threshold
// +-5 ulp, 2M random and subnormal values). TIE 1 (toward zero, ggml's first-index argmin)
// undoes the round-up of an exact tie. Saturates at lim (6, or less for ggml's top bytes);
// NaN -> lim (only NaN blocks, whose scale is NaN, reach it). ~7 ops instead of a 7-compare chain.
template <int TIE>
QF_DEV float e2m1_round(float a, float lim) {
    int E = (int)(__float_as_uint(a) >> 23) - 127;
    E = E < 0 ? 0 : (E > 3 ? 3 : E);
    float C = __uint_as_float(((u32)(E + 149) << 23) | 0x400000u);
    float r = (a + C) - C;
    if (TIE == 1) {
        float step = __uint_as_float((u32)(E + 126) << 23);
        if (r - a == 0.5f * step) r = r - step;
    }
    return r < lim ? r : lim;
}
// the 3-bit magnitude code of a grid value r (0 .5 1 1.5 2 3 4 6 -> 0..7), from its bits
QF_DEV u32 e2m1_mag_code(float r) {
    return r >= 1.0f ? (__float_as_uint(r) >> 22) - 252u : (r > 0.0f ? 1u : 0u);
}
// magnitude code -> value {0, .5, 1, 1.5, 2, 3, 4, 6}, built from the E2M1 bit fields
QF_DEV float e2m1_mag_value(u32 m) {
    u32 bits = m >= 2u ? ((((m >> 1) + 126u) << 23) | ((m & 1u) << 22)) : (m == 1u ? (126u << 23) : 0u);
    return __uint_as_float(bits);
}
// sign of the code. NEGZ 0: +0 for anything that rounds to 0 (ggml); 1: (v < 0) (ModelOpt:
// -0.0 -> code 0); 2: the sign bit of v (IEEE conversion: -0.0 -> code 8)
template <int NEGZ>
QF_DEV bool e2m1_neg(float v, float r) {
    if (NEGZ == 2) return (__float_as_uint(v) >> 31) != 0u;
    return v < 0.0f && (NEGZ == 1 || r != 0.0f);
}
// signed grid value (what e2m1 decode of the code gives, -0.0 for code 8) and the 4-bit code
template <int TIE, int NEGZ>
QF_DEV float e2m1_qval(float v, float lim) {
    float r = e2m1_round<TIE>(fabsf(v), lim);
    return e2m1_neg<NEGZ>(v, r) ? -r : r;
}
template <int TIE, int NEGZ>
QF_DEV u32 e2m1_code(float v, u32 maxc = 7u) {
    float r = e2m1_round<TIE>(fabsf(v), e2m1_mag_value(maxc));
    return e2m1_mag_code(r) | (e2m1_neg<NEGZ>(v, r) ? 8u : 0u);
}
QF_DEV float e2m1_value(u32 c) {
    float m = e2m1_mag_value(c & 7u);
    return (c & 8u) ? -m : m;
}

// ------------------------------------------------------------------ 16-byte vector I/O
// DT: 0 float32, 1 bfloat16, 2 float16.  EPT elements per 16-byte vector.
template <int DT> struct Vec { enum { EPT = DT == 0 ? 4 : 8 }; };

// The 16-byte word itself (raw bits) and its conversion are separate so that a kernel can
// move the raw words between lanes (warp shuffles) before or after converting them.
QF_DEV uint4 load_raw16(const void* base, i64 vec_index) {
    return reinterpret_cast<const uint4*>(base)[vec_index];
}
QF_DEV void store_raw16(void* base, i64 vec_index, uint4 r) {
    reinterpret_cast<uint4*>(base)[vec_index] = r;
}
template <int DT>
QF_DEV void unpack16(uint4 r, float* out) {
    u32 w[4] = {r.x, r.y, r.z, r.w};
    if (DT == 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) out[i] = __uint_as_float(w[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 lo = w[i] & 0xFFFFu, hi = w[i] >> 16;
            out[2 * i] = DT == 1 ? bf16_to_f32(lo) : f16_to_f32(lo);
            out[2 * i + 1] = DT == 1 ? bf16_to_f32(hi) : f16_to_f32(hi);
        }
    }
}
template <int DT>
QF_DEV uint4 pack16(const float* v) {
    u32 w[4];
    if (DT == 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 lo = DT == 1 ? f32_to_bf16(v[2 * i]) : f32_to_f16(v[2 * i]);
            u32 hi = DT == 1 ? f32_to_bf16(v[2 * i + 1]) : f32_to_f16(v[2 * i + 1]);
            w[i] = lo | (hi << 16);
        }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}
template <int DT>
QF_DEV void load16(const void* base, i64 vec_index, float* out) {
    unpack16<DT>(load_raw16(base, vec_index), out);
}
template <int DT>
QF_DEV void store16(void* base, i64 vec_index, const float* v) {
    store_raw16(base, vec_index, pack16<DT>(v));
}
