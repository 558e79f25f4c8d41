"""Swap or recompute? The cost model behind ``--preemption-mode swap``.

A retracted request's KV can be dropped and recomputed when it resumes (a
prefill over its tokens), or copied to the host tier and back. Per token:

    recompute = 2 x model parameters FLOPs / prefill FLOP rate
    swap      = 2 x KV bytes per token / host<->device copy bandwidth   (out and back)

and the request is swapped when ``swap < recompute`` over its tokens (both
are linear in tokens, so the answer depends on the model and the machine,
not on the request: attention's quadratic share of a prefill is left out,
which only favours recomputing). The rates are deliberately round figures
(`DEVICE_RATES`): the decision flips by model size, not by a few percent.

Examples: SmolLM2-135M in float32 on a CPU: recompute ~2.7 ms/token, swap
~18 us/token (swap). The same model in bfloat16 on an H200: recompute
~0.5 us/token, swap ~1.8 us/token (recompute). A 70B model on an H200:
recompute ~280 us/token, swap ~26 us/token (swap).
"""

from __future__ import annotations

from dataclasses import dataclass

# (prefill FLOP/s, host<->device copy bytes/s); CPU: one socket's matmul rate
# and memcpy; CUDA: about half a current GPU's dense bf16 peak and a pinned
# copy over PCIe 5.
DEVICE_RATES = {"cpu": (1e11, 5e9), "cuda": (5e14, 2.5e10)}


@dataclass(frozen=True)
class SwapCostModel:
    num_params: int
    kv_bytes_per_token: float
    flops_per_s: float
    copy_bytes_per_s: float

    @classmethod
    def for_device(cls, device: str, num_params: int, kv_bytes_per_token: float) -> "SwapCostModel":
        flops, bw = DEVICE_RATES["cuda" if device.startswith("cuda") else "cpu"]
        return cls(num_params, kv_bytes_per_token, flops, bw)

    def recompute_s(self, tokens: int) -> float:
        return tokens * 2.0 * self.num_params / self.flops_per_s

    def swap_s(self, tokens: int) -> float:
        return tokens * 2.0 * self.kv_bytes_per_token / self.copy_bytes_per_s

    def should_swap(self, tokens: int) -> bool:
        return tokens > 0 and self.swap_s(tokens) < self.recompute_s(tokens)

    def describe(self) -> dict[str, float]:
        return {
            "recompute_us_per_token": round(self.recompute_s(1) * 1e6, 3),
            "swap_us_per_token": round(self.swap_s(1) * 1e6, 3),
        }
