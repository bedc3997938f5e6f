// Attention scores over int8 KV rows with integer dot products (flash.h).
//
// A query vector is rounded to int8 per group of channels (the groups of the keys' scales):
// q = qs * qc. Then q . k = sum over groups g of qs_g * ks_g * (qc_g . kc_g), the inner dot
// in integers. A tile's key codes are transposed in units of 4 channels (one int32 each), so
// one instruction takes 4 channels of one query against 4 channels of 8 or 16 keys:
//   - AVX-512 VNNI (and AVX-VNNI): vpdpbusd multiplies unsigned by signed bytes, so the keys'
//     codes go in with 128 added (kc + 128 in 1..255) and the query's 128 * sum(qc) comes off
//     after;
//   - AVX2: vpmaddubsw on |kc| and qc with kc's sign (no overflow: |kc|, |qc| <= 127), then
//     vpmaddwd to int32;
//   - otherwise plain C++.
// Every path computes the same integers, so the scores are the same on every CPU.
#include "flash.h"

namespace rs {
namespace flash {
namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define RS_I8_512 1
constexpr int L = 16;  // keys per integer vector
constexpr int RMAX = 6;
#elif defined(RS_AVX2)
#define RS_I8_256 1
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define RS_I8_BIAS 1  // vpdpbusd on 256 bits
#endif
constexpr int L = 8;
constexpr int RMAX = 3;
#else
constexpr int L = 8;
constexpr int RMAX = 6;
#endif

#if defined(RS_I8_512) || defined(RS_I8_BIAS)
constexpr bool kBias = true;  // key codes stored with 128 added
#else
constexpr bool kBias = false;
#endif

inline int32_t unit_at(const int8_t* p) {
  int32_t u;
  std::memcpy(&u, p, 4);
  return u;
}

#if defined(RS_I8_512)
template <int R>
void scores_r(const QueriesI8& q, int64_t first, int64_t D, int64_t group, const KeysI8& k, float* s) {
  const int64_t NG = D / group, UPG = group / 4;
  for (int v0 = 0; v0 < BK; v0 += 2 * L) {
    __m512 f[R][2];
    for (int i = 0; i < R; ++i) f[i][0] = f[i][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < NG; ++g) {
      __m512i acc[R][2];
      for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
      for (int64_t u = g * UPG; u < (g + 1) * UPG; ++u) {
        const __m512i k0 = _mm512_loadu_si512(k.units.data() + u * BK + v0);
        const __m512i k1 = _mm512_loadu_si512(k.units.data() + u * BK + v0 + L);
        for (int i = 0; i < R; ++i) {
          const __m512i qb = _mm512_set1_epi32(unit_at(q.codes.data() + (first + i) * D + 4 * u));
          acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], k0, qb);
          acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], k1, qb);
        }
      }
      const __m512 s0 = _mm512_loadu_ps(k.scale.data() + g * BK + v0);
      const __m512 s1 = _mm512_loadu_ps(k.scale.data() + g * BK + v0 + L);
      for (int i = 0; i < R; ++i) {
        const __m512 qs = _mm512_set1_ps(q.scale[(first + i) * NG + g]);
        const __m512 off = _mm512_set1_ps(q.offset[(first + i) * NG + g]);
        f[i][0] = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(acc[i][0]), off), _mm512_mul_ps(s0, qs), f[i][0]);
        f[i][1] = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(acc[i][1]), off), _mm512_mul_ps(s1, qs), f[i][1]);
      }
    }
    for (int i = 0; i < R; ++i) {
      _mm512_storeu_ps(s + i * BK + v0, f[i][0]);
      _mm512_storeu_ps(s + i * BK + v0 + L, f[i][1]);
    }
  }
}
#elif defined(RS_I8_256)
inline __m256i dot4_i8(__m256i acc, __m256i kc, __m256i kabs, __m256i qb) {
#if defined(RS_I8_BIAS)
  (void)kabs;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, kc, qb);
#else
  return _mm256_dpbusd_avx_epi32(acc, kc, qb);
#endif
#else
  const __m256i p = _mm256_maddubs_epi16(kabs, _mm256_sign_epi8(qb, kc));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

template <int R>
void scores_r(const QueriesI8& q, int64_t first, int64_t D, int64_t group, const KeysI8& k, float* s) {
  const int64_t NG = D / group, UPG = group / 4;
  for (int v0 = 0; v0 < BK; v0 += L) {
    __m256 f[R];
    for (int i = 0; i < R; ++i) f[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < NG; ++g) {
      __m256i acc[R];
      for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_si256();
      for (int64_t u = g * UPG; u < (g + 1) * UPG; ++u) {
        const __m256i kc = load32(k.units.data() + u * BK + v0);
        const __m256i ka = kBias ? kc : load32(k.units_abs.data() + u * BK + v0);
        for (int i = 0; i < R; ++i)
          acc[i] = dot4_i8(acc[i], kc, ka, _mm256_set1_epi32(unit_at(q.codes.data() + (first + i) * D + 4 * u)));
      }
      const __m256 ks = _mm256_loadu_ps(k.scale.data() + g * BK + v0);
      for (int i = 0; i < R; ++i) {
        const __m256 qs = _mm256_set1_ps(q.scale[(first + i) * NG + g]);
        const __m256 off = _mm256_set1_ps(q.offset[(first + i) * NG + g]);
        f[i] = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(acc[i]), off), _mm256_mul_ps(ks, qs), f[i]);
      }
    }
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(s + i * BK + v0, f[i]);
  }
}
#else
template <int R>
void scores_r(const QueriesI8& q, int64_t first, int64_t D, int64_t group, const KeysI8& k, float* s) {
  const int64_t NG = D / group, UPG = group / 4;
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < BK; ++j) {
      float total = 0.f;
      for (int64_t g = 0; g < NG; ++g) {
        int32_t dot = 0;
        for (int64_t u = g * UPG; u < (g + 1) * UPG; ++u) {
          int32_t unit = k.units[u * BK + j];
          const int8_t* kc = reinterpret_cast<const int8_t*>(&unit);
          const int8_t* qc = q.codes.data() + (first + i) * D + 4 * u;
          for (int b = 0; b < 4; ++b) dot += kc[b] * qc[b];
        }
        total += static_cast<float>(dot) * (k.scale[g * BK + j] * q.scale[(first + i) * NG + g]);
      }
      s[i * BK + j] = total;
    }
}
#endif

// The L x L block of int32 vectors r transposed (r[i][j] <-> r[j][i]), as in
// flash_attention.cpp: log2(L) stages of two-input shuffles.
typedef int32_t ivec __attribute__((vector_size(L * 4)));
template <int B>
inline void transpose_stage(ivec* r) {
  ivec m1, m2;
  for (int l = 0; l < L; ++l) {
    m1[l] = (l & B) ? L + l - B : l;
    m2[l] = (l & B) ? L + l : l + B;
  }
  for (int i = 0; i < L; ++i) {
    if (i & B) continue;
    const ivec a = r[i], c = r[i + B];
    r[i] = __builtin_shuffle(a, c, m1);
    r[i + B] = __builtin_shuffle(a, c, m2);
  }
}
inline void transpose(ivec* r) {
  if constexpr (L == 16) transpose_stage<8>(r);
  transpose_stage<4>(r);
  transpose_stage<2>(r);
  transpose_stage<1>(r);
}

}  // namespace

void quantize_queries_i8(const float* qp, int64_t M, int64_t D, int64_t group, QueriesI8& q) {
  const int64_t NG = D / group;
  q.codes.resize(M * D);
  q.scale.resize(M * NG);
  q.offset.resize(M * NG);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t g = 0; g < NG; ++g) {
      const float* x = qp + i * D + g * group;
      float amax = 0.f;
      for (int64_t c = 0; c < group; ++c) amax = std::max(amax, std::fabs(x[c]));
      const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      int8_t* codes = q.codes.data() + i * D + g * group;
      for (int64_t c = 0; c < group; ++c) {
        codes[c] = static_cast<int8_t>(std::clamp(std::nearbyint(x[c] * inv), -127.f, 127.f));
        sum += codes[c];
      }
      q.scale[i * NG + g] = scale;
      q.offset[i * NG + g] = kBias ? 128.f * static_cast<float>(sum) : 0.f;
    }
}

void pack_keys_i8(const uint8_t* const* rows, int64_t D, int64_t group, KeysI8& k) {
  const int64_t U = D / 4, NG = D / group;
  k.units.resize(U * BK);
  k.units_abs.resize(kBias ? 0 : U * BK);
  k.scale.resize(NG * BK);
  for (int j = 0; j < BK; ++j)
    for (int64_t g = 0; g < NG; ++g) k.scale[g * BK + j] = rows[j] ? half_at(rows[j] + D + 2 * g) : 0.f;
  const int32_t bias = kBias ? static_cast<int32_t>(0x80808080u) : 0;
  for (int j0 = 0; j0 < BK; j0 += L)
    for (int64_t u0 = 0; u0 < U; u0 += L) {
      ivec r[L];
      const int64_t n = std::min<int64_t>(L, U - u0);
      for (int i = 0; i < L; ++i) {
        r[i] = ivec{};
        if (!rows[j0 + i]) continue;
        if (n == L)  // a constant size: one vector load, not a byte loop
          std::memcpy(&r[i], rows[j0 + i] + 4 * u0, sizeof(ivec));
        else
          std::memcpy(&r[i], rows[j0 + i] + 4 * u0, 4 * n);
      }
      transpose(r);
      for (int64_t i = 0; i < n; ++i) {
        ivec v = r[i] ^ bias;
        std::memcpy(k.units.data() + (u0 + i) * BK + j0, &v, sizeof(v));
#if defined(RS_I8_256) && !defined(RS_I8_BIAS)
        __m256i a;
        std::memcpy(&a, &r[i], sizeof(a));
        store32(k.units_abs.data() + (u0 + i) * BK + j0, _mm256_abs_epi8(a));
#endif
      }
    }
}

void scores_i8(const QueriesI8& q, int64_t first, int R, int64_t D, int64_t group, const KeysI8& k,
               float* s) {
  for (int i0 = 0; i0 < R; i0 += RMAX) {
    const int n = std::min(RMAX, R - i0);
    float* out = s + i0 * BK;
    switch (n) {
      case 1: scores_r<1>(q, first + i0, D, group, k, out); break;
      case 2: scores_r<2>(q, first + i0, D, group, k, out); break;
      case 3: scores_r<3>(q, first + i0, D, group, k, out); break;
#if !defined(RS_I8_256)
      case 4: scores_r<4>(q, first + i0, D, group, k, out); break;
      case 5: scores_r<5>(q, first + i0, D, group, k, out); break;
      case 6: scores_r<6>(q, first + i0, D, group, k, out); break;
#endif
    }
  }
}

}  // namespace flash
}  // namespace rs
