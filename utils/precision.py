"""Float formats on the training device: bf16 only where the GPU runs it natively, TF32 for fp32 matmuls."""
import logging
from typing import Optional

import torch

logger = logging.getLogger(__name__)

# bf16 tensor cores arrived with Ampere (compute capability 8.0). Older GPUs (V100 7.0, T4 7.5) report bf16 as
# "supported" in recent torch because it is emulated, at a fraction of fp16's speed: they train in fp16 instead.
NATIVE_BF16_CAPABILITY = (8, 0)


def has_native_bf16(device_index: Optional[int] = None) -> bool:
    """Whether the CUDA device computes bf16 in hardware (compute capability >= 8.0)."""
    if not torch.cuda.is_available():
        return False
    return tuple(torch.cuda.get_device_capability(device_index)) >= NATIVE_BF16_CAPABILITY


def default_precision() -> str:
    """bf16 on GPUs with native bf16, fp16 (with a gradient scaler) on older GPUs, fp32 on the CPU."""
    if not torch.cuda.is_available():
        return "fp32"
    return "bf16" if has_native_bf16() else "fp16"


def bf16_refusal() -> Optional[str]:
    """Why --precision bf16 cannot train on this GPU, or None when it can (or there is no GPU: CPU autocast)."""
    if not torch.cuda.is_available() or has_native_bf16():
        return None
    major, minor = torch.cuda.get_device_capability()
    return (f"--precision bf16: {torch.cuda.get_device_name()} (compute capability {major}.{minor}) has no native bf16 "
            f"(it needs {NATIVE_BF16_CAPABILITY[0]}.{NATIVE_BF16_CAPABILITY[1]}); use --precision fp16")


def enable_tf32_matmuls(device: torch.device) -> None:
    """fp32 matmuls and convolutions on TF32 tensor cores (Ampere and newer); the CPU is left as it is."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
