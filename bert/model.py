"""BERT construction: BertConfig from --model-name and the tokenizer, BertForMaskedLM from it (no weights)."""
from transformers import AutoModelForMaskedLM, BertConfig, BertForMaskedLM

from bert.config import BERT_SIZES, DEFAULT_MODEL_NAME, HUB_TOKENIZER_IDS
from utils.model_config import resolve_model_config
from utils.tokenization import TokenizerRequest


def resolve_bert_config(model_name: str) -> BertConfig:
    return resolve_model_config(model_name, BERT_SIZES, BertConfig, "bert", "bert/train.py")


def bert_tokenizer_request(model_name: str, config: BertConfig) -> TokenizerRequest:
    if model_name == "tiny":  # no published tokenizer: a small one trained on the data keeps the model tiny
        return TokenizerRequest(family="bert", kind="wordpiece", model_name=model_name, hub_id=None,
                                vocab_size=config.vocab_size, lowercase=True)
    # A local config directory gets the published uncased vocabulary unless it holds its own tokenizer;
    # base and large share that vocabulary, so either downloaded copy serves both.
    hub_id = HUB_TOKENIZER_IDS.get(model_name, HUB_TOKENIZER_IDS[DEFAULT_MODEL_NAME])
    return TokenizerRequest(family="bert", kind="wordpiece", model_name=model_name, hub_id=hub_id,
                            vocab_size=config.vocab_size, lowercase=True, shared_name=DEFAULT_MODEL_NAME)


def prepare_bert_tokenizer(tokenizer):
    return tokenizer


def finalize_bert_config(config: BertConfig, tokenizer) -> None:
    config.vocab_size = len(tokenizer)
    config.pad_token_id = tokenizer.pad_token_id


def build_bert_model(config: BertConfig, attn_implementation: str) -> BertForMaskedLM:
    """Randomly initialised BertForMaskedLM (pretraining from scratch) with the chosen attention kernel."""
    model = AutoModelForMaskedLM.from_config(config, attn_implementation=attn_implementation)
    assert isinstance(model, BertForMaskedLM), type(model)
    return model
