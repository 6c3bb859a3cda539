// GGUF K-quant and IQ4_XS blocks straight into the forms the loader holds (kernels/gguf_blocks_cpu.py loads and wraps
// them; weights/gguf_int4.py and gguf_int8.py hold the same arithmetic in numpy, and say the block layouts). One pass
// over the file's bytes, a block per iteration, blocks shared out between threads; every scale is the float32 product
// gguf-py's dequantize forms (a float16 widened exactly, times a small integer), so the outputs equal numpy's bit for bit.
#include "prelude.h"

#include <ATen/Parallel.h>

namespace {

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K's and Q5_K's 12 bytes of 6-bit (scale, min) pairs (ggml's get_scale_min_k4)
inline void scale_min_k4(const uint8_t* s, int sc[8], int mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[4 + j] & 63;
    sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 6) << 4);
    mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4);
  }
}

void check_blocks(const torch::Tensor& blocks, int64_t width, const char* what) {
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() && blocks.dim() == 2 &&
                  blocks.size(1) == width,
              what, ": contiguous uint8 blocks [count, ", width, "]");
}

template <typename F>
void each_block(int64_t count, F&& body) {
  at::parallel_for(0, count, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) body(b);
  });
}

// A Q4_K / Q5_K block's 8 scales d * sc and offsets -(dmin * m): float16 d and dmin, then 12 bytes of 6-bit (sc, m)
void k_scales(const uint8_t* block, float* scales, float* offsets) {
  const float d = half_at(block), dmin = half_at(block + 2);
  int sc[8], mn[8];
  scale_min_k4(block + 4, sc, mn);
  for (int j = 0; j < 8; ++j) {
    scales[j] = d * static_cast<float>(sc[j]);
    offsets[j] = -(dmin * static_cast<float>(mn[j]));
  }
}

}  // namespace

// Q4_K blocks [count, 144] -> (packed [count, 128] uint8, scales d * sc and offsets -(dmin * m) [count, 8] float32).
// Packed: per 32 weights, byte i holds weight i (low nibble) and i + 16 (high); Q4_K's run r of 32 bytes holds
// sub-block 2r in its low nibbles and 2r + 1 in its high ones.
std::vector<torch::Tensor> q4_k_packed(torch::Tensor blocks) {
  check_blocks(blocks, 144, "q4_k_packed");
  const int64_t count = blocks.size(0);
  auto packed = torch::empty({count, 128}, blocks.options());
  auto scales = torch::empty({count, 8}, blocks.options().dtype(torch::kFloat32));
  auto offsets = torch::empty({count, 8}, scales.options());
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  float* op = offsets.data_ptr<float>();
  each_block(count, [&](int64_t b) {
    const uint8_t* block = in + 144 * b;
    k_scales(block, sp + 8 * b, op + 8 * b);
    const uint8_t* qs = block + 16;
    uint8_t* dst = out + 128 * b;
    for (int r = 0; r < 4; ++r) {
      const uint8_t* lo = qs + 32 * r;  // weights i and i + 16 of both sub-blocks: bytes i and i + 16 of the run
      for (int i = 0; i < 16; ++i) {
        dst[32 * r + i] = (lo[i] & 0x0F) | (lo[i + 16] << 4);
        dst[32 * r + 16 + i] = (lo[i] >> 4) | (lo[i + 16] & 0xF0);
      }
    }
  });
  return {packed, scales, offsets};
}

// IQ4_XS blocks [count, 136] -> (packed [count, 128] uint8: its code bytes, already in the packed order; scales
// d * (ls - 32) [count, 8] float32, ls 6 bits: 4 in scales_l, 2 in scales_h).
std::vector<torch::Tensor> iq4_xs_packed(torch::Tensor blocks) {
  check_blocks(blocks, 136, "iq4_xs_packed");
  const int64_t count = blocks.size(0);
  auto packed = torch::empty({count, 128}, blocks.options());
  auto scales = torch::empty({count, 8}, blocks.options().dtype(torch::kFloat32));
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  each_block(count, [&](int64_t b) {
    const uint8_t* block = in + 136 * b;
    const float d = half_at(block);
    const int high = block[2] | (block[3] << 8);
    for (int j = 0; j < 8; ++j) {
      const int ls = ((block[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4);
      sp[8 * b + j] = d * static_cast<float>(ls - 32);
    }
    std::memcpy(out + 128 * b, block + 8, 128);
  });
  return {packed, scales};
}

// Q6_K blocks [count, 210] -> (codes q - 32 [count, 256] int8, scales d * sc [count, 16] float32). Per half of 128
// weights: 64 low-nibble bytes ql and 32 high-pair bytes qh; weight 32 * run + j takes byte j (runs 0, 2) or 32 + j
// (runs 1, 3) of ql, its low nibble (runs 0, 1) or high one (2, 3), and bits 2 * run of qh[j] above them.
std::vector<torch::Tensor> q6_k_codes(torch::Tensor blocks) {
  check_blocks(blocks, 210, "q6_k_codes");
  const int64_t count = blocks.size(0);
  auto codes = torch::empty({count, 256}, blocks.options().dtype(torch::kInt8));
  auto scales = torch::empty({count, 16}, blocks.options().dtype(torch::kFloat32));
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  int8_t* out = codes.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  each_block(count, [&](int64_t b) {
    const uint8_t* block = in + 210 * b;
    const float d = half_at(block + 208);
    for (int j = 0; j < 16; ++j) sp[16 * b + j] = d * static_cast<float>(static_cast<int8_t>(block[192 + j]));
    int8_t* dst = out + 256 * b;
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = block + 64 * half;
      const uint8_t* qh = block + 128 + 32 * half;
      int8_t* q = dst + 128 * half;
      for (int j = 0; j < 32; ++j) {
        q[j] = static_cast<int8_t>(((ql[j] & 0x0F) | (((qh[j] >> 0) & 3) << 4)) - 32);
        q[32 + j] = static_cast<int8_t>(((ql[32 + j] & 0x0F) | (((qh[j] >> 2) & 3) << 4)) - 32);
        q[64 + j] = static_cast<int8_t>(((ql[j] >> 4) | (((qh[j] >> 4) & 3) << 4)) - 32);
        q[96 + j] = static_cast<int8_t>(((ql[32 + j] >> 4) | (((qh[j] >> 6) & 3) << 4)) - 32);
      }
    }
  });
  return {codes, scales};
}

// Q5_K blocks [count, 176] -> (codes q [count, 256] int8 in 0..31, scales d * sc and offsets -(dmin * m) [count, 8]
// float32). Weight 64 * r + 32 * s + j: nibble s of qs[32 * r + j], bit 2 * r + s of qh[j] above it.
std::vector<torch::Tensor> q5_k_codes(torch::Tensor blocks) {
  check_blocks(blocks, 176, "q5_k_codes");
  const int64_t count = blocks.size(0);
  auto codes = torch::empty({count, 256}, blocks.options().dtype(torch::kInt8));
  auto scales = torch::empty({count, 8}, blocks.options().dtype(torch::kFloat32));
  auto offsets = torch::empty({count, 8}, scales.options());
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  int8_t* out = codes.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  float* op = offsets.data_ptr<float>();
  each_block(count, [&](int64_t b) {
    const uint8_t* block = in + 176 * b;
    k_scales(block, sp + 8 * b, op + 8 * b);
    const uint8_t* qh = block + 16;
    const uint8_t* qs = block + 48;
    int8_t* dst = out + 256 * b;
    for (int r = 0; r < 4; ++r)
      for (int j = 0; j < 32; ++j) {
        const uint8_t byte = qs[32 * r + j];
        dst[64 * r + j] = static_cast<int8_t>((byte & 0x0F) | (((qh[j] >> (2 * r)) & 1) << 4));
        dst[64 * r + 32 + j] = static_cast<int8_t>((byte >> 4) | (((qh[j] >> (2 * r + 1)) & 1) << 4));
      }
  });
  return {codes, scales, offsets};
}
