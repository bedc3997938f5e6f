// Pieces of the attention kernel shared by its files (flash_attention.cpp, flash_i8.cpp).
#pragma once

#include "kernels.h"

namespace rs {
namespace flash {

constexpr int BK = 64;  // keys per tile

// Scores of int8 KV rows with integer dot products: queries rounded to int8 per group of
// channels (the keys' groups), so q . k is a sum over groups of
// (integer dot of codes) * q scale * k scale.
struct QueriesI8 {
  std::vector<int8_t> codes;   // [M][D]
  std::vector<float> scale;    // [M][D / group]
  std::vector<float> offset;   // [M][D / group]: what the kernel's integer sums carry extra
};
// Rounds M query vectors qp [M][D] (floats, already times the softmax scale).
void quantize_queries_i8(const float* qp, int64_t M, int64_t D, int64_t group, QueriesI8& q);

// One tile of BK keys: their codes transposed in units of 4 channels ([D / 4][BK] int32,
// zero past the tile's keys) and their scales ([D / group][BK]).
struct KeysI8 {
  std::vector<int32_t> units;
  std::vector<int32_t> units_abs;  // |codes| (the AVX2 path's unsigned operand)
  std::vector<float> scale;
};
// rows: BK pointers to int8 KV rows (codes, then float16 scales), null past the tile's keys
void pack_keys_i8(const uint8_t* const* rows, int64_t D, int64_t group, KeysI8& k);
// s[i][j] = q_i . k_j for the R (<= 6) query vectors from first, all BK keys of the tile
void scores_i8(const QueriesI8& q, int64_t first, int R, int64_t D, int64_t group,
               const KeysI8& k, float* s);

}  // namespace flash
}  // namespace rs
