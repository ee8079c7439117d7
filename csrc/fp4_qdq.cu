// Fused quantize-dequantize for the E2M1 (FP4) formats: NVFP4 (E4M3 block scales + fp32
// per-tensor scale) and every MXFP4 flavour (E8M0 block scales).
//
//   x row [.... K ....]   blocks of BLOCK (16 NVFP4, 32 MX) consecutive elements along K
//   thread t  <- 16 bytes of x (8 bf16/fp16 or 4 fp32 elements); LPB = BLOCK / EPT lanes
//                own one block and agree on its amax with warp shuffles.
//   outputs   y  = dequantize(quantize(x)) in x's dtype         (WRITE_Y)
//             codes [..., K/2] pairs: element 2i low nibble      (WRITE_Q)
//             scales [..., K/BLOCK] E4M3 / E8M0 bytes            (WRITE_Q)
//             dx = g * inside-range mask (clipped STE)           (BWD)
//   NVFP4 (RULE 0/1) also has nvfp4_qdq16 below: one thread per 16-element block, the per-tensor
//   constants precomputed per group (nvfp4_consts); the same bits, fewer ALU ops per element.
//
// The numerics are the emulator's (qatfactory/formats/nvfp4.py, mxfp4.py), which follow:
//   RULE 0  NVFP4 weights, NVIDIA Model Optimizer NVFP4QTensor (formats.md 1.2):
//           g = amax/2688; s = amax_b/(6g) (6g rounded first); s==0 -> 1; clamp [2^-9, 448];
//           e4m3 RNE; v = x / (s8*g); y = e2m1 * (s8*g).
//   RULE 1  NVFP4 activations, vLLM/FlashInfer cvt_warp_fp16_to_fp4 with exact reciprocals
//           (formats.md 1.3): S = 1/(amax/2688); SF = S*(vmax*RN(1/6)); s8 = e4m3(SF);
//           out = s8 ? 1/(s8*(1/S)) : 0; v = x*out; y = (e2m1*s8)*(amax/2688).
//   RULE 2  MX FLOOR (OCP):   e = floor(log2 amax) - 2       (exponent bits, exact)
//   RULE 3  MX RCEIL:         e = ceil(log2(RN(amax/6)))     (bit trick, exact)
//   RULE 4  MX EVEN:          exponent bits of (bits(amax) + 2^21) - 2
//   RULE 5  ggml MXFP4:       e = floor(RN_f32(log2 amax)) - 2 (log2f, correctly rounded)
//   TIE 0 = RNE (a <= .25, < .75, <= 1.25, < 1.75, <= 2.5, < 3.5, <= 5), 1 = toward zero
//   NEGZ 1: a negative value that rounds to 0 keeps the sign bit (code 8); 0: code 0.
// Every float op is IEEE single with round-to-nearest: the module is compiled with
// --fmad=false and without fast math, so a*b+c is two roundings, as in torch/numpy.
#include "qf_common.cuh"

// ------------------------------------------------------------------ block scale rules
struct BlockScale {
    float div;    // RULE 0: v = x / div
    float mul;    // RULE 1-5: v = x * mul
    float s8;     // decoded block scale (RULE 0/1)
    float dec;    // y = e2m1 * dec (RULE 0, MX), (e2m1 * s8) * dec (RULE 1), (2*e2m1) * dec (RULE 5)
    float rdiv;   // RULE 0: RN(1 / div), for the corrected-reciprocal division
    float lim;    // largest magnitude the engine can emit with this byte (6; less for ggml 253+)
    u32 byte;     // stored scale byte
    u32 maxc;     // its code
};

QF_DEV int exp_bits(float a) { return (int)((__float_as_uint(a) >> 23) & 0xFF); }
// exact float 2^n for n in [-149, 127], built from the bits (subnormals included)
QF_DEV float pow2i(int n) {
    if (n >= -126) return __uint_as_float((u32)(n + 127) << 23);
    return __uint_as_float(1u << (n + 149));
}

// NVFP4 (RULE 0/1) splits into what depends on the per-tensor (per-group) amax only and what
// depends on the block's amax. The first part is computed once per group by nvfp4_consts
// for nvfp4_qdq16, and inline per lane by fp4_qdq: both kernels run these same two functions,
// so they execute the same float32 operations in the same order.
//   RULE 0: c = {g, fl(6*g)}            g = amax/2688
//   RULE 1: c = {in_scale, S, fl(1/S)}  in_scale = amax/2688, S = 1/in_scale
template <int RULE>
QF_DEV float4 nvfp4_group_consts(float tensor_amax) {
    // nvfp4.py guard: g = amax/2688 zero or subnormal -> amax := 1.0 (NaN stays NaN)
    if (tensor_amax / 2688.0f < 1.17549435e-38f) tensor_amax = 1.0f;
    float g = tensor_amax / 2688.0f;
    if (RULE == 0) return make_float4(g, 6.0f * g, 0.0f, 0.0f);
    float S = 1.0f / g;
    return make_float4(g, S, 1.0f / S, 0.0f);
}
template <int RULE>
QF_DEV void nvfp4_block_scale(BlockScale& r, float amax_b, float4 c) {
    if (RULE == 0) {
        float s = amax_b / c.y;                       // amax_b / fl(6*g)
        if (s == 0.0f) s = 1.0f;
        s = s < 0.001953125f ? 0.001953125f : (s > 448.0f ? 448.0f : s);   // torch.clamp: NaN stays NaN
        r.byte = f32_to_e4m3(s);
        r.s8 = e4m3_to_f32((u8)r.byte);
        r.div = r.s8 * c.x;                           // fl(s8 * g)
        r.rdiv = 1.0f / r.div;
        r.dec = r.div;
    } else {
        float SF = c.y * (amax_b * 0.16666667163372040f);  // S * fl(vmax * RN(1/6)); RN(1/6) = 0x3E2AAAAB
        r.byte = f32_to_e4m3(SF);
        r.s8 = e4m3_to_f32((u8)r.byte);
        r.mul = r.byte != 0u ? 1.0f / (r.s8 * c.z) : 0.0f;   // 1 / fl(s8 * fl(1/S))
        r.dec = c.x;                                  // in_scale
    }
}

template <int RULE>
QF_DEV BlockScale block_scale(float amax_b, float tensor_amax) {
    BlockScale r;
    r.mul = 0.0f; r.div = 1.0f; r.rdiv = 1.0f; r.s8 = 0.0f; r.maxc = 7u;
    if (RULE <= 1) {
        nvfp4_block_scale<RULE>(r, amax_b, nvfp4_group_consts<RULE>(tensor_amax));
    } else {
        u32 bits = __float_as_uint(amax_b);
        int b;
        if (RULE == 2) {                      // torchao FLOOR: exponent field - 2, clamped at 0
            b = max(exp_bits(amax_b) - 2, 0);
        } else if (RULE == 4) {               // torchao EVEN
            b = max((int)(((bits + 0x200000u) >> 23) & 0xFF) - 2, 0);
        } else if (RULE == 3) {               // triton_kernels ROUND_UP on q = RN(amax/6)
            u32 qb = __float_as_uint(amax_b / 6.0f);
            b = (int)(((qb + 0x7FFFFFu) >> 23) & 0xFF);
        } else {                              // ggml: (uint8)(floorf(log2f(amax)) - 2 + 127)
            b = amax_b > 0.0f ? (((int)floorf((float)log2((double)amax_b)) - 2 + 127) & 0xFF) : 0;
        }
        if (RULE != 5 && !(amax_b == amax_b)) b = 255;   // NaN block -> NaN scale byte
        r.byte = (u32)b;
        if (RULE == 5) {
            r.mul = pow2i(127 - b);           // 2^(127-b); the half scale d = 2^(b-128) decodes
            r.dec = pow2i(b - 128);
            r.maxc = b == 253 ? 5u : (b == 254 ? 3u : (b == 255 ? 1u : 7u));   // kvalue*d must stay finite
        } else {
            r.dec = e8m0_to_f32((u32)b);
            if (b == 255) r.mul = __uint_as_float(0x7FC00000u);
            else if (b == 0) r.mul = RULE == 3 ? 0.0f : 8.50705917e+37f;   // triton: scale 0; torchao: max(2^-127, 2^-126)
            else r.mul = pow2i(127 - b);
        }
    }
    r.lim = e2m1_mag_value(r.maxc);
    return r;
}

// RN(x / s.div) for RULE 0 without a full division per element: q = x * RN(1/D), then one
// FMA correction with the exact remainder; with RN(1/D) correctly rounded this is the
// correctly rounded quotient (Markstein; checked against IEEE division on 60k x/D, half of
// them a few ulp around E2M1 thresholds). Quotients near the subnormal range, where the
// theorem's no-underflow condition fails, take the IEEE division.
template <int RULE>
QF_DEV float scale_elem(float x, const BlockScale& s) {
    if (RULE != 0) return x * s.mul;
    float q = x * s.rdiv;
    float r = __fmaf_rn(-q, s.div, x);
    float q1 = __fmaf_rn(r, s.rdiv, q);
    if (!(fabsf(q1) >= 1e-30f && fabsf(q1) <= 1e30f)) q1 = x / s.div;
    return q1;
}
// dequantized value of a signed grid value q (= e2m1 decode of the code)
template <int RULE>
QF_DEV float dequant_q(float q, const BlockScale& s) {
    if (RULE == 1) return (q * s.s8) * s.dec;
    if (RULE == 5) return (q * 2.0f) * s.dec;
    return q * s.dec;
}

// ------------------------------------------------------------------ the kernels
// MODE bit 1: write y; bit 2: write codes + scales; bit 4: backward (dx = g * mask).
// amax: per-group tensor amax (RULE 0/1), group = block / blocks_per_group.
template <int DT, int BLOCK, int RULE, int TIE, int NEGZ, int MODE>
__global__ void __launch_bounds__(256) fp4_qdq(const void* __restrict__ x, void* __restrict__ y,
                                               const void* __restrict__ g, u8* __restrict__ codes,
                                               u8* __restrict__ scales, const float* __restrict__ amax,
                                               i64 n_vec, i64 blocks_per_group) {
    constexpr int EPT = Vec<DT>::EPT;
    constexpr int LPB = BLOCK / EPT;
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    bool live = t < n_vec;
    i64 tv = live ? t : n_vec - 1;   // dead lanes still shuffle, on a valid address
    float v[EPT];
    load16<DT>(x, tv, v);
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < EPT; ++i) a = fmaxf(a, fabsf(v[i]));
    bool any_nan = false;
#pragma unroll
    for (int i = 0; i < EPT; ++i) any_nan |= !(v[i] == v[i]);
#pragma unroll
    for (int o = 1; o < LPB; o <<= 1) {
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
        any_nan |= __shfl_xor_sync(0xFFFFFFFFu, (int)any_nan, o) != 0;
    }
    if (any_nan) a = __uint_as_float(0x7FC00000u);
    i64 blk = tv / LPB;
    float tamax = (RULE <= 1) ? amax[blk / blocks_per_group] : 0.0f;
    BlockScale s = block_scale<RULE>(a, tamax);
    if (!live) return;
    float sv[EPT];
#pragma unroll
    for (int i = 0; i < EPT; ++i) sv[i] = scale_elem<RULE>(v[i], s);
    if (MODE & 1) {
        float o[EPT];
#pragma unroll
        for (int i = 0; i < EPT; ++i) o[i] = dequant_q<RULE>(e2m1_qval<TIE, NEGZ>(sv[i], s.lim), s);
        store16<DT>(y, t, o);
    }
    if (MODE & 2) {
        u32 c[EPT];
#pragma unroll
        for (int i = 0; i < EPT; ++i) c[i] = e2m1_code<TIE, NEGZ>(sv[i], s.maxc);
        if (EPT == 8) {
            u32 w = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) w |= c[i] << (4 * i);
            reinterpret_cast<u32*>(codes)[t] = w;
        } else {
            u32 w = c[0] | (c[1] << 4) | (c[2] << 8) | (c[3] << 12);
            reinterpret_cast<u16*>(codes)[t] = (u16)w;
        }
        if ((t % LPB) == 0) scales[blk] = (u8)s.byte;
    }
    if (MODE & 4) {
        // clipped STE: gradient passes where |v| <= 6 (the block's representable range)
        float gv[EPT], o[EPT];
        load16<DT>(g, t, gv);
#pragma unroll
        for (int i = 0; i < EPT; ++i) {
            // g * mask, as torch computes it (so -g * 0 = -0); the range ends at the largest
            // value the block can encode (6, or less for ggml's top scale bytes)
            o[i] = gv[i] * (fabsf(sv[i]) <= s.lim ? 1.0f : 0.0f);
        }
        store16<DT>(y, t, o);
    }
}

// ------------------------------------------------------------------ NVFP4, one thread per block
// The per-group constants of nvfp4_group_consts, once per group (one thread per group), for
// nvfp4_qdq16. amax: [n_groups] float32; out: [n_groups] float4.
template <int RULE>
__global__ void __launch_bounds__(256) nvfp4_consts(const float* __restrict__ amax, float4* __restrict__ out,
                                                    i64 n_groups) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n_groups) out[i] = nvfp4_group_consts<RULE>(amax[i]);
}

// NVFP4 fake quant (RULE 0 weights, RULE 1 activations; BLOCK 16) with ONE thread per
// 16-element block, so the block's scale (two IEEE divisions, the E4M3 rounding) is computed
// once per block instead of once per 16-byte lane, and the per-tensor part comes from the
// precomputed float4 of nvfp4_consts instead of a division per thread. Same numerics as
// fp4_qdq<DT, 16, RULE, ...> bit for bit: the block amax is an exact max (any order), the
// block scale runs nvfp4_block_scale on the same constants, the elements run scale_elem /
// e2m1_qval / dequant_q / e2m1_code exactly as there.
//
// Layout (XCHG): the thread's block is 32 bytes (bf16/fp16: two 16-byte vectors) or 64 bytes
// (fp32: four).
//   XCHG 0: thread t reads vectors VPB*t .. VPB*t+VPB-1 itself. Each load instruction of a warp
//           uses half of every 32-byte sector it touches (the other half is the same warp's
//           next instruction, normally an L1 hit); stores likewise write half sectors.
//   XCHG 1 (bf16/fp16 only): a warp owns a tile of 32 blocks = 64 vectors and reads it with two
//           fully coalesced loads (lane l: vectors l and 32+l); one 4-word shuffle with the
//           neighbour lane (l^1) turns that into whole blocks (even lane 2k: block k = vectors
//           2k, 2k+1; odd lane 2k+1: block 16+k = vectors 32+2k, 33+2k), and the mirror
//           shuffle before the two coalesced stores undoes it. Each exchange costs 4 SHFL
//           (one per 32-bit word) and 8 selects; both variants are benchmarked
//           (QF_NVFP4_KERNEL=v2 / v2x).
// MODE: bit 1 y, bit 2 codes + scales, bit 4 clipped-STE backward (dx = g * (|v| <= 6)).
// gc: [n_groups] float4 from nvfp4_consts; group of block b = b / blocks_per_group.
QF_DEV uint4 shfl_xor1(uint4 r) {
    return make_uint4(__shfl_xor_sync(0xFFFFFFFFu, r.x, 1), __shfl_xor_sync(0xFFFFFFFFu, r.y, 1),
                      __shfl_xor_sync(0xFFFFFFFFu, r.z, 1), __shfl_xor_sync(0xFFFFFFFFu, r.w, 1));
}
QF_DEV uint4 sel4(bool c, uint4 a, uint4 b) { return c ? a : b; }

template <int DT, int VPB, int XCHG>
QF_DEV void nvfp4_load_block(const void* __restrict__ src, i64 blk, i64 tile, int lane, i64 n_vec, uint4* raw) {
    if (XCHG) {
        i64 base = tile * 64;
        i64 ia = base + lane, ib = base + 32 + lane;
        uint4 A = load_raw16(src, ia < n_vec ? ia : n_vec - 1);   // dead lanes read a valid vector
        uint4 B = load_raw16(src, ib < n_vec ? ib : n_vec - 1);
        bool odd = (lane & 1) != 0;
        uint4 recv = shfl_xor1(sel4(odd, A, B));      // even lane sends B, odd lane sends A
        raw[0] = sel4(odd, recv, A);
        raw[1] = sel4(odd, B, recv);
    } else {
#pragma unroll
        for (int j = 0; j < VPB; ++j) raw[j] = load_raw16(src, blk * VPB + j);
    }
}
template <int DT, int VPB, int XCHG>
QF_DEV void nvfp4_store_block(void* __restrict__ dst, i64 blk, i64 tile, int lane, i64 n_vec, const uint4* out) {
    if (XCHG) {
        i64 base = tile * 64;
        bool odd = (lane & 1) != 0;
        uint4 recv = shfl_xor1(sel4(odd, out[0], out[1]));   // even lane sends its 2nd half, odd its 1st
        // vector base+l: even l -> own 1st half; odd l -> even neighbour's 2nd half.
        // vector base+32+l: even l -> odd neighbour's 1st half; odd l -> own 2nd half.
        // Each is written iff it is < n_vec, i.e. iff the block it belongs to exists.
        i64 ia = base + lane, ib = base + 32 + lane;
        if (ia < n_vec) store_raw16(dst, ia, sel4(odd, recv, out[0]));
        if (ib < n_vec) store_raw16(dst, ib, sel4(odd, out[1], recv));
    } else {
#pragma unroll
        for (int j = 0; j < VPB; ++j) store_raw16(dst, blk * VPB + j, out[j]);
    }
}

template <int DT, int RULE, int TIE, int NEGZ, int MODE, int XCHG>
__global__ void __launch_bounds__(256) nvfp4_qdq16(const void* __restrict__ x, void* __restrict__ y,
                                                   const void* __restrict__ g, u8* __restrict__ codes,
                                                   u8* __restrict__ scales, const float4* __restrict__ gc,
                                                   i64 n_blk, i64 blocks_per_group) {
    static_assert(RULE == 0 || RULE == 1, "nvfp4_qdq16 implements the NVFP4 rules 0 and 1");
    constexpr int EPT = Vec<DT>::EPT;
    constexpr int VPB = 16 / EPT;             // 16-byte vectors per block: 2 (bf16/fp16) or 4 (fp32)
    static_assert(XCHG == 0 || VPB == 2, "XCHG needs two vectors per block (bf16/fp16)");
    const i64 n_vec = n_blk * VPB;
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = (int)(threadIdx.x & 31u);
    const i64 tile = t >> 5;                  // XCHG: the warp's tile of 32 blocks
    i64 blk;
    if (XCHG) {
        if (tile * 64 >= n_vec) return;       // the whole warp is past the end (warp-uniform)
        blk = tile * 32 + ((lane & 1) ? 16 : 0) + (lane >> 1);
    } else {
        blk = t;
        if (blk >= n_blk) return;             // no shuffles below: dead threads just leave
    }
    const bool live = blk < n_blk;            // false only for XCHG lanes of the last, partial tile
    const i64 cblk = live ? blk : n_blk - 1;

    uint4 raw[VPB];
    nvfp4_load_block<DT, VPB, XCHG>(x, blk, tile, lane, n_vec, raw);
    float v[16];
#pragma unroll
    for (int j = 0; j < VPB; ++j) unpack16<DT>(raw[j], v + j * EPT);

    // the block amax: exact, so the order (fp4_qdq: per lane, then shuffles) does not matter
    float a = 0.0f;
    bool any_nan = false;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        a = fmaxf(a, fabsf(v[i]));
        any_nan |= !(v[i] == v[i]);
    }
    if (any_nan) a = __uint_as_float(0x7FC00000u);

    i64 grp;
    if (blocks_per_group >= n_blk) grp = 0;                                       // one amax (common)
    else if (n_blk <= 0xFFFFFFFFll) grp = (i64)((u32)cblk / (u32)blocks_per_group);   // 32-bit divide
    else grp = cblk / blocks_per_group;
    BlockScale s;
    s.mul = 0.0f; s.div = 1.0f; s.rdiv = 1.0f; s.s8 = 0.0f; s.maxc = 7u;
    nvfp4_block_scale<RULE>(s, a, gc[grp]);
    s.lim = 6.0f;                             // e2m1_mag_value(7)

    float sv[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) sv[i] = scale_elem<RULE>(v[i], s);
    if (MODE & 1) {
        float o[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) o[i] = dequant_q<RULE>(e2m1_qval<TIE, NEGZ>(sv[i], s.lim), s);
        uint4 w[VPB];
#pragma unroll
        for (int j = 0; j < VPB; ++j) w[j] = pack16<DT>(o + j * EPT);
        nvfp4_store_block<DT, VPB, XCHG>(y, blk, tile, lane, n_vec, w);
    }
    if ((MODE & 2) && live) {
        unsigned long long w = 0;
#pragma unroll
        for (int i = 0; i < 16; ++i) w |= (unsigned long long)e2m1_code<TIE, NEGZ>(sv[i], s.maxc) << (4 * i);
        reinterpret_cast<unsigned long long*>(codes)[blk] = w;    // element 2i -> low nibble of byte i
        scales[blk] = (u8)s.byte;
    }
    if (MODE & 4) {
        // clipped STE, as fp4_qdq: g * (|v| <= 6 ? 1 : 0), so -g * 0 = -0
        uint4 graw[VPB];
        nvfp4_load_block<DT, VPB, XCHG>(g, blk, tile, lane, n_vec, graw);
        float o[16];
#pragma unroll
        for (int j = 0; j < VPB; ++j) unpack16<DT>(graw[j], o + j * EPT);
#pragma unroll
        for (int i = 0; i < 16; ++i) o[i] = o[i] * (fabsf(sv[i]) <= s.lim ? 1.0f : 0.0f);
        uint4 w[VPB];
#pragma unroll
        for (int j = 0; j < VPB; ++j) w[j] = pack16<DT>(o + j * EPT);
        nvfp4_store_block<DT, VPB, XCHG>(y, blk, tile, lane, n_vec, w);
    }
}

// Per-group max |x| (group = contiguous run of group_vecs 16-byte vectors); out must be
// zeroed first. Non-negative floats order like their bit patterns, so atomicMax on the bits
// is the float max; a NaN (0x7FC00000 > Inf's bits) wins and poisons the group's amax.
template <int DT>
__global__ void __launch_bounds__(256) absmax_groups(const void* __restrict__ x, float* __restrict__ out,
                                                     i64 group_vecs) {
    constexpr int EPT = Vec<DT>::EPT;
    i64 grp = blockIdx.y;
    float a = 0.0f;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < group_vecs; i += (i64)gridDim.x * blockDim.x) {
        float v[EPT];
        load16<DT>(x, grp * group_vecs + i, v);
#pragma unroll
        for (int k = 0; k < EPT; ++k) {
            float av = fabsf(v[k]);
            a = (av > a || !(av == av)) ? av : a;
        }
    }
    u32 b = __float_as_uint(a);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) b = max(b, __shfl_xor_sync(0xFFFFFFFFu, b, o));
    __shared__ u32 red[8];
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = b;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 m = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) m = max(m, red[w]);
        atomicMax(reinterpret_cast<u32*>(out) + grp, m);
    }
}

// LSQ fake quant on the E2M1 grid with a learned per-block float scale s (already on the
// caller's scale grid): y = e2m1(x/s) * s; dx = g where |x/s| <= 6; ds = sum over the block
// of g * (inside ? e2m1(v) - v : sign(v) * 6), times grad_scale (Esser et al., LSQ).
// MODE 1: forward y.  MODE 4: backward dx, ds (ds zeroed by the caller; one atomicAdd per
// lane group, so ds is summed in an unspecified order -- the only non-bitwise output here).
template <int DT, int BLOCK, int TIE, int MODE>
__global__ void __launch_bounds__(256) lsq_e2m1(const void* __restrict__ x, const float* __restrict__ s,
                                                const void* __restrict__ g, void* __restrict__ y,
                                                float* __restrict__ ds, i64 n_vec, float grad_scale) {
    constexpr int EPT = Vec<DT>::EPT;
    constexpr int LPB = BLOCK / EPT;
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    bool live = t < n_vec;
    i64 tv = live ? t : n_vec - 1;
    float v[EPT];
    load16<DT>(x, tv, v);
    i64 blk = tv / LPB;
    float sc = s[blk];
    if (MODE == 1) {
        if (!live) return;
        float o[EPT];
#pragma unroll
        for (int i = 0; i < EPT; ++i) o[i] = e2m1_value(e2m1_code<TIE, 1>(v[i] / sc)) * sc;
        store16<DT>(y, t, o);
        return;
    }
    float gv[EPT], o[EPT];
    load16<DT>(g, tv, gv);
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
        float q = v[i] / sc;
        bool inside = fabsf(q) <= 6.0f;
        o[i] = gv[i] * (inside ? 1.0f : 0.0f);
        float d = inside ? e2m1_value(e2m1_code<TIE, 1>(q)) - q : (q < 0.0f ? -6.0f : 6.0f);
        acc += live ? gv[i] * d : 0.0f;
    }
#pragma unroll
    for (int o2 = 1; o2 < LPB; o2 <<= 1) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, o2);
    if (!live) return;
    store16<DT>(y, t, o);
    if ((t % LPB) == 0) atomicAdd(ds + blk, acc * grad_scale);
}

#ifdef QF_NVCC_CHECK
// Explicit instantiations so that `nvcc -arch=sm_90 -c -DQF_NVCC_CHECK` type-checks every
// rule (NVRTC instantiates them on demand through name expressions instead).
#define QF_I(DT, B, R, T, N, M) template __global__ void fp4_qdq<DT, B, R, T, N, M>(const void*, void*, const void*, u8*, u8*, const float*, i64, i64);
QF_I(0, 16, 0, 0, 1, 1) QF_I(1, 16, 0, 0, 1, 3) QF_I(2, 16, 1, 0, 1, 1) QF_I(1, 32, 2, 0, 1, 2)
QF_I(1, 32, 3, 0, 1, 1) QF_I(0, 32, 4, 0, 1, 4) QF_I(2, 32, 5, 1, 0, 3) QF_I(1, 16, 0, 0, 1, 4)
#define QF_J(DT, R, T, N, M, X) template __global__ void nvfp4_qdq16<DT, R, T, N, M, X>(const void*, void*, const void*, u8*, u8*, const float4*, i64, i64);
QF_J(1, 0, 0, 1, 1, 0) QF_J(1, 0, 0, 1, 1, 1) QF_J(2, 0, 0, 1, 3, 0) QF_J(0, 0, 0, 1, 1, 0) QF_J(0, 0, 0, 1, 4, 0)
QF_J(1, 0, 0, 1, 4, 0) QF_J(1, 0, 0, 1, 4, 1) QF_J(1, 0, 0, 1, 2, 1) QF_J(1, 1, 0, 2, 1, 0) QF_J(2, 1, 0, 2, 1, 1)
QF_J(0, 1, 0, 2, 2, 0) QF_J(1, 1, 0, 2, 3, 1)
template __global__ void nvfp4_consts<0>(const float*, float4*, i64);
template __global__ void nvfp4_consts<1>(const float*, float4*, i64);
template __global__ void absmax_groups<1>(const void*, float*, i64);
template __global__ void lsq_e2m1<1, 16, 0, 1>(const void*, const float*, const void*, void*, float*, i64, float);
template __global__ void lsq_e2m1<0, 32, 0, 4>(const void*, const float*, const void*, void*, float*, i64, float);
#endif
