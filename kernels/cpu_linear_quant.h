// Block-quant matmul tiles for one vector width. cpu_linear.cpp includes this file twice, into the
// namespaces quant_avx2 and quant_avx512, after defining there the 16-lane vector V and its ops
// (vzero, vbroadcast, vfma, vscale, vhalf, vwords, vhigh16, vcode, vstore); the AVX-512 copy is compiled under
// `#pragma GCC target`, so one build serves both kinds of host. No include guard: included twice.
//
// Layout (see pack_quant in cpu_linear.cpp): groups of 32 output columns (two 16-column panels); per
// group and per block of 32 k, a 128-byte header [scale x16, min x16] (fp16) for each panel, then the
// codes as rows of 32 little-endian 32-bit words, one per column, each holding that column's codes for
// 8 (4-bit) or 4 (8-bit) consecutive k, the first k in the low bits: a code is a shift and a mask away,
// with no shuffle. A group's blocks follow each other, so a tile of panels streams one contiguous range.

// ROWS input rows against PANELS consecutive panels, the first one `panel0` (an index into `data`).
// Every output is one fma chain over k in order, on the weight fma(scale, code, min): scale * code is
// exact in fp32, so that is the dequantized fp32 weight and the result is `linear`'s bit for bit.
template <int BITS, int ROWS, int PANELS>
static inline void tile(const float* x, int64_t k_dim, const uint8_t* data, int64_t block_bytes, int64_t panel0,
                        float* y, int64_t ldy, const float* bias, int64_t cols_left) {
  const int64_t blocks = k_dim / kQuantBlock;
  const uint8_t* group[PANELS];  // the panel's group, block 0
  int64_t half[PANELS];  // which panel of its group
#pragma GCC unroll 8
  for (int j = 0; j < PANELS; ++j) {
    group[j] = data + (panel0 + j) / kGroupPanels * blocks * block_bytes;
    half[j] = (panel0 + j) % kGroupPanels;
  }
  V acc[ROWS * PANELS];  // [row * PANELS + panel]
#pragma GCC unroll 16
  for (int a = 0; a < ROWS * PANELS; ++a) acc[a] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
    // kPrefetchBlocks ahead, on past the group's end into what follows it (see kPrefetchBlocks)
#pragma GCC unroll 8
    for (int j = 0; j < PANELS; ++j) {
      if (j > 0 && half[j] != 0) continue;  // the same group as panel j - 1: already prefetched
      const char* ahead = reinterpret_cast<const char*>(group[j] + (b + kPrefetchBlocks) * block_bytes);
      for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    V scale[PANELS], min[PANELS];
    const uint8_t* codes[PANELS];
#pragma GCC unroll 8
    for (int j = 0; j < PANELS; ++j) {
      const uint8_t* block = group[j] + b * block_bytes;
      const uint8_t* header = block + half[j] * kPanel * 4;  // 16 fp16 scales, then 16 fp16 mins
      scale[j] = vhalf(header);
      min[j] = vhalf(header + kPanel * 2);
      codes[j] = block + kQuantHeader + half[j] * kPanel * 4;
    }
    const float* xb = x + b * kQuantBlock;
    if constexpr (kCodesInPlace) {
      // A code is taken in place, ORed at bit offset `at` into the mantissa of 2^23 (then 2^23 is
      // subtracted): that gives code * 2^at exactly, so the scale is taken times 2^-at (also exact, and
      // no fp16 scale gets near fp32's underflow), and scale' * code' = scale * code: fma(scale', code',
      // min) is fma(scale, code, min) bit for bit. Only the upper 16 bits of a word need a shift.
      constexpr int kPerWord = 32 / BITS, kPerHalf = kPerWord / 2;  // codes per 32-bit word / 16 bits
      V scale_at[PANELS][kPerHalf];
#pragma GCC unroll 8
      for (int j = 0; j < PANELS; ++j) {
#pragma GCC unroll 8
        for (int i = 0; i < kPerHalf; ++i) scale_at[j][i] = vscale(scale[j], 1.0f / float(1 << (i * BITS)));
      }
      for (int r = 0; r < kQuantBlock / kPerWord; ++r) {
        VI low[PANELS], high[PANELS];
#pragma GCC unroll 8
        for (int j = 0; j < PANELS; ++j) {
          low[j] = vwords(codes[j] + r * kGroupCols * 4);
          high[j] = vhigh16(low[j]);
        }
#pragma GCC unroll 8
        for (int t = 0; t < kPerWord; ++t) {
          const int i = t % kPerHalf;
          V w[PANELS];
#pragma GCC unroll 8
          for (int j = 0; j < PANELS; ++j)
            w[j] = vfma(scale_at[j][i], vcode(t < kPerHalf ? low[j] : high[j], ((1 << BITS) - 1) << (i * BITS)),
                        min[j]);
#pragma GCC unroll 8
          for (int m = 0; m < ROWS; ++m) {
            const V xv = vbroadcast(xb + m * k_dim + r * kPerWord + t);
#pragma GCC unroll 8
            for (int j = 0; j < PANELS; ++j) acc[m * PANELS + j] = vfma(xv, w[j], acc[m * PANELS + j]);
          }
        }
      }
    } else {  // fewer registers (AVX2's 16): each code shifted down, the scale as it is
      constexpr int kPerWord = 32 / BITS;
      for (int r = 0; r < kQuantBlock / kPerWord; ++r) {
        VI words[PANELS];
#pragma GCC unroll 8
        for (int j = 0; j < PANELS; ++j) words[j] = vwords(codes[j] + r * kGroupCols * 4);
#pragma GCC unroll 8
        for (int t = 0; t < kPerWord; ++t) {
          V w[PANELS];
#pragma GCC unroll 8
          for (int j = 0; j < PANELS; ++j) w[j] = vfma(scale[j], vcode(vshift(words[j], t * BITS), (1 << BITS) - 1), min[j]);
#pragma GCC unroll 8
          for (int m = 0; m < ROWS; ++m) {
            const V xv = vbroadcast(xb + m * k_dim + r * kPerWord + t);
#pragma GCC unroll 8
            for (int j = 0; j < PANELS; ++j) acc[m * PANELS + j] = vfma(xv, w[j], acc[m * PANELS + j]);
          }
        }
      }
    }
  }
  // Spill the accumulators with constant indices only: a runtime index would make the compiler keep
  // them in memory inside the k loop.
  alignas(64) float out[ROWS * PANELS][kPanel];
#pragma GCC unroll 16
  for (int a = 0; a < ROWS * PANELS; ++a) vstore(out[a], acc[a]);
  write_tile<ROWS, PANELS>(out, y, ldy, bias, cols_left);
}

// ROWS rows against panels [begin, end): PANELS at a time, then one by one.
template <int BITS, int ROWS, int PANELS>
static void tiles(const float* x, int64_t k_dim, const uint8_t* data, int64_t block_bytes, float* y, int64_t ldy,
                  const float* bias, int64_t n, int64_t begin, int64_t end) {
  int64_t p = begin;
  for (; p + PANELS <= end; p += PANELS)
    tile<BITS, ROWS, PANELS>(x, k_dim, data, block_bytes, p, y + p * kPanel, ldy, bias ? bias + p * kPanel : nullptr,
                             n - p * kPanel);
  for (; p < end; ++p)
    tile<BITS, ROWS, 1>(x, k_dim, data, block_bytes, p, y + p * kPanel, ldy, bias ? bias + p * kPanel : nullptr,
                        n - p * kPanel);
}

// One tile of `count` rows (1 .. kMaxTileRows) against panels [p0, p1). Every tile above 2 rows spans
// kVerifyPanels panels; the 5- to 8-row tiles exist only where kMaxTileRows reaches them (AVX-512: 8,
// AVX2: 6).
template <int BITS>
static void row_tile(int64_t count, const float* x, int64_t k_dim, const uint8_t* data, int64_t block_bytes,
                     float* y, int64_t ldy, const float* bias, int64_t n, int64_t p0, int64_t p1) {
  if constexpr (kMaxTileRows >= 8) {
    switch (count) {
      case 8: return tiles<BITS, 8, kVerifyPanels>(x, k_dim, data, block_bytes, y, ldy, bias, n, p0, p1);
      case 7: return tiles<BITS, 7, kVerifyPanels>(x, k_dim, data, block_bytes, y, ldy, bias, n, p0, p1);
      default: break;
    }
  }
  if constexpr (kMaxTileRows >= 6) {
    switch (count) {
      case 6: return tiles<BITS, 6, kVerifyPanels>(x, k_dim, data, block_bytes, y, ldy, bias, n, p0, p1);
      case 5: return tiles<BITS, 5, kVerifyPanels>(x, k_dim, data, block_bytes, y, ldy, bias, n, p0, p1);
      default: break;
    }
  }
  switch (count) {
    case 4: return tiles<BITS, 4, kVerifyPanels>(x, k_dim, data, block_bytes, y, ldy, bias, n, p0, p1);
    case 3: return tiles<BITS, 3, kVerifyPanels>(x, k_dim, data, block_bytes, y, ldy, bias, n, p0, p1);
    case 2: return tiles<BITS, 2, 2>(x, k_dim, data, block_bytes, y, ldy, bias, n, p0, p1);
    case 1: return tiles<BITS, 1, 2>(x, k_dim, data, block_bytes, y, ldy, bias, n, p0, p1);
    default: break;
  }
}

// All rows against panels [begin, end), kQuantChains panels at a time so each chunk's codes are read
// from memory once and stay in cache for the remaining row tiles. A decode row takes one group (2
// panels) at a time: the tile then reads one contiguous stream, which the hardware prefetcher keeps
// ahead of; tiles over two groups (two streams a core) measured 15-20% slower. Verify rows are split
// into the fewest tiles of at most kMaxTileRows, as even as can be (AVX-512: 9 rows = 5 + 4, 13 = 7 + 6;
// AVX2: 9 = 5 + 4, 13 = 5 + 4 + 4):
// each tile rebuilds every weight once, so fewer, fuller tiles rebuild less.
template <int BITS>
static void quant_rows(const float* x, int64_t rows, int64_t k_dim, const uint8_t* data, int64_t block_bytes,
                       float* y, int64_t ldy, const float* bias, int64_t n, int64_t begin, int64_t end) {
  const int64_t num_tiles = (rows + kMaxTileRows - 1) / kMaxTileRows;
  for (int64_t p0 = begin; p0 < end; p0 += kQuantChains) {
    const int64_t p1 = std::min(end, p0 + kQuantChains);
    for (int64_t t = 0, m = 0; t < num_tiles; ++t) {
      const int64_t count = rows / num_tiles + (t < rows % num_tiles ? 1 : 0);
      row_tile<BITS>(count, x + m * k_dim, k_dim, data, block_bytes, y + m * ldy, ldy, bias, n, p0, p1);
      m += count;
    }
  }
}
