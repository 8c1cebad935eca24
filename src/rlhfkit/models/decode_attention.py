"""The attention of one decoding step on a CPU, in float32, over a cache that keeps bf16 values in bf16.

A bf16 model's attention runs in float32 on a CPU (:func:`rlhfkit.models.precision.float32_attention_on_cpu`):
torch's ``sdpa`` takes float32 keys and values, so the decoding cache held both in float32
(:mod:`rlhfkit.models.decode_cache`), and at one query position a step the flash kernel read them at a few
GB/s: about a third of a SmolLM2-135M decoding step at 32 rows x 512 tokens on one thread. Under autocast the
values a layer writes are bf16 numbers (``v_proj``'s output) and the keys float32 (the rotary embedding
multiplies ``k_proj``'s bf16 output by float32 tables), so the cache can keep each as it comes, exactly; what
needs float32 is the arithmetic. :func:`decode_attention` is that arithmetic for one query position: each key
and value converted to float32 as it is read (float32 or bf16, whichever the cache holds), the scores, the
softmax and the weighted sum in float32, the query heads that share a key / value head (GQA) read together.
It is the same function as ``sdpa`` on the upcast tensors, summed in another order (the tests hold it to
float32 rounding); the rollout's log-probs still come from the trainer's own forward, not from the sampling
call.

It is a small C++ kernel compiled on first use with ``torch.utils.cpp_extension.load_inline`` (about 30 s, once
per machine: torch keeps the build under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``),
for this CPU (``-march=native``; the build's name carries the CPU's flags, so a home folder shared by other
machines does not load a foreign build). Without a C++ compiler, or with ``RLHFKIT_CPU_DECODE_ATTENTION=0``,
:func:`kernel` is None (the reason logged once) and decoding keeps the float32 cache and ``sdpa``.

Shapes: ``B`` rows, ``Hq`` query heads, ``Hk`` key / value heads, ``L`` cached positions, ``D`` head size.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os

import torch

log = logging.getLogger(__name__)

SWITCH = "RLHFKIT_CPU_DECODE_ATTENTION"  # "0": sdpa on a float32 cache, as before the kernel
MAX_HEAD_SIZE = 512
STORED = (torch.float32, torch.bfloat16)  # the dtypes the kernel reads keys and values in
# for this CPU; the reductions vectorised and summed in another order (rounding only). Not -ffast-math: its
# finite-only arithmetic, and the denormals it can switch off for the whole process, are not wanted here.
FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp-simd",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
]

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>

// exp for x <= 0 (scores minus their maximum), vectorisable (no call, no branch): 2^n * p(r), r = x - n ln 2
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // exp(-87) ~ 1.6e-38: the smallest normal float's order; below it counts as 0
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

static inline float to_float(uint16_t x) {  // bf16: the high half of a float32
  uint32_t u = ((uint32_t)x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline float to_float(float x) { return x; }

// q (B, Hq, D) float32 contiguous; k, v (B, Hk, L, D) of K / V (float32, or bf16 as uint16), unit stride along
// D; keep (B, L) bool or null
template <typename K, typename V>
static void attend(const float* qp, const K* kp, const V* vp, const bool* mp, float* op, int64_t B, int64_t Hq,
                   int64_t Hk, int64_t L, int64_t D, const int64_t* ks, const int64_t* vs, const int64_t* ms,
                   float sc) {
  const int64_t G = Hq / Hk;
  const int64_t ksb = ks[0], ksh = ks[1], ksl = ks[2], vsb = vs[0], vsh = vs[1], vsl = vs[2];
  const int64_t msb = ms[0], msl = ms[1];
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(G * L), acc(G * D), row(D), mx(G), total(G);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hk, h = i % Hk;
      const K* kb = kp + b * ksb + h * ksh;
      const V* vb = vp + b * vsb + h * vsh;
      const float* qb = qp + (b * Hq + h * G) * D;
      const bool* keep = mp ? mp + b * msb : nullptr;
      for (int64_t g = 0; g < G; ++g) mx[g] = -3.0e38f;
      for (int64_t l = 0; l < L; ++l) {
        const bool kept = !keep || keep[l * msl];
        if (kept) {
          const K* kr = kb + l * ksl;
          for (int64_t d = 0; d < D; ++d) row[d] = to_float(kr[d]);
        }
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.0f;
          if (kept) {
            const float* qg = qb + g * D;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
            dot *= sc;
            mx[g] = dot > mx[g] ? dot : mx[g];
          }
          s[g * L + l] = kept ? dot : -3.0e38f;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s.data() + g * L;
        const float m = mx[g];
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t l = 0; l < L; ++l) {
          const float e = sg[l] > -1.0e38f ? exp_nonpositive(sg[l] - m) : 0.0f;
          sg[l] = e;
          sum += e;
        }
        total[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t l = 0; l < L; ++l) {
        if (keep && !keep[l * msl]) continue;
        const V* vr = vb + l * vsl;
        for (int64_t d = 0; d < D; ++d) row[d] = to_float(vr[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * L + l];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * Hq + h * G + g) * D;
        const float inv = 1.0f / total[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
}

template <typename K>
static void with_values(const float* qp, const K* kp, torch::Tensor v, const bool* mp, float* op, int64_t B,
                        int64_t Hq, int64_t Hk, int64_t L, int64_t D, const int64_t* ks, const int64_t* ms,
                        float sc) {
  const int64_t vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
  if (v.scalar_type() == at::kBFloat16) {
    const uint16_t* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
    attend(qp, kp, vp, mp, op, B, Hq, Hk, L, D, ks, vs, ms, sc);
  } else {
    attend(qp, kp, v.data_ptr<float>(), mp, op, B, Hq, Hk, L, D, ks, vs, ms, sc);
  }
}

// q (B, Hq, D) float32 contiguous; k, v (B, Hk, L, D) float32 or bf16; keep (B, L) bool or empty
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor keep,
                               double scale) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hk = k.size(1), L = k.size(2);
  auto out = torch::empty({B, Hq, D}, q.options());
  const int64_t ks[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t ms[2] = {keep.numel() ? keep.stride(0) : 0, keep.numel() ? keep.stride(1) : 0};
  const bool* mp = keep.numel() ? keep.data_ptr<bool>() : nullptr;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (k.scalar_type() == at::kBFloat16) {
    const uint16_t* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
    with_values(qp, kp, v, mp, op, B, Hq, Hk, L, D, ks, ms, (float)scale);
  } else {
    with_values(qp, k.data_ptr<float>(), v, mp, op, B, Hq, Hk, L, D, ks, ms, (float)scale);
  }
  return out;
}
"""


def _cpu_flags() -> str:
    """This CPU's feature flags (Linux), which ``-march=native`` compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@functools.cache
def kernel():
    """The compiled extension (its ``decode_attention``), or None where it cannot be built or is switched off
    (module docstring); the reason is logged once."""
    if os.environ.get(SWITCH, "1") == "0":
        log.info("CPU decode attention: off (%s=0): sdpa on a float32 cache", SWITCH)
        return None
    digest = hashlib.sha256((SOURCE + _cpu_flags() + torch.__version__).encode()).hexdigest()[:12]
    try:
        from torch.utils.cpp_extension import load_inline

        log.info("CPU decode attention: building the kernel for this CPU (once per machine, ~30 s)")
        return load_inline(
            f"rlhfkit_decode_attention_{digest}",
            cpp_sources=SOURCE,
            functions=["decode_attention"],
            extra_cflags=FLAGS,
            verbose=False,
        )
    except Exception as error:  # no compiler, a failed build: the plain attention, said once
        reason = str(error).strip().splitlines()
        log.warning(
            "CPU decode attention: the kernel could not be built (%s); decoding uses sdpa on a float32 cache",
            reason[-1] if reason else type(error).__name__,
        )
        return None


def available() -> bool:
    """Whether :func:`decode_attention` can run here (the kernel built and not switched off)."""
    return kernel() is not None


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, kwargs: dict) -> bool:
    """Whether an attention call is one the kernel computes: one query position over cached ones on a CPU, keys
    and values in float32 or bf16 with unit stride along the head, no autograd, no dropout, softcap or position
    bias, a boolean mask (or none) shared by the heads, a head size up to ``MAX_HEAD_SIZE``, and not inside
    ``torch.compile``'s tracing."""
    if query.device.type != "cpu" or query.shape[2] != 1 or key.shape[2] < 2:
        return False  # one query position over a cache (a whole sequence of one token is not decoding)
    if key.dtype not in STORED or value.dtype not in STORED or key.stride(-1) != 1 or value.stride(-1) != 1:
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    if kwargs.get("dropout") or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return False
    if kwargs.get("sinks") is not None or kwargs.get("s_aux") is not None:
        return False
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1)):
        return False
    if query.shape[1] % key.shape[1] or query.shape[-1] > MAX_HEAD_SIZE or torch.compiler.is_compiling():
        return False
    return kernel() is not None


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``sdpa`` of one query position in float32 over float32 or bf16 keys and values (module docstring).

    Args:
        query: (B, Hq, 1, D), any float dtype (computed in float32).
        key, value: (B, Hk, L, D), float32 or bf16, Hq a multiple of Hk; views of a larger cache are fine.
        mask: None, or a boolean (B or 1, 1 or Hq, 1, L): True where the position may be attended; a mask
            that differs between heads is not supported (``applies`` refuses a call with one).
        scale: the scores' factor (``module.scaling``).
    Returns:
        (B, Hq, 1, D) float32.
    """
    b, hq, _, d = query.shape
    keep = torch.empty(0, dtype=torch.bool)
    if mask is not None:
        if mask.shape[1] != 1:
            raise ValueError("decode_attention: a mask that differs between heads is not supported")
        keep = mask[:, 0, 0, :].expand(b, key.shape[2])
    out = kernel().decode_attention(
        query.reshape(b, hq, d).float().contiguous(), key, value, keep, float(scale)
    )
    return out.view(b, hq, 1, d)
