"""BERT masked-LM pretraining: named sizes, model construction and the train.py entry point."""
