// Int8-activation block-quant tiles for one vector width (cpu_linear_int8.h). Included twice, into the
// namespaces int8_avx2 and int8_avx512, after naming there V (16 fp32 lanes), VI (16 int32 lanes) and
// their ops (vzero, vbroadcast, vscale, vfma, vhalf, vstore, vwords: the fp32-activation tiles'), and
// defining Dot (one output panel's integer sums for one row), dot_zero, dot_add<BITS>(dot, words, q),
// dot_float<BITS>(dot), kRowTile and kUnpackMinRows. No include guard.

// ROWS quantized rows against PANELS consecutive panels, the first `panel0`. Per block: the integer
// sums of every (row, panel) over the block's word rows, then per output the two fmas of
// cpu_linear_int8.h in their fixed order.
template <int BITS, int ROWS, int PANELS>
static inline void tile(const int8_t* q, const float* xd, const float* xs, int64_t k_dim, const uint8_t* data,
                        int64_t block_bytes, int64_t panel0, float* y, int64_t ldy, const float* bias,
                        int64_t cols_left) {
  constexpr int kWords = kQuantBlock / (32 / BITS);  // word rows per block: 4 (4-bit), 8 (8-bit)
  const int64_t blocks = k_dim / kQuantBlock;
  const uint8_t* group[PANELS];
  int64_t half[PANELS];
#pragma GCC unroll 4
  for (int j = 0; j < PANELS; ++j) {
    group[j] = data + (panel0 + j) / kGroupPanels * blocks * block_bytes;
    half[j] = (panel0 + j) % kGroupPanels;
  }
  V acc[ROWS * PANELS];
#pragma GCC unroll 16
  for (int a = 0; a < ROWS * PANELS; ++a) acc[a] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 4
    for (int j = 0; j < PANELS; ++j) {  // as the fp32-activation tiles: ahead, on past the group's end
      if (j > 0 && half[j] != 0) continue;
      const char* ahead = reinterpret_cast<const char*>(group[j] + (b + kPrefetchBlocks) * block_bytes);
      for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    Dot dot[ROWS * PANELS];
#pragma GCC unroll 16
    for (int a = 0; a < ROWS * PANELS; ++a) dot[a] = dot_zero();
#pragma GCC unroll 8
    for (int r = 0; r < kWords; ++r) {
      VI w[PANELS];
#pragma GCC unroll 4
      for (int j = 0; j < PANELS; ++j)
        w[j] = vwords(group[j] + b * block_bytes + kQuantHeader + (half[j] * kPanel + r * kGroupCols) * 4);
#pragma GCC unroll 8
      for (int m = 0; m < ROWS; ++m) {
        const int8_t* qm = q + m * k_dim + b * kQuantBlock + r * (32 / BITS);
#pragma GCC unroll 4
        for (int j = 0; j < PANELS; ++j) dot_add<BITS>(dot[m * PANELS + j], w[j], qm);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < PANELS; ++j) {
      const uint8_t* header = group[j] + b * block_bytes + half[j] * kPanel * 4;  // 16 fp16 scales, 16 mins
      const V scale = vhalf(header), min = vhalf(header + kPanel * 2);
#pragma GCC unroll 8
      for (int m = 0; m < ROWS; ++m) {
        V& out = acc[m * PANELS + j];
        out = vfma(vscale(scale, xd[m * blocks + b]), dot_float<BITS>(dot[m * PANELS + j]), out);
        out = vfma(min, vbroadcast(xs + m * blocks + b), out);
      }
    }
  }
  alignas(64) float out[ROWS * PANELS][kPanel];
#pragma GCC unroll 16
  for (int a = 0; a < ROWS * PANELS; ++a) vstore(out[a], acc[a]);
  write_tile<ROWS, PANELS>(out, y, ldy, bias, cols_left);
}

// One group's 4-bit codes rewritten as 8-bit codes (block_bytes8 a block, the same headers): word row
// 2r holds word row r's low nibbles, 2r + 1 its high ones, so with the activations in the 4-bit order
// (k0 k2 k4 k6 k1 k3 k5 k7 each 8 k) the 8-bit tile takes the same products in the same order: the same
// integer sums, the same bits. Its tiles then skip the nibble masks and shifts (a tenth of their ops).
static inline void unpack_group(const uint8_t* group, int64_t blocks, int64_t block_bytes, int64_t block_bytes8,
                                uint8_t* out) {
  constexpr int64_t kRowBytes = kGroupCols * 4;  // one word row of the group
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* src = group + b * block_bytes;
    uint8_t* dst = out + b * block_bytes8;
    std::memcpy(dst, src, kQuantHeader);
    for (int64_t r = 0; r < kQuantBlock / 8; ++r) {  // 8 bytes at a time (the compiler widens it)
      const uint8_t* in = src + kQuantHeader + r * kRowBytes;
      uint8_t *low = dst + kQuantHeader + 2 * r * kRowBytes, *high = low + kRowBytes;
      for (int64_t i = 0; i < kRowBytes; i += 8) {
        uint64_t word;
        std::memcpy(&word, in + i, 8);
        const uint64_t lo = word & 0x0F0F0F0F0F0F0F0FULL, hi = (word >> 4) & 0x0F0F0F0F0F0F0F0FULL;
        std::memcpy(low + i, &lo, 8);
        std::memcpy(high + i, &hi, 8);
      }
    }
  }
}

// All rows against the groups [g0, g1), one group (two panels, one contiguous code stream) at a time:
// a group's codes stay in cache for all its row tiles. From kUnpackMinRows rows on, 4-bit codes are
// rewritten as 8-bit ones once per group for all its tiles (unpack_group).
template <int BITS>
static void group_rows(const int8_t* q, const float* xd, const float* xs, int64_t rows, int64_t k_dim,
                       const uint8_t* data, int64_t block_bytes, float* y, int64_t ldy, const float* bias, int64_t n,
                       int64_t g0, int64_t g1) {
  const int64_t blocks = k_dim / kQuantBlock;
  const bool unpack = BITS == 4 && rows >= kUnpackMinRows;
  const int64_t block_bytes8 = kQuantHeader + kQuantBlock * kGroupCols;
  std::vector<uint8_t> unpacked(unpack ? blocks * block_bytes8 : 0);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t p = g * kGroupPanels, col0 = p * kPanel;
    const float* bg = bias ? bias + col0 : nullptr;
    // every row tile against the group's panels, read as `bits`-bit codes at `codes` (panel `panel0` first)
    auto row_tiles = [&](auto bits, const uint8_t* codes, int64_t bytes, int64_t panel0) {
      tile_rows<kRowTile>(rows, [&](auto tile_rows_n, int64_t m) {
        tile<decltype(bits)::value, decltype(tile_rows_n)::value, kGroupPanels>(
            q + m * k_dim, xd + m * blocks, xs + m * blocks, k_dim, codes, bytes, panel0, y + m * ldy + col0, ldy,
            bg, n - col0);
      });
    };
    if (unpack) {
      unpack_group(data + g * blocks * block_bytes, blocks, block_bytes, block_bytes8, unpacked.data());
      if (g + 1 < g1) {  // the next group's codes on their way to L2 while this group's tiles compute
        const char* next = reinterpret_cast<const char*>(data + (g + 1) * blocks * block_bytes);
        for (int64_t line = 0; line < blocks * block_bytes; line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
      }
      row_tiles(std::integral_constant<int, 8>{}, unpacked.data(), block_bytes8, 0);
    } else {
      row_tiles(std::integral_constant<int, BITS>{}, data, block_bytes, p);
    }
  }
}
