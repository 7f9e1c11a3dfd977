"""GPT-2 causal-LM pretraining: named sizes, model construction and the train.py entry point."""
