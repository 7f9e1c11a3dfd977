"""Throughput and model FLOPs utilisation (MFU), and the metric sinks: TensorBoard and Weights & Biases."""
import logging
import os
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

# Dense peak TFLOP/s per GPU from the vendors' data sheets: (bf16/fp16 tensor cores, tf32 tensor cores, fp32).
# First substring match of torch.cuda.get_device_name() wins, so specific names come before general ones.
PEAK_TFLOPS = [
    ("H200", (989.4, 494.7, 66.9)),
    ("H100 PCIe", (756.0, 378.0, 51.2)),
    ("H100 NVL", (835.0, 417.5, 60.0)),
    ("H100", (989.4, 494.7, 66.9)),       # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", (312.0, 156.0, 19.5)),
    ("L40S", (362.1, 183.2, 91.6)),
    ("L4", (121.0, 60.0, 30.3)),
    ("A10", (125.0, 62.5, 31.2)),
    ("V100", (125.0, None, 15.7)),        # fp16 only, no bf16/tf32
    ("RTX 4090", (165.2, 82.6, 82.6)),
]


def peak_flops_per_gpu(device: torch.device, precision: str, override_tflops: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of one GPU for this precision; None on CPU or for a GPU not in the table (MFU not shown)."""
    if device.type != "cuda":
        return None
    if override_tflops:
        return override_tflops * 1e12
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32, fp32) in PEAK_TFLOPS:
        if key in name:
            if precision in ("bf16", "fp16"):
                peak = half
            else:
                peak = tf32 if torch.get_float32_matmul_precision() != "highest" and tf32 else fp32
            return peak * 1e12 if peak else None
    logger.info("no peak FLOP/s known for %r: MFU not reported (pass --peak-tflops to set it)", name)
    return None


def count_parameters(model: torch.nn.Module) -> "tuple[int, int]":
    """(all parameters, parameters that do matmul work): position embeddings are lookups, not compute.

    Tied weights are counted once (parameters() deduplicates); the tied output projection is real compute.
    """
    total = position = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if name.endswith(("wpe.weight", "position_embeddings.weight")):
            position += param.numel()
    return total, total - position


def flops_per_token(compute_params: int, n_layer: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls forward and backward plus 12*L*H*T for attention scores
    (PaLM paper, appendix B; the estimate nanoGPT's MFU uses)."""
    return 6.0 * compute_params + 12.0 * n_layer * hidden * seq_len


class MetricSinks:
    """Scalars to TensorBoard and/or W&B on rank 0; nothing on other ranks or with --report-to none."""

    def __init__(self, report_to: str, log_dir: Path, run_name: str, config: dict, enabled: bool):
        self.tensorboard = None
        self.wandb_run = None
        if not enabled or report_to == "none":
            return
        if report_to == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning("--report-to tensorboard but the tensorboard package is missing; pip install tensorboard")
                return
            self.tensorboard = SummaryWriter(log_dir=str(Path(log_dir) / "tensorboard" / run_name))
            logger.info("TensorBoard: tensorboard --logdir %s", Path(log_dir) / "tensorboard")
        elif report_to == "wandb":
            try:
                import wandb
            except ImportError:
                logger.warning("--report-to wandb but the wandb package is missing; pip install wandb")
                return
            if not os.environ.get("WANDB_MODE") and not os.environ.get("WANDB_API_KEY"):
                # No credentials: record locally instead of prompting for a login; `wandb sync` uploads later.
                os.environ["WANDB_MODE"] = "offline"
                logger.info("W&B: no WANDB_API_KEY, logging offline under %s (upload later with `wandb sync`)", log_dir)
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.wandb_run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mosim-llms"), name=run_name,
                                        dir=str(log_dir), config=config)

    def log(self, scalars: dict, step: int) -> None:
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
