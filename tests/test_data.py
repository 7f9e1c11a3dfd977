"""Tests of the training data side: readers, the bundled sample, tokenizers, collators and the resumable sampler."""
import json
import logging
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bert.train import BERT_FAMILY, MaskedLMCollator, encode_bert  # noqa: E402
from gpt2.train import GPT2_FAMILY, encode_gpt2, gpt2_collator  # noqa: E402
from utils import hub  # noqa: E402
from utils.data_utils import (BUNDLED_SQUAD_SAMPLE, BatchStream, TextExample, build_dataloader,  # noqa: E402
                              load_text_splits, read_jsonl_corpus, read_squad_json, split_train_validation,
                              tokenize_examples)
from utils.errors import DataError, UsageError  # noqa: E402
from utils.metrics import flops_per_token, peak_flops_per_gpu  # noqa: E402
from utils.tokenization import TokenizerRequest, load_tokenizer, trained_tokenizer  # noqa: E402

KOREAN_LINES = ["한국어와 English가 섞인 문장입니다. 모델은 두 언어를 모두 배웁니다.",
                "서울은 대한민국의 수도이며 Seoul is the capital city.",
                "토크나이저는 UTF-8 바이트를 다룹니다; the tokenizer handles bytes."]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No hub in tests: the offline decision is made from the environment, never from the network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "_decision", None)


@pytest.fixture(scope="module")
def squad_examples():
    return read_squad_json(BUNDLED_SQUAD_SAMPLE)


@pytest.fixture(scope="module")
def tokenizers(squad_examples, tmp_path_factory):
    """Stand-in tokenizers trained on the bundled sample, as the offline fallback builds them."""
    cache = tmp_path_factory.mktemp("tokenizers")
    texts = [t for ex in squad_examples for t in (ex.text, ex.text_pair)]
    gpt2, _ = trained_tokenizer(TokenizerRequest("gpt2", "byte-level-bpe", "tiny", None, 2048), texts, cache)
    bert, _ = trained_tokenizer(TokenizerRequest("bert", "wordpiece", "tiny", None, 2048, lowercase=True), texts, cache)
    return GPT2_FAMILY.prepare_tokenizer(gpt2), BERT_FAMILY.prepare_tokenizer(bert)


# ---- the bundled sample ---------------------------------------------------------------------------------------
def test_bundled_sample_is_squad_v1_with_hundreds_of_questions_and_exact_answer_spans():
    document = json.loads(BUNDLED_SQUAD_SAMPLE.read_text(encoding="utf-8"))
    assert document["version"] == "1.1"
    qas = [(p["context"], qa) for a in document["data"] for p in a["paragraphs"] for qa in p["qas"]]
    assert 300 <= len(qas) <= 1000
    assert len({qa["id"] for _, qa in qas}) == len(qas)
    for context, qa in qas:
        answer = qa["answers"][0]
        assert context[answer["answer_start"]:answer["answer_start"] + len(answer["text"])] == answer["text"]


def test_sample_generator_rewrites_the_bundled_file_byte_for_byte(tmp_path):
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import make_squad_sample
    out = tmp_path / "sample.json"
    assert make_squad_sample.main(["--output", str(out)]) == 0
    assert out.read_bytes() == BUNDLED_SQUAD_SAMPLE.read_bytes()


# ---- readers ----------------------------------------------------------------------------------------------------
def test_squad_v2_file_gives_question_context_pairs_including_unanswerable_ones(tmp_path):
    path = tmp_path / "v2.json"
    path.write_text(json.dumps({"version": "v2.0", "data": [{"title": "t", "paragraphs": [{
        "context": "Alpha beta gamma.", "qas": [
            {"id": "1", "question": "What comes after alpha?", "answers": [{"text": "beta", "answer_start": 6}],
             "is_impossible": False},
            {"id": "2", "question": "What comes after omega?", "answers": [], "is_impossible": True}]}]}]}))
    assert read_squad_json(path) == [TextExample("What comes after alpha?", "Alpha beta gamma."),
                                     TextExample("What comes after omega?", "Alpha beta gamma.")]


def test_jsonl_corpus_keeps_korean_and_english_text_and_skips_blank_lines(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in KOREAN_LINES) + "\n\n",
                    encoding="utf-8")
    assert [ex.text for ex in read_jsonl_corpus(path)] == KOREAN_LINES
    assert all(ex.text_pair is None for ex in read_jsonl_corpus(path))


def test_too_little_data_for_a_validation_set_names_the_file(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text('{"text": "only one line"}\n')
    with pytest.raises(DataError, match=rf"^{path}: need at least 2 examples to hold out a validation set, got 1$"):
        load_text_splits(squad_file=None, dataset_path=str(path), cache_dir=None, validation_fraction=0.1, seed=0,
                         allow_hub=False)


def test_jsonl_directory_reads_every_jsonl_file_in_name_order(tmp_path):
    (tmp_path / "b.jsonl").write_text('{"text": "second"}\n')
    (tmp_path / "a.jsonl").write_text('{"text": "first"}\n')
    assert [ex.text for ex in read_jsonl_corpus(tmp_path)] == ["first", "second"]


@pytest.mark.parametrize("content, problem", [
    ('{"text": "ok"}\n{"text": "broken\n', "2: not valid JSON"),
    ('{"text": "ok"}\n["a list"]\n', '2: expected an object with a "text" string'),
    ('{"text": "ok"}\n{"body": "no text key"}\n', '2: expected an object with a "text" string'),
])
def test_malformed_jsonl_line_names_file_and_line(tmp_path, content, problem):
    path = tmp_path / "corpus.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as error:
        read_jsonl_corpus(path)
    assert str(error.value).startswith(f"{path}:{problem}")


def test_jsonl_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"text": "ok"}\n{"text": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: not UTF-8"):
        read_jsonl_corpus(path)


def test_missing_and_malformed_squad_files_name_the_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.json: file not found"):
        read_squad_json(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"data": [\n  {"title": }\n]}')
    with pytest.raises(DataError, match=r"bad\.json: not valid JSON \(line 2"):
        read_squad_json(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"rows": []}')
    with pytest.raises(DataError, match=r"wrong\.json: not SQuAD v1.1/v2.0 JSON"):
        read_squad_json(wrong)


def test_validation_split_is_seeded_disjoint_and_complete(squad_examples):
    train, val = split_train_validation(squad_examples, 0.1, seed=3)
    assert len(val) == round(0.1 * len(squad_examples)) and len(train) + len(val) == len(squad_examples)
    assert split_train_validation(squad_examples, 0.1, seed=3) == (train, val)
    assert split_train_validation(squad_examples, 0.1, seed=4)[1] != val


def test_offline_hub_falls_back_to_the_bundled_sample_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        splits = load_text_splits(squad_file=None, dataset_path=None, cache_dir=None, validation_fraction=0.1, seed=0)
    assert splits.source == "bundled:data/squad_sample.json"
    assert len(splits.train) + len(splits.validation) == len(read_squad_json(BUNDLED_SQUAD_SAMPLE))
    assert any("bundled sample" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


# ---- tokenizers and collators -----------------------------------------------------------------------------------
def test_trained_fallback_tokenizer_is_cached_and_reused(squad_examples, tmp_path, caplog):
    texts = [ex.text for ex in squad_examples[:50]]
    request = TokenizerRequest("gpt2", "byte-level-bpe", "gpt2", "openai-community/gpt2", 500)
    first, where = trained_tokenizer(request, texts, tmp_path)
    stamp = (where / "tokenizer.json").stat().st_mtime_ns
    second, where_again = trained_tokenizer(request, texts, tmp_path)
    assert where_again == where and (where / "tokenizer.json").stat().st_mtime_ns == stamp
    assert first("Who founded it?")["input_ids"] == second("Who founded it?")["input_ids"]
    assert trained_tokenizer(request, texts[:10], tmp_path)[1] != where  # other text, other tokenizer


def test_tokenizer_chain_uses_tokenizer_path_before_anything_else(tokenizers, tmp_path):
    gpt2_tokenizer, _ = tokenizers
    gpt2_tokenizer.save_pretrained(tmp_path / "tok")
    request = TokenizerRequest("gpt2", "byte-level-bpe", "gpt2", "openai-community/gpt2", 50257)
    tokenizer, source = load_tokenizer(request, tokenizer_path=str(tmp_path / "tok"), cache_dir=None,
                                       training_texts=lambda: pytest.fail("must not train"))
    assert source == f"--tokenizer-path {tmp_path / 'tok'}" and len(tokenizer) == len(gpt2_tokenizer)
    with pytest.raises(UsageError, match="not found"):
        load_tokenizer(request, tokenizer_path=str(tmp_path / "missing"), cache_dir=None, training_texts=list)


def test_pretrained_models_folder_is_tried_for_the_size_then_for_the_shared_tokenizer(tokenizers, tmp_path, monkeypatch):
    from gpt2.model import gpt2_tokenizer_request, resolve_gpt2_config
    from utils import tokenization
    monkeypatch.setattr(tokenization, "PRETRAINED_MODELS_DIR", tmp_path)
    tokenizers[0].save_pretrained(tmp_path / "gpt2")  # what scripts/download_tokenizers.py leaves there
    request = gpt2_tokenizer_request("gpt2-xl", resolve_gpt2_config("gpt2-xl"))
    tokenizer, source = load_tokenizer(request, tokenizer_path=None, cache_dir=None,
                                       training_texts=lambda: pytest.fail("must not train"))
    assert source == str(tmp_path / "gpt2") and len(tokenizer) == len(tokenizers[0])


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_model_folder_with_only_a_config_is_no_tokenizer(family, tmp_path, monkeypatch):
    """A user's own model size is a folder with a config.json and no vocabulary files. transformers builds a
    tokenizer of special tokens alone from it (every GPT-2 text became no tokens, every BERT word [UNK]): the
    trainer must train its stand-in instead, and --tokenizer-path there must say what is wrong."""
    from bert.model import bert_tokenizer_request, resolve_bert_config
    from gpt2.model import gpt2_tokenizer_request, resolve_gpt2_config
    from utils import tokenization
    monkeypatch.setattr(tokenization, "TRAINED_TOKENIZER_CACHE", tmp_path / "cache")
    model_dir = tmp_path / "my-size"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": family, "vocab_size": 300}))
    resolve, make_request = ((resolve_gpt2_config, gpt2_tokenizer_request) if family == "gpt2"
                             else (resolve_bert_config, bert_tokenizer_request))
    request = make_request(str(model_dir), resolve(str(model_dir)))
    tokenizer, source = load_tokenizer(request, tokenizer_path=None, cache_dir=None,
                                       training_texts=lambda: ["the cat sat on the mat"] * 20)
    assert source.startswith("trained:")
    ids = tokenizer("the cat", add_special_tokens=False)["input_ids"]
    assert ids and tokenizer.unk_token_id not in ids
    with pytest.raises(UsageError, match=f"{model_dir}: cannot load a tokenizer .*no vocabulary"):
        load_tokenizer(request, tokenizer_path=str(model_dir), cache_dir=None, training_texts=list)


def test_offline_named_model_warns_that_it_trains_a_stand_in_tokenizer(tmp_path, monkeypatch, caplog):
    from utils import tokenization
    monkeypatch.setattr(tokenization, "TRAINED_TOKENIZER_CACHE", tmp_path)
    request = TokenizerRequest("bert", "wordpiece", "bert-base-uncased", "google-bert/bert-base-uncased", 300, True)
    with caplog.at_level(logging.WARNING):
        tokenizer, source = load_tokenizer(request, tokenizer_path=None, cache_dir=None,
                                           training_texts=lambda: ["the cat sat on the mat"] * 20)
    assert source.startswith("trained:")
    assert any("google-bert/bert-base-uncased" in r.getMessage() and "trained" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    assert tokenizer.convert_ids_to_tokens(tokenizer("the cat", "sat")["input_ids"]) == \
        ["[CLS]", "the", "cat", "[SEP]", "sat", "[SEP]"]


def test_gpt2_trains_on_full_packed_blocks_whose_labels_are_the_input_ids(tokenizers, squad_examples):
    tokenizer, _ = tokenizers
    data = tokenize_examples(lambda exs: encode_gpt2(tokenizer, exs, 128), squad_examples[:8])
    batch = gpt2_collator(tokenizer, 128)([data[i] for i in range(len(data))])
    assert batch["input_ids"].shape[1] == 128 and "attention_mask" not in batch  # no padding anywhere
    assert torch.equal(batch["labels"], batch["input_ids"])
    texts = tokenizer.decode(data.columns["input_ids"]).split(tokenizer.eos_token)  # the blocks, joined again
    assert texts[0] == squad_examples[0].text + " " + squad_examples[0].text_pair
    assert texts[1] == squad_examples[1].text + " " + squad_examples[1].text_pair


def test_bert_examples_are_cls_question_sep_context_sep_with_token_types(tokenizers, squad_examples):
    _, tokenizer = tokenizers
    item = tokenize_examples(lambda exs: encode_bert(tokenizer, exs, 256), squad_examples[:1])[0]
    tokens = tokenizer.convert_ids_to_tokens(item["input_ids"])
    first_sep = tokens.index("[SEP]")
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and tokens.count("[SEP]") == 2
    assert item["token_type_ids"] == [0] * (first_sep + 1) + [1] * (len(tokens) - first_sep - 1)
    assert tokenizer.decode(item["input_ids"][1:first_sep]) == squad_examples[0].text.lower()


def test_long_context_continues_in_overflow_windows_each_with_its_question(tokenizers, squad_examples):
    _, tokenizer = tokenizers
    data = tokenize_examples(lambda exs: encode_bert(tokenizer, exs, 48), squad_examples[:1])
    assert len(data) > 1
    questions = {tuple(data[i]["input_ids"][:data[i]["input_ids"].index(tokenizer.sep_token_id)]) for i in range(len(data))}
    assert len(questions) == 1 and all(len(data[i]["input_ids"]) <= 48 for i in range(len(data)))


def test_mlm_masks_about_15_percent_of_the_non_special_tokens(tokenizers, squad_examples):
    _, tokenizer = tokenizers
    data = tokenize_examples(lambda exs: encode_bert(tokenizer, exs, 128), squad_examples)
    examples = [data[i] for i in range(len(data))]
    torch.manual_seed(0)
    batch = MaskedLMCollator(tokenizer, 128)(examples)
    special = torch.zeros_like(batch["labels"], dtype=torch.bool)
    for row, ex in enumerate(examples):
        special[row, :len(ex["input_ids"])] = torch.tensor(ex["special_tokens_mask"], dtype=torch.bool)
        special[row, len(ex["input_ids"]):] = True  # padding
    masked = batch["labels"] != -100
    assert not (masked & special).any()
    fraction = masked.sum().item() / (~special).sum().item()
    assert 0.14 < fraction < 0.16, fraction
    replaced = (batch["input_ids"] == tokenizer.mask_token_id) & masked
    assert 0.75 < replaced.sum().item() / masked.sum().item() < 0.85  # BERT's 80/10/10 recipe


def test_mlm_batch_without_any_masked_token_is_masked_again(tokenizers):
    _, tokenizer = tokenizers
    short = [{"input_ids": [tokenizer.cls_token_id, 100, tokenizer.sep_token_id], "special_tokens_mask": [1, 0, 1],
              "token_type_ids": [0, 0, 0], "attention_mask": [1, 1, 1]}]
    collate = MaskedLMCollator(tokenizer, 16)
    for seed in range(20):  # one maskable token: 85% of raw draws mask nothing
        torch.manual_seed(seed)
        assert (collate(short)["labels"] != -100).sum() == 1


# ---- resumable data order ---------------------------------------------------------------------------------------
def test_batch_stream_resumes_mid_epoch_and_across_epochs_with_the_same_batches(tokenizers, squad_examples):
    tokenizer, _ = tokenizers
    data = tokenize_examples(lambda exs: encode_gpt2(tokenizer, exs, 32), squad_examples[:14])  # 40 blocks

    def stream():
        return BatchStream(build_dataloader(data, gpt2_collator(tokenizer, 32), batch_size=4, rank=1, world_size=2,
                                            seed=7, train=True, pin_memory=False))

    reference = stream()
    expected = [next(reference)["input_ids"] for _ in range(12)]  # 5 batches per epoch: crosses two epochs
    for cut in (3, 5, 7):
        original = stream()
        for _ in range(cut):
            next(original)
        resumed = stream()
        assert resumed.load_state_dict(original.state_dict())
        assert all(torch.equal(next(resumed)["input_ids"], expected[i]) for i in range(cut, 12))
    assert not torch.equal(expected[0], expected[5])  # a new epoch is reshuffled


# ---- throughput arithmetic --------------------------------------------------------------------------------------
def test_mfu_peak_comes_from_the_gpu_name_and_precision(monkeypatch):
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops_per_gpu(gpu, "bf16") == pytest.approx(756e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops_per_gpu(gpu, "bf16") == pytest.approx(989.4e12)
    assert peak_flops_per_gpu(gpu, "fp32") == pytest.approx(66.9e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_flops_per_gpu(gpu, "bf16") is None
    assert peak_flops_per_gpu(gpu, "bf16", override_tflops=100) == pytest.approx(100e12)
    assert peak_flops_per_gpu(torch.device("cpu"), "bf16") is None
    # GPT-2 124M at 1024 tokens: 6N + 12*L*H*T, about 0.8 GFLOP per token
    assert flops_per_token(85_000_000, 12, 768, 1024) == pytest.approx(6 * 85e6 + 12 * 12 * 768 * 1024)
