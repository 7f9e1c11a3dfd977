# MOSIM LLMs GPU image: the PyTorch CUDA base, the training and conversion requirements, tokenizers for offline runs.
# Build with ./build.sh (or: docker build --build-arg BASE_IMAGE=... -t mosim-llms:latest .).
ARG BASE_IMAGE=pytorch/pytorch:2.4.0-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/root/.cache/huggingface

# procps: the launchers print `ps -p PID` for background runs and the runtime base image lacks it.
# g++ (with gcc and libc6-dev): torch.compile's inductor builds C++ kernels on the CPU and Triton builds a small C
# launcher for every GPU kernel; the runtime base image has no compiler ("Failed to find C compiler" at the first
# compiled forward). Versions are left to the base image's distribution (pinning them breaks every update).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends procps g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/mosim-llms

# Requirements before the code, so editing the code does not reinstall them. requirements.txt says torch>=2.4;
# the constraints pin torch to the base image's own CUDA build, so pip never swaps it for a PyPI wheel, and cap
# the libraries whose newest release no longer supports that torch (transformers 5 needs torch 2.6).
COPY requirements.txt requirements-convert.txt requirements-report.txt ./
COPY scripts/pip_constraints.py scripts/
# requirements-convert.txt goes in with --no-deps: it lists all the conversion imports (mlc-chakra's own
# dependencies, HolisticTraceAnalysis with jupyterlab, are not needed).
RUN python scripts/pip_constraints.py > /tmp/constraints.txt \
    && echo "constraints: $(tr '\n' ' ' < /tmp/constraints.txt)" \
    && pip install --no-cache-dir -c /tmp/constraints.txt -r requirements.txt -r requirements-report.txt \
    && pip install --no-cache-dir --no-deps -c /tmp/constraints.txt -r requirements-convert.txt

# Tokenizers where the training side looks first (/workspace/pretrained_models/<model-name>). Without network
# the script warns and the build goes on: training then tries the hub, else trains a local tokenizer.
COPY scripts/download_tokenizers.py scripts/
RUN python scripts/download_tokenizers.py --output-dir /workspace/pretrained_models

COPY . .
# The project itself (pyproject.toml), editable and without dependencies: `python gpt2/train.py`, the benchmarks and
# the mosim-* commands import it from any folder.
RUN pip install --no-cache-dir --no-deps -e .

# Fail the build here, not at the first run, when an import, torch.compile or a launcher is broken.
# transformers imports even when it has switched PyTorch off (too old a torch): ask it whether PyTorch is on.
# The build has no GPU: torch.compile builds a CPU kernel with the image's C++ compiler (Triton needs its C one).
RUN python -c "import torch, transformers, datasets, tokenizers, orjson, chakra.schema.protobuf.et_def_pb2; \
from transformers.utils import is_torch_available; \
assert is_torch_available(), f'transformers {transformers.__version__} switched off torch {torch.__version__}'; \
compiled = torch.compile(lambda x: torch.sin(x) * 2 + 1); x = torch.arange(8.0); \
assert torch.allclose(compiled(x), torch.sin(x) * 2 + 1), 'torch.compile gave a wrong result'; \
print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| transformers', transformers.__version__, \
'| torch.compile ok')" \
    && ./run_gpt2.sh --help > /dev/null && mosim-convert --help > /dev/null \
    && mkdir -p outputs checkpoints logs

HEALTHCHECK --interval=5m --timeout=60s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import torch, transformers"]

CMD ["bash"]
