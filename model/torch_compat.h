// File: model/torch_compat.h
// -----------------------------------------------------------------------------
// The few places where LibTorch 1.13 (Debian's, what CI builds) and 2.x (every GPU host's PyTorch)
// differ for bertshard, each behind one named helper, so that no other file tests versions.
//
// Thread safety: stateless functions.
#ifndef BERTSHARD_MODEL_TORCH_COMPAT_H_
#define BERTSHARD_MODEL_TORCH_COMPAT_H_

#include <ATen/ATen.h>
#include <torch/version.h>

#include <cmath>

namespace bertshard::model {

// Whether ScaledDotProductAttention runs LibTorch's fused kernel (2.0 and later: flash or
// memory-efficient attention on CUDA, a blocked kernel on CPU) or the composed 1.13 one.
inline constexpr bool kFusedAttention = TORCH_VERSION_MAJOR >= 2;

// softmax(q k^T / sqrt(head_dim) + mask) v, as HF's BertSelfAttention (and, on PyTorch 2.x, HF's
// BertSdpaSelfAttention, which calls the same fused op). q, k, v: [batch, heads, seq, head_dim];
// mask: additive, in q's dtype, broadcastable to [batch, heads, seq, seq].
inline at::Tensor ScaledDotProductAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& mask) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, mask);
#else
  const double root = std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q, k.transpose(-1, -2)).div_(root).add_(mask);
  return at::matmul(at::softmax(scores, -1), v);
#endif
}

}  // namespace bertshard::model

#endif  // BERTSHARD_MODEL_TORCH_COMPAT_H_
