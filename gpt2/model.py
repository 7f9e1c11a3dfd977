"""GPT-2 construction: GPT2Config from --model-name and the tokenizer, GPT2LMHeadModel from it (no weights)."""
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from gpt2.config import GPT2_SIZES, HUB_TOKENIZER_ID
from utils.model_config import resolve_model_config
from utils.tokenization import TokenizerRequest


def resolve_gpt2_config(model_name: str) -> GPT2Config:
    return resolve_model_config(model_name, GPT2_SIZES, GPT2Config, "gpt2", "gpt2/train.py")


def gpt2_tokenizer_request(model_name: str, config: GPT2Config) -> TokenizerRequest:
    if model_name == "tiny":  # no published tokenizer: a small one trained on the data keeps the model tiny
        return TokenizerRequest(family="gpt2", kind="byte-level-bpe", model_name=model_name, hub_id=None,
                                vocab_size=config.vocab_size)
    return TokenizerRequest(family="gpt2", kind="byte-level-bpe", model_name=model_name, hub_id=HUB_TOKENIZER_ID,
                            vocab_size=config.vocab_size, shared_name="gpt2")


def prepare_gpt2_tokenizer(tokenizer):
    """GPT-2 has no pad token; pad with end-of-text (labels mask padding, so it is never a target)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def finalize_gpt2_config(config: GPT2Config, tokenizer) -> None:
    config.vocab_size = len(tokenizer)
    config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
    # Training packs text into full blocks (gpt2/train.py): there is no padding. With a pad id set, transformers
    # would look for it in every batch without an attention mask (a host sync per forward, and ops in every trace).
    config.pad_token_id = None


def build_gpt2_model(config: GPT2Config, attn_implementation: str) -> GPT2LMHeadModel:
    """Randomly initialised GPT2LMHeadModel (pretraining from scratch) with the chosen attention kernel."""
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    assert isinstance(model, GPT2LMHeadModel), type(model)
    return model
