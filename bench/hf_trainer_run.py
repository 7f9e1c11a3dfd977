"""Child of train_bench.py: transformers.Trainer training the model, data, batch and precision our trainer trains."""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from trace_tools.command_line import ArgumentParser
from utils.data_utils import ResumableDistributedSampler
from utils.distributed import distributed_context
from utils.families import FAMILIES, load_family
from utils.metrics import count_parameters, flops_per_token, peak_flops_per_gpu
from utils.run_config import RunConfig, parse_run_config
from utils.trainer import Trainer as OurTrainer, settle_run


def parse_args(argv=None) -> "tuple[argparse.Namespace, RunConfig]":
    """This child's own flags, and the <family>/train.py flags of the run it mirrors (with that script's defaults
    for learning rate, weight decay, clipping, schedule and validation split)."""
    parser = ArgumentParser(description=__doc__, epilog="Every other flag is one of <family>/train.py's.")
    parser.add_argument("--family", choices=list(FAMILIES), required=True)
    parser.add_argument("--output-dir", required=True, help="Trainer's output_dir (nothing is saved into it)")
    parser.add_argument("--result", required=True, help="JSON file for the per-step times")
    own, trainer_flags = parser.parse_known_args(argv)
    config = parse_run_config(own.family, trainer_flags)
    if config.optim.max_steps is None or config.data.squad_file is None or config.devices.precision is None:
        parser.error("--max-steps, --squad-file and --precision are required")
    return own, config


def main(argv=None) -> int:
    args, config = parse_args(argv)
    optim = config.optim
    try:
        from transformers import Trainer, TrainerCallback, TrainingArguments
        import accelerate  # noqa: F401  (Trainer needs it; say so plainly instead of deep inside TrainingArguments)
    except ImportError as exc:
        print(f"error: transformers.Trainer cannot run: {exc} (pip install accelerate)", file=sys.stderr)
        return 1
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    family = load_family(args.family)
    # Our trainer's own setup builds the data, tokenizer and initial model, as gpt2/train.py or bert/train.py do.
    with distributed_context() as ctx:
        ours = OurTrainer(config, settle_run(config, family), family, ctx)
        ours.setup()
    network, model_config, train_data = ours.model, ours.model_config, ours.train_data
    seq = ours.settings.max_seq_length
    collator = family.make_collator(ours.tokenizer, seq)

    class StepTimer(TrainerCallback):
        """Wall time between consecutive optimizer-step ends, synchronised like our trainer's loss.item()."""

        def __init__(self):
            self.marks = []

        def _mark(self):
            if cuda:
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

        def on_train_begin(self, *_, **__):
            self._mark()

        def on_step_end(self, *_, **__):
            self._mark()

    timer = StepTimer()
    precision, max_steps = config.devices.precision, optim.max_steps
    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=optim.batch_size, max_steps=max_steps,
        learning_rate=optim.learning_rate, weight_decay=optim.weight_decay, max_grad_norm=optim.max_grad_norm,
        lr_scheduler_type=optim.lr_scheduler,
        warmup_steps=optim.warmup_steps if optim.warmup_steps is not None else int(0.1 * max_steps),  # as ours
        bf16=precision == "bf16", fp16=precision == "fp16", torch_compile=config.devices.compile,
        # Our trainer's AdamW is fused on GPUs only; the same here, so the optimizer does the same work.
        optim="adamw_torch_fused" if cuda else "adamw_torch", use_cpu=not cuda,
        # Our collators read special_tokens_mask, which Trainer's column filter would drop.
        remove_unused_columns=False, dataloader_drop_last=True, dataloader_num_workers=0,
        report_to="none", disable_tqdm=True, save_strategy="no", eval_strategy="no", logging_strategy="no",
        seed=optim.seed)
    class SameBatchesTrainer(Trainer):
        """Draws batches in our trainer's order (its sampler and seed), so both sides train on the same batches."""

        def _get_train_sampler(self, *_, **__):
            return ResumableDistributedSampler(train_data, num_replicas=1, rank=0, shuffle=True, seed=optim.seed)

    trainer = SameBatchesTrainer(model=network, args=training_args, train_dataset=train_data, data_collator=collator,
                                 callbacks=[timer])
    trainer.train()

    n_params, compute_params = count_parameters(network)
    result = {
        "step_s": [b - a for a, b in zip(timer.marks, timer.marks[1:])],
        "tokens_per_step": optim.batch_size * seq,
        "sequence_length": seq,
        "num_parameters": n_params,
        "flops_per_token": flops_per_token(compute_params, model_config.num_hidden_layers, model_config.hidden_size,
                                           seq),
        "peak_flops": peak_flops_per_gpu(device, precision),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    Path(args.result).write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
