"""Masked-LM pretraining of BERT from its config: a SQuAD example becomes `[CLS] question [SEP] context [SEP]`."""
import sys

try:
    from utils.errors import stop_quietly_while_starting_up
except ModuleNotFoundError:  # run as a script by a Python that does not have the project installed
    sys.exit(f"error: {sys.executable} has no mosim-llms (this project, installed); use the project's environment: "
             "source .venv/bin/activate (./run_tests.sh or ./run_all_profiling.sh creates .venv), or run "
             "`pip install -e .` in the repository, or `python -m bert.train` from there")

if __name__ == "__main__":
    stop_quietly_while_starting_up()  # Ctrl-C during the slow imports below: one line, not a traceback

from utils.environment import require  # noqa: E402

require("training")  # one line naming the environment to use, not a ModuleNotFoundError

import torch
from transformers import DataCollatorForLanguageModeling

from bert.config import BERT_SIZES
from bert.model import (BertForMaskedLM, bert_tokenizer_request, build_bert_model, finalize_bert_config,
                        prepare_bert_tokenizer, resolve_bert_config)
from utils.errors import UsageError
from utils.trainer import ModelFamily, main as run_training

MLM_PROBABILITY = 0.15


def encode_bert(tokenizer, examples, max_length: int):
    """(question, context) pairs with token type ids; a long context continues in further windows, each with
    its question. Corpus lines (no pair) are single segments."""
    options = dict(max_length=max_length, return_overflowing_tokens=True, return_special_tokens_mask=True)
    if all(ex.text_pair is not None for ex in examples):
        try:
            return tokenizer([ex.text for ex in examples], [ex.text_pair for ex in examples],
                             truncation="only_second", **options)
        except Exception as exc:  # the tokenizers library raises a bare Exception when a question fills the window
            raise UsageError(f"--max-seq-length {max_length} leaves no room for the context after a question "
                             f"({str(exc).splitlines()[0]}); raise --max-seq-length") from None
    return tokenizer([ex.text if ex.text_pair is None else f"{ex.text} {ex.text_pair}" for ex in examples],
                     truncation=True, **options)


class MaskedLMCollator:
    """DataCollatorForLanguageModeling(mlm_probability=0.15) over batches padded to max_length.

    A batch of short texts can come out with no masked token at all; its loss would be NaN (a mean over
    nothing), so such a batch is masked again.
    """

    def __init__(self, tokenizer, max_length: int):
        self.collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=MLM_PROBABILITY,
                                                        pad_to_multiple_of=max_length)

    def __call__(self, examples):
        maskable = any(0 in ex.get("special_tokens_mask", [0]) for ex in examples)
        while True:
            batch = self.collator(examples)
            if not maskable or bool(torch.any(batch["labels"] != -100)):
                return batch


BERT_FAMILY = ModelFamily(
    name="bert",
    title="Masked-LM pretraining of BERT (from its config) on SQuAD, a SQuAD JSON file or a JSONL corpus.",
    model_class=BertForMaskedLM,
    size_names=tuple(BERT_SIZES),
    resolve_config=resolve_bert_config,
    tokenizer_request=bert_tokenizer_request,
    prepare_tokenizer=prepare_bert_tokenizer,
    finalize_config=finalize_bert_config,
    build_model=build_bert_model,
    encode=encode_bert,
    make_collator=MaskedLMCollator,
)


def main(argv=None) -> int:
    return run_training(BERT_FAMILY, argv)


if __name__ == "__main__":
    sys.exit(main())
