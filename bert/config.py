"""Named BERT sizes: the published hyperparameters of Google's uncased checkpoints, and `tiny` for tests and CPU demos."""

# BertConfig's defaults (vocab 30522, 512 positions, 2 token types, gelu, dropout 0.1, eps 1e-12) are the
# published ones; depth, width and feed-forward size differ between base and large.
BERT_SIZES = {
    "bert-base-uncased": dict(num_hidden_layers=12, num_attention_heads=12, hidden_size=768, intermediate_size=3072),
    "bert-large-uncased": dict(num_hidden_layers=24, num_attention_heads=16, hidden_size=1024, intermediate_size=4096),
    # Two layers, 64 wide, with a small trained WordPiece vocabulary: seconds per step on a laptop CPU.
    "tiny": dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=64, intermediate_size=256, vocab_size=2048),
}
DEFAULT_MODEL_NAME = "bert-base-uncased"
HUB_TOKENIZER_IDS = {"bert-base-uncased": "google-bert/bert-base-uncased",
                     "bert-large-uncased": "google-bert/bert-large-uncased"}
