// Packed 4-bit and int8 weights times int8 activations by integer dot products (issue 41): llama.cpp's Q8_0 / Q8_1
// scheme for Q4_0 / Q4_1 / Q8_0, on the repacked layouts kernels/int4_int8.py makes at load.
//
// Activations: each row's blocks of 32 columns are quantized to int8 with one float32 scale, d = max|x| / 127 and
// q = round-half-even(x / d) (computed as x * (1 / d), the scale as max|x| * fl(1/127): the reference in the tests
// rounds the same float32 operations). Per weight group g the row also carries sum over its blocks of d * sum(q),
// which multiplies the group's offset (Q8_1's block sum): w = s * c + o with c the 4-bit code gives
//   y = sum_blocks s_g * d_b * (c . q)_b + sum_groups o_g * (sum_{b in g} d_b * sum(q_b)),
// the dequantized weight times the dequantized activations, with every c . q an exact integer.
//
// Weights: 16 output rows interleaved (a "panel"). For panel p and block b (32 columns) the 256 bytes are four
// 64-byte chunks L = 0..3; byte 4r + i of chunk L holds row 16p + r's code of column 32b + 4L + i in its low nibble
// and of column 32b + 16 + 4L + i in its high nibble: the packed layout's own bytes (GGUF's nibble order), moved.
// One 64-byte load, an and and a shift give two registers of 16 rows x 4 codes; vpdpbusd multiplies each by the
// same 4 int8 activations broadcast to every lane and sums into one int32 per row: no horizontal sums anywhere.
// 8-bit weights (w = s * q + o', q a signed int8: Q8_0, compressed-tensors INT8) are held as c = q + 128, a uint8
// vpdpbusd takes as the 4-bit codes, with the offset o = o' - 128 s (symmetric: -128 s, never stored), so the sums
// above hold unchanged. Their panel block is 512 bytes: eight 64-byte chunks, byte 4r + i of chunk L holding row
// 16p + r's code of column 32b + 4L + i; chunks L and L + 4 give the same two registers a 4-bit chunk gives.
// IQ4_NL / IQ4_XS's 4-bit codes name integer levels l (-127 .. 113: w = s l[c]): their panels are the 4-bit layout,
// and a 16-byte table of l + 128 turns each nibble into a byte by vpshufb, multiplied as the 8-bit codes are.
// 8-bit codes may come in groups of 16 (GGUF Q6_K's scale per 16 weights): the chunks 0-3 and 4-7 of a block are its
// two halves, summed apart, and the activations' group sums are then per half block.
// Scales (and offsets) are held [N / 16, K / group, 16] in the checkpoint's dtype (float32, bfloat16, float16).
// AVX-512 VNNI builds take 16 rows a register; AVX2 builds 8 (the two halves of each chunk) with vpmaddubsw
// (u8 x s8 pairs summed to int16: at most 2 * 15 * 127 = 3810 per pair, 8 of them 30480 < 2^15, so the block's
// int16 sums never saturate) and vpmaddwd by ones to int32; AVX-VNNI builds without AVX-512 (Alder Lake, Raptor
// Lake: -mavxvnni, or -march=native there) take the AVX2 tile's 8 rows with the 256-bit VEX vpdpbusd, summing into
// int32 directly. 8-bit codes on AVX2 go through vpmaddubsw a nibble at a time (int4_int8_tile.h). The block sums
// are exact integers on every path (at most 32 x 255 x 127 < 2^24, so exact in float32 too), so the AVX-VNNI and
// AVX2 builds agree bit for bit.
#include "int4_int8_tile.h"

using namespace i8dotk;

// x [M, K] float32 -> (q [M, K] int8, d [M, K / 32] float32, gsum [M, K / group] float32): the quantized rows.
std::vector<torch::Tensor> int4_int8_quantize(torch::Tensor x, int64_t group) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "int4_int8: float32 x [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QB == 0 && (group % QB == 0 || group == QB / 2) && group > 0 && K % group == 0,
              "int4_int8: K a multiple of 32, the group 16 or a multiple of 32 dividing K");
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto d = torch::empty({M, K / QB}, x.options());
  auto gsum = torch::empty({M, K / group}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float *dp = d.data_ptr<float>(), *gp = gsum.data_ptr<float>();
  #pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, group, qp + m * K, dp + m * (K / QB), gp + m * (K / group));
  return {q, d, gsum};
}

// x [M, K] float32 @ W.T [M, N] with W in the panel layout (header): codes [N / 16, K * 8] uint8 (4-bit) or
// [N / 16, K * 16] (8-bit), scales and offsets [N / 16, K / group, 16] (offsets empty: symmetric), levels uint8 [16]
// (4-bit codes through a level table, each level + 128) or empty.
torch::Tensor int4_int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                               int64_t group, torch::Tensor levels) {
  const int64_t M = x.size(0), K = x.dim() == 2 ? x.size(1) : 0, panels = codes.size(0), N = panels * RI;
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 2 && K > 0 &&
              (codes.size(1) == K * 8 || codes.size(1) == K * 16),
              "int4_int8_linear: codes [N / 16, K * 8] (4-bit) or [N / 16, K * 16] (8-bit) uint8 for x [M, K]");
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == panels && scales.size(2) == RI &&
              scales.size(1) * group == K, "int4_int8_linear: scales [N / 16, K / group, 16]");
  const bool symmetric = offsets.numel() == 0;
  TORCH_CHECK(symmetric || (offsets.sizes() == scales.sizes() && offsets.scalar_type() == scales.scalar_type() &&
                            offsets.is_contiguous()), "int4_int8_linear: offsets shaped and typed as the scales");
  TORCH_CHECK(levels.numel() == 0 || (levels.scalar_type() == torch::kUInt8 && levels.numel() == 16 &&
                                      levels.is_contiguous() && codes.size(1) == K * 8),
              "int4_int8_linear: levels uint8 [16] with 4-bit codes, or empty");
  TORCH_CHECK(group != QB / 2 || codes.size(1) == K * 16, "int4_int8_linear: groups of 16 with 8-bit codes only");
  auto parts = int4_int8_quantize(x, group);
  const Act a{parts[0].data_ptr<int8_t>(), parts[1].data_ptr<float>(), parts[2].data_ptr<float>(), K, K / group};
  const Weight w{codes.data_ptr<uint8_t>(), scales.data_ptr(), symmetric ? nullptr : offsets.data_ptr(),
                 kind_of(scales), K, group, K / group, codes.size(1) == K * 16 ? 8 : 4,
                 levels.numel() ? levels.data_ptr<uint8_t>() : nullptr};
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  float* yp = y.data_ptr<float>();
  const int64_t units = N / UNIT_ROWS, pairs = (units + NP_MAX - 1) / NP_MAX;
  const int64_t chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < chunks * pairs; ++t) {
    const int64_t m_begin = t / pairs * ROW_CHUNK, m_end = std::min(M, m_begin + ROW_CHUNK), u0 = t % pairs * NP_MAX;
    if (u0 + NP_MAX <= units) column<NP_MAX>(a, m_begin, m_end, w, u0, yp, N);
    else column<1>(a, m_begin, m_end, w, u0, yp, N);
  }
  return y;
}

// Which dot product this build multiplies with
std::string int4_int8_isa() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return "avx512_vnni";
#elif defined(__AVXVNNI__)
  return "avx_vnni";
#else
  return "avx2";
#endif
}
