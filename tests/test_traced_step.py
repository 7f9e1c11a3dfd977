"""The traced step holds only what training does: DDP's gradient all-reduces, no trainer bookkeeping, no padding.

The two-rank runs work with transformers 4.x and 5.x alike (4.x gives GPT-2 causal-mask buffers that DDP would
broadcast every step): run this file in an environment with either, e.g. `python -m pytest tests/test_traced_step.py`.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bert.train import BERT_FAMILY  # noqa: E402
from gpt2.train import GPT2_FAMILY, collate_packed_blocks, encode_gpt2  # noqa: E402
from utils.data_utils import REAL_TOKENS, CountingCollator, TextExample, group_texts  # noqa: E402
from utils.distributed import buffers_change_in_training  # noqa: E402

TRACED_RUN = ["--model-name", "tiny", "--max-seq-length", "64", "--batch-size", "2", "--report-to", "none",
              "--no-save-initial", "--save-steps", "0", "--eval-steps", "0", "--eval-batches", "1", "--precision",
              "fp32", "--no-compile", "--logging-steps", "1", "--enable-tracing",
              # one step skipped, one warm-up, one recorded, none timed after it: the steps these tests reason about
              "--trace-wait-steps", "1", "--trace-warmup-steps", "1", "--trace-active-steps", "1",
              "--trace-after-steps", "0"]
# Host reads that belong to training itself: the optimizer's (AdamW's step counter on the CPU) and the data
# loader's (the MLM collator masking CPU tensors); BERT's forward also checks its padding mask (transformers' own
# code, inside DDP's forward). Anything else is bookkeeping the trainer added. GPT-2's forward reads nothing: its
# packed blocks carry no pad id for transformers to look for.
TRAINING_READS = ("Optimizer.step#", "enumerate(DataLoader)#")
MODEL_READS = {"gpt2": (), "bert": ("DistributedDataParallel.forward",)}
HOST_SYNC = "aten::_local_scalar_dense"  # what .item() / float(tensor) run


def traced_run(family: str, tmp: Path, ranks: int) -> Path:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    flags = [*TRACED_RUN, "--save-dir", str(tmp / "ckpt"), "--log-dir", str(tmp / "logs"),
             "--trace-output-dir", str(tmp / "outputs"), "--trace-name", f"{family}_{ranks}r"]
    if ranks == 1:
        command = [sys.executable, f"{family}/train.py", *flags]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--standalone",
                   f"{family}/train.py", "--num-gpus", str(ranks), *flags]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp / "outputs" / f"{family}_{ranks}r"


def host_nodes(trace_dir: Path, rank: int) -> list:
    return json.loads((trace_dir / f"host.{rank}.json").read_text())["nodes"]


def collectives(nodes: list) -> list:
    """(c10d op name, elements it moves) of every collective the host trace recorded."""
    found = []
    for node in nodes:
        if node["name"].startswith("c10d::"):
            shapes = node["inputs"]["shapes"][0]  # the tensor list the collective works on
            found.append((node["name"], sum(math.prod(shape) for shape in shapes)))
    return found


def reads_outside_training(trace_dir: Path, rank: int, model_reads: tuple = ()) -> list:
    """The enclosing ops of every .item()-like read that runs inside neither the optimizer's step, the data loader
    nor (when given) the model's forward.

    "Inside" is read from the device trace's times on the read's own thread, not from the host trace's parents: the
    observer keeps one stack of open ops per thread, and a collective's record function, opened on the training
    thread and closed by the backend's worker, pops whatever is on top of that stack then. On a loaded machine the
    optimizer's reads are then filed under the collective or under an AccumulateGrad left open on the stack."""
    events = [event for event in json.loads((trace_dir / f"device.{rank}.json").read_text())["traceEvents"]
              if event.get("ph") == "X" and event.get("cat") in ("cpu_op", "user_annotation")]
    outside = []
    for read in (event for event in events if event["name"] == HOST_SYNC):
        end = read["ts"] + read["dur"]
        enclosing = sorted((event for event in events if event is not read and event["tid"] == read["tid"]
                            and event["ts"] <= read["ts"] and event["ts"] + event["dur"] >= end),
                           key=lambda event: event["ts"])
        if not any(event["name"].startswith(TRAINING_READS + model_reads) for event in enclosing):
            outside.append(" > ".join(event["name"] for event in enclosing[-4:]) or "(no enclosing op)")
    return outside


@pytest.fixture(scope="module", params=["gpt2", "bert"])
def two_rank_trace(request, tmp_path_factory):
    return request.param, traced_run(request.param, tmp_path_factory.mktemp(f"{request.param}_2r"), ranks=2)


# ---- the traced step ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_traced_two_rank_step_holds_exactly_the_gradient_all_reduces(two_rank_trace):
    family, trace_dir = two_rank_trace
    info = json.loads((trace_dir / "run.json").read_text())
    for rank in (0, 1):
        found = collectives(host_nodes(trace_dir, rank))
        assert found, f"{family} rank {rank}: no collective in the traced step"
        # Only DDP's bucketed gradient all-reduces: no [loss, stop] all-reduce, no buffer broadcast.
        assert {name for name, _ in found} == {"c10d::allreduce_"}, found
        assert sum(elements for _, elements in found) == info["num_parameters"], found


@pytest.mark.slow
def test_traced_two_rank_step_reads_no_value_back_but_the_optimizers_and_data_loaders(two_rank_trace):
    family, trace_dir = two_rank_trace
    for rank in (0, 1):
        assert reads_outside_training(trace_dir, rank, MODEL_READS[family]) == [], \
            f"{family} rank {rank}"


@pytest.mark.slow
def test_two_ranks_agree_on_the_run_id(two_rank_trace):
    family, trace_dir = two_rank_trace
    run_id = json.loads((trace_dir / "run.json").read_text())["run_id"]
    for rank in (0, 1):
        device = json.loads((trace_dir / f"device.{rank}.json").read_text())
        assert device["mosim_run"] == {"id": run_id, "rank": rank, "world_size": 2}, f"{family} rank {rank}"


def test_one_rank_traced_gpt2_step_has_no_trainer_bookkeeping(tmp_path):
    trace_dir = traced_run("gpt2", tmp_path, ranks=1)
    assert collectives(host_nodes(trace_dir, 0)) == []
    # no .item() of the trainer's, and none of transformers' padding probe (a pad id looked for in every batch)
    assert reads_outside_training(trace_dir, 0) == []
    lines = [line.split(": ", 1)[1] for line in (tmp_path / "logs" / "training_rank_0.log").read_text().splitlines()
             if " step " in line and "ms/step" in line]
    # --logging-steps 1: the lines of steps 1 and 2, written while the window records steps 2 and 3, read no loss
    assert [line.startswith(f"step {n}/3 |") for n, line in enumerate(lines, start=1)] == [True] * 3
    assert "loss" not in lines[0].split("|")[2] and lines[0].endswith("loss read after the trace window")
    assert lines[1].endswith("loss read after the trace window")
    assert "| loss " in lines[2] and "tok/s" in lines[2]


def test_ddp_broadcasts_buffers_only_for_models_that_change_them_in_training():
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    bert = BertForMaskedLM(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=64))
    assert not buffers_change_in_training(gpt2) and not buffers_change_in_training(bert)
    assert buffers_change_in_training(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))


# ---- GPT-2 trains on packed blocks -------------------------------------------------------------------------------
class WordTokenizer:
    """A stand-in tokenizer: one id per word, end-of-text 0."""

    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=True, verbose=True):
        return {"input_ids": [[len(word) for word in text.split()] for text in texts]}


def test_group_texts_cuts_the_joined_stream_into_full_blocks_and_drops_the_rest():
    assert group_texts([[1, 2, 3], [4, 5], [6]], 3, separator=0) == [[1, 2, 3], [0, 4, 5], [0, 6, 0]]
    assert group_texts([[1, 2, 3, 4, 5]], 2) == [[1, 2], [3, 4]]  # 5 dropped, as run_clm drops the remainder


def test_gpt2_examples_become_full_blocks_with_end_of_text_between_texts():
    examples = [TextExample("a bb", "ccc"), TextExample("dddd eeeee")]
    # "a bb ccc" <eot> "dddd eeeee" <eot>: 7 tokens, one block of 4, the rest dropped
    assert encode_gpt2(WordTokenizer(), examples, 4) == {"input_ids": [[1, 2, 3, 0]]}
    assert encode_gpt2(WordTokenizer(), examples, 3) == {"input_ids": [[1, 2, 3], [0, 4, 5]]}


def test_packed_batches_have_no_padding_no_mask_and_count_every_token():
    blocks = [{"input_ids": [5, 6, 7, 8], "attention_mask": [1] * 4}, {"input_ids": [9, 10, 11, 12], "attention_mask": [1] * 4}]
    batch = CountingCollator(collate_packed_blocks)(blocks)
    assert set(batch) == {"input_ids", "labels", REAL_TOKENS}  # no mask: SDPA runs plain causal attention
    assert torch.equal(batch["labels"], batch["input_ids"]) and batch["input_ids"].shape == (2, 4)
    assert batch[REAL_TOKENS] == 8


def test_padded_bert_batches_count_only_their_real_tokens():
    from transformers import DataCollatorWithPadding, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[PAD]": 0, "x": 1}, "[PAD]")),
                                        pad_token="[PAD]")
    collate = CountingCollator(DataCollatorWithPadding(tokenizer, padding="max_length", max_length=8))
    batch = collate([{"input_ids": [1, 1, 1]}, {"input_ids": [1] * 5}])
    assert batch["input_ids"].shape == (2, 8) and batch[REAL_TOKENS] == 8


def test_only_collators_without_random_draws_may_run_in_dataloader_workers():
    assert GPT2_FAMILY.random_collator is False  # packed blocks: deterministic
    assert BERT_FAMILY.random_collator is True   # MLM masking draws from the resumable global RNG
