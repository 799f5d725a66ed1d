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

// All rows against panels [begin, end), kQuantChains panels at a time so each chunk's codes are read
// from memory once and stay in cache for the remaining row tiles. A decode row takes one group (2
// panels) at a time: the tile then reads one contiguous stream, which the hardware prefetcher keeps
// ahead of; tiles over two groups (two streams a core) measured 15-20% slower. Verify rows take
// 8 x 1 (AVX-512 only), 4 x kVerifyPanels, 3 x kVerifyPanels, 2 x 2 and 1 x 2 tiles.
template <int BITS>
static void quant_rows(const float* x, int64_t rows, int64_t k_dim, const uint8_t* data, int64_t block_bytes,
                       float* y, int64_t ldy, const float* bias, int64_t n, int64_t begin, int64_t end) {
  for (int64_t p0 = begin; p0 < end; p0 += kQuantChains) {
    const int64_t p1 = std::min(end, p0 + kQuantChains);
    int64_t m = 0;
    if constexpr (kWideRows > kQuantChains)  // AVX-512's 32 registers: one rebuilt weight serves 8 rows
      for (; m + kWideRows <= rows; m += kWideRows)
        tiles<BITS, kWideRows, 1>(x + m * k_dim, k_dim, data, block_bytes, y + m * ldy, ldy, bias, n, p0, p1);
    for (; m + kQuantChains <= rows; m += kQuantChains)
      tiles<BITS, kQuantChains, kVerifyPanels>(x + m * k_dim, k_dim, data, block_bytes, y + m * ldy, ldy, bias, n, p0, p1);
    const float* xr = x + m * k_dim;
    float* yr = y + m * ldy;
    switch (rows - m) {
      case 3: tiles<BITS, 3, kVerifyPanels>(xr, k_dim, data, block_bytes, yr, ldy, bias, n, p0, p1); break;
      case 2: tiles<BITS, 2, 2>(xr, k_dim, data, block_bytes, yr, ldy, bias, n, p0, p1); break;
      case 1: tiles<BITS, 1, 2>(xr, k_dim, data, block_bytes, yr, ldy, bias, n, p0, p1); break;
      default: break;
    }
  }
}
