"""Causal-LM pretraining of GPT-2 from its config: a SQuAD example becomes `question + " " + context`."""
import sys

try:
    from utils.errors import stop_quietly_while_starting_up
except ModuleNotFoundError:  # run as a script by a Python that does not have the project installed
    sys.exit(f"error: {sys.executable} has no mosim-llms (this project, installed); use the project's environment: "
             "source .venv/bin/activate (./run_tests.sh or ./run_all_profiling.sh creates .venv), or run "
             "`pip install -e .` in the repository, or `python -m gpt2.train` from there")

if __name__ == "__main__":
    stop_quietly_while_starting_up()  # Ctrl-C during the slow imports below: one line, not a traceback

from utils.environment import require  # noqa: E402

require("training")  # one line naming the environment to use, not a ModuleNotFoundError

from transformers import default_data_collator

from gpt2.config import GPT2_SIZES
from gpt2.model import (GPT2LMHeadModel, build_gpt2_model, finalize_gpt2_config, gpt2_tokenizer_request,
                        prepare_gpt2_tokenizer, resolve_gpt2_config)
from utils.data_utils import group_texts
from utils.trainer import ModelFamily, main as run_training


def encode_gpt2(tokenizer, examples, max_length: int):
    """One text per example, each ended by end-of-text, packed into full blocks of max_length tokens (run_clm's
    group_texts): no padding, so every trained, traced and counted token is a real one."""
    texts = [ex.text if ex.text_pair is None else f"{ex.text} {ex.text_pair}" for ex in examples]
    token_rows = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return {"input_ids": group_texts(token_rows, max_length, separator=tokenizer.eos_token_id)}


def collate_packed_blocks(features):
    """Stack full blocks; labels are the input ids (the model shifts them), as run_clm gives them to
    default_data_collator. No attention mask: every token is real, so SDPA runs plain causal attention (the flash
    kernel on CUDA), and every step has one shape (steady torch.compile graphs, comparable traces)."""
    return default_data_collator([{"input_ids": f["input_ids"], "labels": f["input_ids"]} for f in features])


def gpt2_collator(tokenizer, max_length: int):
    return collate_packed_blocks


GPT2_FAMILY = ModelFamily(
    name="gpt2",
    title="Causal-LM pretraining of GPT-2 (from its config) on SQuAD, a SQuAD JSON file or a JSONL corpus.",
    model_class=GPT2LMHeadModel,
    size_names=tuple(GPT2_SIZES),
    resolve_config=resolve_gpt2_config,
    tokenizer_request=gpt2_tokenizer_request,
    prepare_tokenizer=prepare_gpt2_tokenizer,
    finalize_config=finalize_gpt2_config,
    build_model=build_gpt2_model,
    encode=encode_gpt2,
    make_collator=gpt2_collator,
    random_collator=False,  # packed blocks draw no random numbers: DataLoader workers may collate them
)


def main(argv=None) -> int:
    return run_training(GPT2_FAMILY, argv)


if __name__ == "__main__":
    sys.exit(main())
