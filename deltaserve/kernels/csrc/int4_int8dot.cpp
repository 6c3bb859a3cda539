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
// Codes that fit in 6 bits (GGUF Q6_K's q + 32, Q5_K's q: int4_int8_pack6) are held in 6: a block's 384 bytes are the
// 4-bit layout's 256 (each code's low 4 bits) and four 32-byte runs, one a chunk, of the 2 bits above them (byte i:
// bits 0-1 over chunk byte i's low nibble, 2-3 over byte i + 32's, 4-5 over byte i's high nibble, 6-7 over byte
// i + 32's); their groups are 16 (halves: the low and the high nibbles), the offset -32 s where none is stored.
// Scales (and offsets) are held [N / 16, K / group, 16] in the checkpoint's dtype (float32, bfloat16, float16), or,
// where each is exactly a float32 per 256 columns times an int8 per group (GGUF K-quants' d x sc, dmin x m: what the
// file holds; int4_int8_super factors them), as those: per panel and 256 columns 16 float32 then the groups' int8s,
// four groups a dword (int4_int8_tile.h's SUPER).
// AVX-512 VNNI builds take 16 rows a register; AVX2 builds 8 (the two halves of each chunk) with vpmaddubsw
// (u8 x s8 pairs summed to int16: at most 2 * 15 * 127 = 3810 per pair, 8 of them 30480 < 2^15, so the block's
// int16 sums never saturate) and vpmaddwd by ones to int32; AVX-VNNI builds without AVX-512 (Alder Lake, Raptor
// Lake: -mavxvnni, or -march=native there) take the AVX2 tile's 8 rows with the 256-bit VEX vpdpbusd, summing into
// int32 directly. 8-bit codes on AVX2 go through vpmaddubsw a nibble at a time (int4_int8_tile.h). The block sums
// are exact integers on every path (at most 32 x 255 x 127 < 2^24, so exact in float32 too), so the AVX-VNNI and
// AVX2 builds agree bit for bit.
#include "int4_int8_tile.h"

#include <numeric>

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
  const int64_t M = x.size(0), K = x.dim() == 2 ? x.size(1) : 0, N = codes.size(0) * RI;
  TORCH_CHECK(x.dim() == 2, "int4_int8_linear: x must be [M, K]");
  const Weight w = panel_weight(codes, scales, offsets, levels, group, K, "int4_int8_linear");
  auto parts = int4_int8_quantize(x, group);
  const Act a{parts[0].data_ptr<int8_t>(), parts[1].data_ptr<float>(), parts[2].data_ptr<float>(), K, K / group};
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

// codes int8 [N, K] (N a multiple of 16, K of 32) -> their 6-bit panel codes [N / 16, K * 12] uint8 (the header's
// layout), each code q held as c = q + `shift` (Q6_K: 32; Q5_K: 0); empty where some c falls outside 0 .. 63.
torch::Tensor int4_int8_pack6(torch::Tensor codes, int64_t shift) {
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.is_contiguous() && codes.dim() == 2 &&
              codes.size(0) % RI == 0 && codes.size(1) % QB == 0,
              "int4_int8_pack6: codes must be contiguous int8 [N, K], N a multiple of 16, K of 32");
  const int64_t N = codes.size(0), K = codes.size(1), panels = N / RI, blocks = K / QB;
  const int8_t* q = codes.data_ptr<int8_t>();
  bool fits = true;
  #pragma omp parallel for schedule(static) reduction(&& : fits)
  for (int64_t i = 0; i < N * K; ++i) fits = fits && q[i] + shift >= 0 && q[i] + shift <= 63;
  if (!fits) return torch::empty({0}, codes.options().dtype(torch::kUInt8));
  auto out = torch::empty({panels, K * 12}, codes.options().dtype(torch::kUInt8));
  uint8_t* o = out.data_ptr<uint8_t>();
  #pragma omp parallel for schedule(static)
  for (int64_t pb = 0; pb < panels * blocks; ++pb) {
    const int64_t p = pb / blocks, b = pb % blocks;
    uint8_t* block = o + (p * blocks + b) * panel_block(6);
    for (int L = 0; L < 4; ++L) {
      uint8_t c[2][64];  // chunk L's codes: [low nibble's column, high nibble's][byte 4r + i]
      for (int r = 0; r < RI; ++r)
        for (int i = 0; i < 4; ++i)
          for (int h = 0; h < 2; ++h)
            c[h][4 * r + i] = static_cast<uint8_t>(q[(RI * p + r) * K + QB * b + 16 * h + 4 * L + i] + shift);
      for (int t = 0; t < 64; ++t) block[CHUNK * L + t] = (c[0][t] & 0x0F) | ((c[1][t] & 0x0F) << 4);
      for (int t = 0; t < 32; ++t)
        block[4 * CHUNK + 32 * L + t] = (c[0][t] >> 4) | ((c[0][t + 32] >> 4) << 2) | ((c[1][t] >> 4) << 4) |
                                        ((c[1][t + 32] >> 4) << 6);
    }
  }
  return out;
}

namespace {
// v[0 .. G) = d * sub[j] exactly, d float32 and sub int8 (the largest such |d|: the greatest common divisor of the
// values' integer significands over their least exponent, of either sign), or false where no such pair exists.
bool factor(const float* v, int64_t G, float* d, int8_t* sub) {
  int64_t mant[16], n[16], g = 0;
  int exps[16], least = 0;
  bool any = false;
  for (int64_t j = 0; j < G; ++j) {
    if (!std::isfinite(v[j])) return false;
    mant[j] = 0;
    if (v[j] == 0.0f) continue;
    const float m = std::frexp(v[j], &exps[j]);
    mant[j] = static_cast<int64_t>(std::ldexp(m, 24));  // exact: a float32's 24-bit significand
    least = any ? std::min(least, exps[j]) : exps[j];
    any = true;
  }
  if (!any) {
    *d = 0.0f;
    std::fill(sub, sub + G, int8_t{0});
    return true;
  }
  for (int64_t j = 0; j < G; ++j) {
    if (mant[j] == 0) { n[j] = 0; continue; }
    if (exps[j] - least > 30) return false;
    n[j] = mant[j] * (int64_t{1} << (exps[j] - least));
    g = std::gcd(g, n[j] < 0 ? -n[j] : n[j]);
  }
  int64_t low = 0, high = 0;
  for (int64_t j = 0; j < G; ++j) {
    low = std::min(low, n[j] / g);
    high = std::max(high, n[j] / g);
  }
  // a negative d times -128 (Q6_K's sub-scales reach it) factors as the negated pair
  const int64_t sign = high <= 127 && low >= -128 ? 1 : -high >= -128 && -low <= 127 ? -1 : 0;
  if (sign == 0) return false;
  *d = static_cast<float>(std::ldexp(static_cast<double>(sign * g), least - 24));
  for (int64_t j = 0; j < G; ++j) {
    sub[j] = static_cast<int8_t>(sign * n[j] / g);
    if (*d * static_cast<float>(sub[j]) != v[j]) return false;  // the kernel's product, checked bit for bit
  }
  return true;
}
}  // namespace

// scales float32 [N, K / group] (N a multiple of 16, group 16, 32 or 64, K a multiple of 256) -> the SUPER form
// int8 [N / 16, K / 256, 64 + 16 G], G = 256 / group: per panel and 256 columns the 16 rows' float32 d, then the int8
// sub-scales in runs of 64 bytes (run j's dword r: row r's of groups 4j .. 4j + 3: int4_int8_tile.h), d x sub equal to
// each scale bit for bit; empty where some 256 columns' scales do not factor so.
torch::Tensor int4_int8_super(torch::Tensor scales, int64_t group) {
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 2 &&
              scales.size(0) % RI == 0 && group > 0 && 64 % group == 0 && (scales.size(1) * group) % 256 == 0,
              "int4_int8_super: scales must be contiguous float32 [N, K / group], N a multiple of 16, the group "
              "16, 32 or 64, K a multiple of 256");
  const int64_t N = scales.size(0), G = 256 / group, supers = scales.size(1) / G, width = 64 + 16 * G;
  auto out = torch::empty({N / RI, supers, width}, scales.options().dtype(torch::kInt8));
  const float* s = scales.data_ptr<float>();
  int8_t* o = out.data_ptr<int8_t>();
  bool exact = true;
  #pragma omp parallel for schedule(static) reduction(&& : exact)
  for (int64_t ns = 0; ns < N * supers; ++ns) {
    const int64_t n = ns / supers, j = ns % supers;
    int8_t* at = o + ((n / RI) * supers + j) * width;
    float d;
    int8_t sub[16];
    if (!factor(s + n * scales.size(1) + j * G, G, &d, sub)) {
      exact = false;
      continue;
    }
    std::memcpy(at + 4 * (n % RI), &d, 4);
    for (int64_t g = 0; g < G; ++g) at[64 + 64 * (g / 4) + 4 * (n % RI) + g % 4] = sub[g];
  }
  return exact ? out : torch::empty({0}, out.options());
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
