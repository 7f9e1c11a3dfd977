"""Named GPT-2 sizes: the published hyperparameters of OpenAI's checkpoints, and `tiny` for tests and CPU demos."""

# GPT2Config's defaults (vocab 50257, 1024 positions, gelu_new, dropout 0.1, eps 1e-5) are the published ones;
# only depth and width differ between the four released sizes.
GPT2_SIZES = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),          # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 355M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),   # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),      # 1.5B
    # Two layers, 64 wide, with a small trained tokenizer: seconds per step on a laptop CPU. The special token
    # ids are placeholders inside the small vocabulary; the tokenizer's real ids replace them before building.
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, n_positions=512, vocab_size=2048, bos_token_id=0, eos_token_id=0),
}
HUB_TOKENIZER_ID = "openai-community/gpt2"  # the four sizes share one tokenizer
