"""Training-side library shared by gpt2/train.py and bert/train.py: data, tokenizers, DDP, the loop, checkpoints."""
