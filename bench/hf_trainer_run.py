"""Child of train_bench.py: transformers.Trainer training the model, data, batch and precision our trainer trains."""
import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from utils.data_utils import ResumableDistributedSampler, load_text_splits, tokenize_examples
from utils.metrics import count_parameters, flops_per_token, peak_flops_per_gpu
from utils.tokenization import load_tokenizer

# The settings our trainer uses by default (utils/trainer.py), repeated here so both sides do the same work.
LEARNING_RATE = 5e-5
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0
VALIDATION_FRACTION = 0.1


def family_of(name: str):
    if name == "gpt2":
        from gpt2.train import GPT2_FAMILY
        return GPT2_FAMILY
    from bert.train import BERT_FAMILY
    return BERT_FAMILY


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", choices=["gpt2", "bert"], required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--squad-file", required=True)
    parser.add_argument("--tokenizer-path", default=None)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--max-seq-length", type=int, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], required=True)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output-dir", required=True, help="Trainer's output_dir (nothing is saved into it)")
    parser.add_argument("--result", required=True, help="JSON file for the per-step times")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed
        import accelerate  # noqa: F401  (Trainer needs it; say so plainly instead of deep inside TrainingArguments)
    except ImportError as exc:
        print(f"error: transformers.Trainer cannot run: {exc} (pip install accelerate)", file=sys.stderr)
        return 1
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    family = family_of(args.family)
    set_seed(args.seed)

    # The same data, tokenizer and model as gpt2/train.py or bert/train.py build with the same flags.
    splits = load_text_splits(squad_file=args.squad_file, dataset_path=None, cache_dir=None,
                              validation_fraction=VALIDATION_FRACTION, seed=args.seed)
    request = family.tokenizer_request(args.model_name, family.resolve_config(args.model_name))
    tokenizer, _ = load_tokenizer(request, tokenizer_path=args.tokenizer_path, cache_dir=None,
                                  training_texts=splits.all_texts)
    tokenizer = family.prepare_tokenizer(tokenizer)
    config = family.resolve_config(args.model_name)
    family.finalize_config(config, tokenizer)
    model = family.build_model(config, "sdpa")
    seq = min(args.max_seq_length, getattr(config, "max_position_embeddings", args.max_seq_length))
    train_data = tokenize_examples(lambda examples: family.encode(tokenizer, examples, seq), splits.train)
    collator = family.make_collator(tokenizer, seq)

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
    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size, max_steps=args.max_steps,
        learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM,
        lr_scheduler_type="linear", warmup_steps=int(0.1 * args.max_steps),  # our default: 10% of the steps
        bf16=args.precision == "bf16", fp16=args.precision == "fp16", torch_compile=args.compile,
        # Our trainer's AdamW is fused on GPUs only; the same here, so the optimizer does the same work.
        optim="adamw_torch_fused" if cuda else "adamw_torch", use_cpu=not cuda,
        # Our collators read special_tokens_mask, which Trainer's column filter would drop.
        remove_unused_columns=False, dataloader_drop_last=True, dataloader_num_workers=0,
        report_to="none", disable_tqdm=True, save_strategy="no", eval_strategy="no", logging_strategy="no",
        seed=args.seed)
    class SameBatchesTrainer(Trainer):
        """Draws batches in our trainer's order (its sampler and seed), so both sides train on the same batches."""

        def _get_train_sampler(self, *_, **__):
            return ResumableDistributedSampler(train_data, num_replicas=1, rank=0, shuffle=True, seed=args.seed)

    trainer = SameBatchesTrainer(model=model, args=training_args, train_dataset=train_data, data_collator=collator,
                                 callbacks=[timer])
    trainer.train()

    n_params, compute_params = count_parameters(model)
    result = {
        "step_s": [b - a for a, b in zip(timer.marks, timer.marks[1:])],
        "tokens_per_step": args.batch_size * seq,
        "sequence_length": seq,
        "num_parameters": n_params,
        "flops_per_token": flops_per_token(compute_params, config.num_hidden_layers, config.hidden_size, seq),
        "peak_flops": peak_flops_per_gpu(device, args.precision),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    Path(args.result).write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
